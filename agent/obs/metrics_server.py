"""The metrics endpoint: ``GET /metrics`` on ``metrics.address:metrics.port``.

Served by aiohttp on the daemon's event loop (aiohttp already comes with
aiobotocore), so a scrape reads the store from the one thread that changes it,
and shutting down is closing a server, not stopping a thread.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
from collections.abc import AsyncIterator

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from agent._config import ConfigError

__all__ = ["serve_metrics"]

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def serve_metrics(
    registry: CollectorRegistry, address: str, port: int
) -> AsyncIterator[tuple[str, int]]:
    """Serve ``registry`` over HTTP for the life of the block; yields the bound (host, port)."""

    async def metrics(request: web.Request) -> web.Response:
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encode(registry), headers={"Content-Type": content_type})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, address, port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            raise ConfigError(
                f"Cannot serve metrics on {address}:{port}: {exc.strerror or exc}. Choose "
                "another metrics.port (or 0 to turn the endpoint off)."
            ) from exc
        bound = runner.addresses[0]
        host, bound_port = str(bound[0]), int(bound[1])
        log.info(
            "serving metrics on http://%s:%d/metrics",
            host,
            bound_port,
            extra={"address": host, "port": bound_port},
        )
        _warn_beyond_loopback(runner.addresses)
        yield host, bound_port
    finally:
        await runner.cleanup()


def _warn_beyond_loopback(addresses: list[tuple[object, ...]]) -> None:
    """Warn when the endpoint is reachable from the network, not only from this node."""
    exposed = [
        f"{host}:{port}"
        for host, port, *_ in addresses
        if not ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    ]
    if exposed:
        log.warning(
            "metrics are served on %s, which is not loopback: anyone who can reach this node "
            "on that port (other pods, other hosts) can read them, with no authentication: "
            "request rates and outcomes, what the cache holds and which engines run. Keep "
            'metrics.address = "127.0.0.1" and scrape from the node, or limit the port with a '
            "NetworkPolicy or firewall.",
            ", ".join(exposed),
            extra={"address": ", ".join(exposed)},
        )
