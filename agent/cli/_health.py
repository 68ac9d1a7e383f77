"""``prewarm health``: ask the agent's standard gRPC health service, for probes and scripts.

Kubernetes' native ``grpc:`` probe only dials TCP ports, and the agent serves on a
Unix socket only, so the DaemonSet's probes run this command (``exec:``) instead.
It makes one ``grpc.health.v1.Health/Check`` call and answers with its exit status:

- 0: SERVING (the cache index is rebuilt and the sockets are bound);
- 1: the agent answered but is not serving (starting, or draining after SIGTERM);
- 3: no agent could be reached on the socket (said as every command says it:
  ``agent.client._unreachable``), or none answered within ``--timeout``.

``--wait-for-agent SECONDS`` makes it an init container's wait: it follows the
health service's Watch stream (grpc waits for the socket to appear) until the
agent reports SERVING, or the time runs out.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import grpc
import typer
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent.client import AgentUnavailable, wait_for_agent
from agent.client._exceptions import translate_rpc_error
from agent.client._transport import CHANNEL_OPTIONS, channel_target, resolve_socket_path

from ._errors import EXIT_NO_AGENT, say
from ._options import JsonOption, SocketOption, WaitForAgentOption

__all__ = ["health_command"]

# The agent answered, but is not serving (starting, or draining after SIGTERM).
EXIT_NOT_SERVING = 1


def health_command(
    *,
    socket: SocketOption = None,
    service: Annotated[
        str,
        typer.Option(help="Health service name; empty is the whole agent, or prewarm.v1.Prewarm."),
    ] = "",
    timeout: Annotated[float, typer.Option(min=0.1, help="Seconds to wait for an answer.")] = 3.0,
    json_out: JsonOption = False,
    wait_for_agent: WaitForAgentOption = 0.0,
) -> None:
    """Exit 0 if the agent reports SERVING, 1 if it answers otherwise, 3 if it does not answer.

    With --wait-for-agent SECONDS (an init container on a new node), wait that long for the
    agent to start and report SERVING before answering.
    """
    path = resolve_socket_path(socket)
    try:
        if wait_for_agent > 0:
            status, error = _wait_until_serving(path, service, wait_for_agent)
        else:
            status, error = _check(path, service, timeout)
    except AgentUnavailable as exc:
        status, error = "UNREACHABLE", str(exc)
    if json_out:
        document = {"socket": str(path), "service": service, "status": status, "error": error}
        sys.stdout.write(json.dumps(document) + "\n")
    elif error:
        say(f"error: {error}")
    else:
        sys.stdout.write(f"{status}\n")
    if status == "SERVING":
        return
    raise typer.Exit(EXIT_NO_AGENT if status == "UNREACHABLE" else EXIT_NOT_SERVING)


def _check(path: Path, service: str, timeout: float) -> tuple[str, str]:
    """(status name, error sentence or "")."""
    with grpc.insecure_channel(channel_target(path), options=CHANNEL_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return _unanswered(exc, path, service, timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status), ""


def _unanswered(exc: grpc.RpcError, path: Path, service: str, timeout: float) -> tuple[str, str]:
    """(status name, error sentence) for a Check that failed: a socket that cannot be
    reached is diagnosed by the client, in the words every other command uses."""
    code = exc.code()
    if code == grpc.StatusCode.NOT_FOUND:
        return "SERVICE_UNKNOWN", f"the agent on {path} knows no service {service!r}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "UNREACHABLE", f"the prewarm agent on {path} did not answer within {timeout:g} s"
    return "UNREACHABLE", str(translate_rpc_error(exc, path))


def _wait_until_serving(path: Path, service: str, seconds: float) -> tuple[str, str]:
    """Wait for the socket, then follow the health Watch stream until SERVING or the deadline."""
    deadline = time.monotonic() + seconds
    wait_for_agent(path, seconds, waiting=_say_waiting)
    request = health_pb2.HealthCheckRequest(service=service)
    status = "UNREACHABLE"
    with grpc.insecure_channel(channel_target(path), options=CHANNEL_OPTIONS) as channel:
        updates = health_pb2_grpc.HealthStub(channel).Watch(
            request, timeout=max(deadline - time.monotonic(), 0.1)
        )
        try:
            for update in updates:
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(update.status)
                if status == "SERVING":
                    return status, ""
        except grpc.RpcError:
            pass  # the deadline, or the agent went away: report what was last seen
        finally:
            updates.cancel()
    return status, f"the prewarm agent on {path} was not SERVING within {seconds:g} s ({status})"


def _say_waiting(why: str) -> None:
    say(f"the agent is not serving yet ({why}); waiting for it", prefix="prewarm: ")
    sys.stderr.flush()
