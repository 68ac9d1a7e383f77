"""Test doubles and fixtures' building blocks for prewarm, shipped with the package.

- ``S3Server``: moto's S3 server in a subprocess on loopback, recording every
  request (``RecordedRequest``); stop or kill it to simulate an outage.
- ``AgentProcess``: the real daemon (``python -m agent``) on a private socket
  and private tier roots, ready when its gRPC health service says SERVING
  (``AgentTimeouts``: how long starting and stopping may take).
- ``InProcessAgent``: the same ``serve()`` on a thread of the calling process,
  for tests that are not about the process (one at a time per process).
- ``make_safetensors_model`` / ``upload_directory`` / ``upload_model``: sharded
  safetensors models in the Hugging Face layout, and putting them in a bucket.
- ``NotifySocket``: systemd's end of sd_notify (``$NOTIFY_SOCKET``), recording
  each ``NotifyMessage`` a daemon sends, in order.
- ``MemorySource``: an in-memory stand-in for S3 behind the puller's
  ObjectSource interface, with scripted mid-transfer failures (``RangeRead``
  records what was asked of it).
- ``FaultProxy``: a loopback HTTP proxy in front of an S3 server that answers
  requests matching a ``Fault`` rule with a 500, a 503 SlowDown, a reset, a
  truncated body or a stalled one.
- ``make_keys`` / ``SigningKeys``: an Ed25519 key pair laid out as the agent
  reads compile-cache signing keys; every test agent signs with and trusts a
  shared pair (``shared_keys``). ``make_publisher_keys`` and ``sign_model``: a
  model publisher's EC key pair and its model-signing signature.
- ``HttpProxy``: a loopback forward proxy (CONNECT tunnels and absolute-form
  requests, optionally demanding credentials) that records each
  ``ProxiedRequest`` it served.

Importing this package needs only the agent's own dependencies; moto, boto3,
numpy and safetensors (the ``dev`` extra) are imported when first used.
"""

from ._daemon import AgentProcess, AgentStartupError, AgentTimeouts
from ._fault_proxy import Fault, FaultKind, FaultProxy
from ._http_proxy import HttpProxy, ProxiedRequest
from ._inprocess import InProcessAgent
from ._memory_source import MemorySource, RangeRead
from ._models import SampleModel, make_safetensors_model, upload_directory, upload_model
from ._s3server import CONTROL_PATH, RecordedRequest, S3Server, S3ServerError
from ._sdnotify import NotifyMessage, NotifySocket
from ._signing import (
    SigningKeys,
    make_keys,
    make_publisher_keys,
    sealed_with_shared_key,
    shared_keys,
    sign_model,
    unsealed,
)

__all__ = [
    "CONTROL_PATH",
    "AgentProcess",
    "AgentStartupError",
    "AgentTimeouts",
    "Fault",
    "FaultKind",
    "FaultProxy",
    "HttpProxy",
    "InProcessAgent",
    "MemorySource",
    "NotifyMessage",
    "NotifySocket",
    "ProxiedRequest",
    "RangeRead",
    "RecordedRequest",
    "S3Server",
    "S3ServerError",
    "SampleModel",
    "SigningKeys",
    "make_keys",
    "make_publisher_keys",
    "make_safetensors_model",
    "sealed_with_shared_key",
    "shared_keys",
    "sign_model",
    "unsealed",
    "upload_directory",
    "upload_model",
]
