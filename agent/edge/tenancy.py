"""The tenant of every request: the socket it came in on, bound before the servicer runs.

grpcio gives no peer credentials on a Unix socket, so a socket is an identity:
the admin mounts each tenant's socket into that tenant's pods only. Each
socket's server carries one ``TenantBinder``, which admits or refuses each
call by what the socket's tenant may ask, checks the pod's credentials when
the request sends them, and adds ``tenant`` to the request's log context. The
socket's servicer puts the same tenant (and credentials) in each request as
its ``Requester``, where agent.service.access reads them.

Tenant sockets serve what a pod needs (ensure, leases, status, compile
caches); the RPCs that show or change every tenant's snapshots (list, get,
evict, pin, garbage collection, verify) stay on the node's own API socket.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from agent._exceptions import AccessDenied, InvalidRequest
from agent.obs.logs import bind_request
from agent.service.access import (
    NODE_TENANT,
    Requester,
    RequesterKeys,
    Tenant,
    check_source,
)

__all__ = ["NODE_ONLY_METHODS", "TenantBinder", "requester_keys"]

if TYPE_CHECKING:
    Context = grpc.aio.ServicerContext[Any, Any]
    Handler = grpc.RpcMethodHandler[Any, Any]

NODE_ONLY_METHODS = frozenset(
    {
        "GetModel",
        "ListModels",
        "EvictModel",
        "PinModel",
        "CollectGarbage",
        "VerifyModels",
        "EvictCompileCache",
        # Moves a whole key through S3 (download, pack, upload) on demand: maintenance
        # for the node's admin, not something a pod needs or should be able to repeat.
        "CompactCompileCache",
    }
)
# RPCs that read or write the compile-cache prefix in S3.
_COMPILE_S3_METHODS = frozenset(
    {
        "EnsureCompileCache",
        "PushCompileCache",
        "PullCompileCache",
        "CompileReady",
        "ExplainCompileCache",
    }
)
# Bigger than any real key (AKIA/ASIA ids are 20 characters, secrets 40, STS
# session tokens a few KiB), small enough that no request can carry a flood.
_KEY_LIMITS = {"access_key_id": 128, "secret_access_key": 256, "session_token": 8192}


class TenantBinder(grpc.aio.ServerInterceptor):
    """Admits every call of the prewarm service on one socket by what its tenant may ask."""

    def __init__(self, service: str, tenant: Tenant, compile_cache_uri: str | None) -> None:
        self._prefix = f"/{service}/"
        self._tenant = tenant
        self._compile_cache_uri = compile_cache_uri

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        """The method's handler, wrapped so that each call is admitted before it runs."""
        handler = await continuation(handler_call_details)
        full_name: str = handler_call_details.method
        if handler is None or not full_name.startswith(self._prefix):
            return handler
        method = full_name.removeprefix(self._prefix)
        if inspect.iscoroutinefunction(handler.unary_unary):
            return grpc.unary_unary_rpc_method_handler(
                self._unary(method, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if inspect.isasyncgenfunction(handler.unary_stream):
            return grpc.unary_stream_rpc_method_handler(
                self._unary_stream(method, handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    def _unary(
        self, method: str, behaviour: Callable[[Any, Context], Awaitable[Any]]
    ) -> Callable[[Any, Context], Awaitable[Any]]:
        async def bound(request: Any, context: Context) -> Any:
            await self._admit(method, request, context)
            return await behaviour(request, context)

        return bound

    def _unary_stream(
        self, method: str, behaviour: Callable[[Any, Context], AsyncIterator[Any]]
    ) -> Callable[[Any, Context], AsyncIterator[Any]]:
        async def bound(request: Any, context: Context) -> AsyncIterator[Any]:
            await self._admit(method, request, context)
            async for response in behaviour(request, context):
                yield response

        return bound

    async def _admit(self, method: str, request: Any, context: Context) -> None:
        """Let the call run, or end it with the reason it is refused."""
        tenant = self._tenant
        bind_request(tenant=tenant.name)  # log context only
        keys = requester_keys(request)
        _check_method(tenant, method, request, keys)
        if method in _COMPILE_S3_METHODS and self._compile_cache_uri:
            check_source(self._compile_cache_uri, Requester(tenant, keys))


def _check_method(tenant: Tenant, method: str, request: Any, keys: RequesterKeys | None) -> None:
    if tenant.name != NODE_TENANT and method in NODE_ONLY_METHODS:
        raise AccessDenied(
            f"{method} is not served on socket {tenant.name!r}: it is for the node's admin "
            "(it shows or changes what every tenant shares). Use the node's own API socket."
        )
    if tenant.name != NODE_TENANT and getattr(request, "pin", False):
        # Refused, not capped: a pin outlives restarts and every eviction, for all
        # tenants, and is not owned by whoever set it, so a per-tenant count could
        # not be kept honest. PinModel is node-only for the same reason.
        raise AccessDenied(
            f"pin=true is not served on socket {tenant.name!r}: a pin keeps the snapshot on "
            "the node past every eviction and restart. Ask without pin; the node's admin "
            "pins models with a models.d manifest or `prewarm pin`."
        )
    checked = keys is not None or tenant.requester_scoped
    if checked and getattr(request, "cached_only", False):
        raise AccessDenied(
            "cached_only answers without asking S3, so it cannot check the pod's access; "
            f"socket {tenant.name!r} checks every request. Leave cached_only off."
        )


def requester_keys(request: Any) -> RequesterKeys | None:
    """The pod's credentials from the request, size-checked; None when it sent none."""
    if "requester_credentials" not in request.DESCRIPTOR.fields_by_name:
        return None
    if not request.HasField("requester_credentials"):
        return None
    sent = request.requester_credentials
    for name, limit in _KEY_LIMITS.items():
        if len(getattr(sent, name)) > limit:
            raise InvalidRequest(
                f"requester_credentials.{name} is over {limit} characters; send the pod's "
                "real AWS credentials."
            )
    if not sent.access_key_id or not sent.secret_access_key:
        raise InvalidRequest(
            "requester_credentials needs access_key_id and secret_access_key; the pod's "
            "credential chain found none."
        )
    return RequesterKeys(sent.access_key_id, sent.secret_access_key, sent.session_token)
