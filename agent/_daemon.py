"""prewarmd: the daemon's entry point, socket set-up and orderly shutdown."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import platform
import pwd
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import NoReturn

from agent._config import (
    ConfigError,
    LeaseSettings,
    Settings,
    TierSettings,
    load_settings,
    render_toml,
    unknown_environment,
)
from agent._exceptions import PrewarmError
from agent._fs import blocking_ancestor
from agent._version import __version__
from agent.check.signatures import signature_rules
from agent.compile.cache import NODE_SCOPE, CompileCaches, Scope
from agent.compile.domains import domain_specs
from agent.compile.keys import CompileKeyParts
from agent.edge.connection_limits import raise_descriptor_limit
from agent.edge.lease_socket import LeaseServer
from agent.edge.server import ApiServer, ServerLimits, TenantSocket
from agent.leases.held_file import HELD_LEASES_NAME
from agent.leases.keeper import LeaseKeeper
from agent.leases.table import LeaseTable
from agent.obs.logs import configure_logging
from agent.obs.metrics import REGISTRY, StateCollector, StateReading, TierReading
from agent.obs.sdnotify import SystemdNotifier
from agent.prefetch.manifests import CompileCacheHook, ManifestWatcher
from agent.prefetch.schema import CompileSpec
from agent.pull.puller import Puller
from agent.service import access as access_rules
from agent.service.operations import AgentService
from agent.source.s3 import S3Source
from agent.store.catalog import Store
from agent.store.claim import claim_root
from agent.store.records import TierBudget
from agent.store.roots import traverse_group_id

__all__ = ["exit_with", "main", "serve"]

log = logging.getLogger("agent.daemon")


async def serve(settings: Settings, stop: asyncio.Event | None = None) -> None:
    """Run the agent until ``stop`` is set.

    Without ``stop``, SIGTERM and SIGINT stop it (the daemon's own loop, on the
    main thread). A caller that passes ``stop`` owns stopping, so ``serve`` can
    run on a loop in any thread (``agent.testing.InProcessAgent``).
    """
    if stop is None:
        stop = _stop_on_signals()
    _check_access(settings)
    _check_paths_creatable(settings)
    node, tenants = access_rules.tenants_from_settings(settings)
    notifier = SystemdNotifier.from_environment()
    store = await _open_store(settings.tiers, notifier)
    try:
        await _serve_store(
            settings, store, node=node, tenants=tenants, notifier=notifier, stop=stop
        )
    finally:
        store.close()
    log.info("stopped")


async def _serve_store(
    settings: Settings,
    store: Store,
    *,
    node: access_rules.Tenant,
    tenants: dict[str, access_rules.Tenant],
    notifier: SystemdNotifier,
    stop: asyncio.Event,
) -> None:
    """Serve from the opened store until ``stop`` is set, then drain."""
    api = _api_server(settings, node, tenants)
    api.claim()
    raise_descriptor_limit(api.connection_capacity)
    leases = _lease_table(settings.leases)
    keeper = LeaseKeeper(
        leases, settings.tiers.shm_root / HELD_LEASES_NAME, lambda key: store.get(key) is not None
    )

    async with (
        S3Source(settings.s3) as source,
        Puller(
            store, source, settings.s3, settings.integrity, signatures=signature_rules(settings)
        ) as puller,
        # Before the service starts: compile caches count in the disk budget.
        CompileCaches(settings, store, source) as compile_caches,
        # Leases held before a restart, back before any hello and any eviction.
        keeper,
        LeaseServer(
            leases, settings.lease_socket_path, settings.socket_mode, settings.socket_group
        ),
        # Left before the lease socket closes its connections: the last state is kept.
        keeper.saving(),
        # Owned by serve(), closed before the puller: metrics endpoint, manifest watcher.
        contextlib.AsyncExitStack() as background,
    ):
        service = AgentService(store, puller, source, leases, settings=settings)
        await service.start()
        await background.enter_async_context(
            _metrics_and_manifests(service, settings, compile_caches, node=node)
        )
        async with api.serving(service, compile_caches):
            describe = functools.partial(_describe, store, puller, settings.socket_path)
            log.info(
                "prewarmd %s serving",
                __version__,
                extra={"socket": str(settings.socket_path), "models": len(store.models())},
            )
            # Both sockets are bound and the store reconciled: pods can be served.
            notifier.ready(describe())
            async with notifier.heartbeat(describe):
                await stop.wait()
            await _drain(
                api,
                compile_caches,
                notifier=notifier,
                grace=settings.shutdown_grace_seconds,
                pulls_in_flight=len(puller.flights()),
            )


def _stop_on_signals() -> asyncio.Event:
    """An event SIGTERM and SIGINT set: the daemon's own loop, on the main thread."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    return stop


async def _open_store(tiers: TierSettings, notifier: SystemdNotifier) -> Store:
    """The node cache, reconciled from what the tier roots hold."""
    notifier.status(f"Reconciling the cache in {tiers.shm_root} and {tiers.disk_root}")
    store = Store(
        {"shm": tiers.shm_root, "disk": tiers.disk_root},
        {
            "shm": TierBudget(tiers.shm_budget, tiers.shm_reserve),
            "disk": TierBudget(tiers.disk_budget, tiers.disk_reserve),
        },
        traverse_group=traverse_group_id(tiers.group),
    )
    await store.open()
    return store


def _lease_table(leases: LeaseSettings) -> LeaseTable:
    return LeaseTable(
        leases.default_ttl_seconds, leases.max_ttl_seconds, max_per_peer=leases.max_per_peer
    )


async def _drain(
    api: ApiServer,
    compile_caches: CompileCaches,
    *,
    notifier: SystemdNotifier,
    grace: float,
    pulls_in_flight: int,
) -> None:
    """Stop in order: say so, let requests finish within the grace, end compile locks."""
    notifier.stopping(
        f"Stopping: draining requests for up to {grace:g} s; "
        f"{_count(pulls_in_flight, 'pull')} in flight will stay resumable"
    )
    log.info("stopping: draining requests", extra={"grace": grace})
    await api.drain()
    # A held compile lock is a stream that never ends by itself: end them now
    # rather than make the drain wait out its grace period.
    compile_caches.locks.close()


def _check_access(settings: Settings) -> None:
    """Refuse tenant sockets that clash with the agent's own; warn while any source goes."""
    access = settings.access
    own = {settings.socket_path, settings.lease_socket_path}
    for entry in access.sockets:
        if entry.path in own:
            raise ConfigError(
                f"[[access.sockets]] {entry.name!r} uses {entry.path}, which is the agent's own "
                "API or lease socket. Give the tenant a path of its own."
            )
    if not access.sources:
        log.warning(
            "[access] sources is empty: any S3 source may be cached (the behaviour before "
            'access controls). Set e.g. sources = ["s3://models-prod/*"] to allow only yours.'
        )
    _check_compile_domains(settings)
    compile_uri = settings.compile_cache.uri
    if compile_uri and access.sources:
        node, _ = access_rules.tenants_from_settings(settings)
        try:
            access_rules.check_source(compile_uri, access_rules.Requester(node))
        except PrewarmError as exc:
            raise ConfigError(f"compile_cache.uri: {exc}") from exc


def _check_paths_creatable(settings: Settings) -> None:
    """Refuse, before anything is created, a start that could not create all it needs.

    Tier roots that exist are checked by the store (owner, mode, links); here only
    whether the missing ones, and each socket, can be made by this user.
    """
    roots = {
        "the shm tier root": settings.tiers.shm_root,
        "the disk tier root": settings.tiers.disk_root,
    }
    sockets = {
        "the API socket": settings.socket_path,
        "the lease socket": settings.lease_socket_path,
        **{f"the socket of tenant {t.name!r}": t.path for t in settings.access.sockets},
    }
    wanted = [
        *((what, path) for what, path in roots.items() if not path.is_dir()),
        *sockets.items(),
    ]
    blocked = []
    for what, path in wanted:
        blocker = blocking_ancestor(path)
        if blocker is not None:
            blocked.append(f"{what} {path} ({blocker} is not writable)")
    if blocked:
        uid = os.geteuid()
        raise ConfigError(
            f"prewarmd cannot create what it needs as uid {uid}: {'; '.join(blocked)}. Run it "
            "as root (the systemd unit and the DaemonSet do), or give it paths this user may "
            "create: tiers.shm_root, tiers.disk_root and socket_path in a config file (see "
            "'Run your own daemon' in the README), or e.g. PREWARM_TIERS__SHM_ROOT="
            "/dev/shm/prewarm-$USER PREWARM_TIERS__DISK_ROOT=$HOME/.cache/prewarm "
            "PREWARM_SOCKET_PATH=$XDG_RUNTIME_DIR/prewarm/agent.sock. Nothing was created."
        )


def _check_compile_domains(settings: Settings) -> None:
    """Refuse groups that do not exist; warn where only mounts keep domains' pods apart."""
    by_group: dict[int, list[str]] = {}
    for spec in domain_specs(settings).values():
        by_group.setdefault(spec.gid, []).append(spec.name)
    for gid, names in by_group.items():
        if len(names) > 1:
            log.warning(
                "compile domains %s share group %d: their pods can write each other's compile "
                "caches unless each pod mounts only its own domain's directory. Give each "
                "tenant socket a group of its own.",
                ", ".join(sorted(names)),
                gid,
            )


def _api_server(
    settings: Settings, node: access_rules.Tenant, tenants: dict[str, access_rules.Tenant]
) -> ApiServer:
    """The API socket for the node's own callers, and one socket per tenant."""
    return ApiServer(
        TenantSocket(settings.socket_path, settings.socket_mode, settings.socket_group, node),
        ServerLimits(
            settings.shutdown_grace_seconds,
            max_request_bytes=int(settings.access.max_request_bytes),
            max_connections=settings.access.max_connections_per_socket,
        ),
        tenant_sockets=[
            TenantSocket(entry.path, entry.mode, entry.group, tenants[entry.name])
            for entry in settings.access.sockets
        ],
        compile_cache_uri=settings.compile_cache.uri,
    )


def _describe(store: Store, puller: Puller, socket_path: Path) -> str:
    """One line for ``systemctl status``."""
    models = store.models()
    size = sum(model.total_bytes for model in models) / 1024**3
    return (
        f"Serving on {socket_path}: {_count(len(models), 'model')} cached ({size:.1f} GiB), "
        f"{_count(len(puller.flights()), 'pull')} in flight"
    )


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


@contextlib.asynccontextmanager
async def _metrics_and_manifests(
    service: AgentService,
    settings: Settings,
    compile_caches: CompileCaches,
    *,
    node: access_rules.Tenant,
) -> AsyncIterator[None]:
    """The metrics endpoint (when metrics.port is set) and the prefetch manifests.

    The manifests' prefetches ask as ``node``: its sources, its limits.
    """
    collector = StateCollector(lambda: _state_reading(service))
    REGISTRY.register(collector)
    try:
        async with contextlib.AsyncExitStack() as stack:
            if settings.metrics.port:
                # aiohttp's server side (about 0.1 s to import) only where metrics are on.
                from agent.obs.metrics_server import serve_metrics

                await stack.enter_async_context(
                    serve_metrics(REGISTRY, settings.metrics.address, settings.metrics.port)
                )
            await stack.enter_async_context(
                ManifestWatcher(
                    service,
                    settings.manifests,
                    settings.tiers.disk_root / "prefetch-pins.json",
                    compile_cache=_manifest_compile_hook(compile_caches),
                    requester=access_rules.Requester(node),
                )
            )
            yield
    finally:
        REGISTRY.unregister(collector)


def _manifest_compile_hook(compile_caches: CompileCaches) -> CompileCacheHook:
    """Restores the compile cache a manifest entry names, once its model is cached."""

    async def restore(spec: CompileSpec, model_key: str) -> object:
        parts = CompileKeyParts(**spec.key_parts(), model_key=model_key)
        scope = Scope(spec.domain) if spec.domain else NODE_SCOPE
        return await compile_caches.ensure(parts, scope=scope, client_name="prefetch manifest")

    return restore


def _state_reading(service: AgentService) -> StateReading:
    status = service.status()
    return StateReading(
        tiers=tuple(
            TierReading(
                t.tier,
                t.used_bytes,
                t.staging_bytes,
                t.budget_bytes,
                t.model_count,
                free_bytes=t.free_bytes,
                capacity_bytes=t.capacity_bytes,
            )
            for t in status.tiers
        ),
        pulls_in_flight=len(status.pulls),
        leases=status.lease_count,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prewarmd", description="prewarm node agent: caches models from S3 on this node."
    )
    parser.add_argument("--config", type=Path, help="config file (default /etc/prewarm/agent.toml)")
    parser.add_argument("--socket", type=Path, help="Unix socket to serve on (overrides config)")
    parser.add_argument(
        "--print-config", action="store_true", help="print the effective settings and exit"
    )
    parser.add_argument(
        "--claim-roots",
        action="store_true",
        help="as root, before an agent that is not root starts: move aside a tier root another "
        "user made first in a shared directory (/dev/shm), give the root to --owner, and exit",
    )
    parser.add_argument(
        "--owner",
        default=str(os.geteuid()),
        help="with --claim-roots: the user (name or uid) the agent runs as (default: this one)",
    )
    parser.add_argument("--version", action="version", version=f"prewarmd {__version__}")
    return parser


def _claim_roots(settings: Settings, owner: str) -> int:
    """``--claim-roots``: one line per tier root on stderr; 1 if a root cannot be claimed."""
    try:
        uid = int(owner) if owner.isdigit() else pwd.getpwnam(owner).pw_uid
    except KeyError:
        print(f"prewarmd: --owner {owner!r} is no user on this host.", file=sys.stderr)
        return 2
    for root in (settings.tiers.shm_root, settings.tiers.disk_root):
        try:
            claim = claim_root(Path.cwd() / root, uid)
        except OSError as exc:
            print(f"prewarmd: cannot claim {root}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        print(f"prewarmd: {claim}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        settings = load_settings(args.config)
        if args.socket is not None:
            settings = settings.model_copy(update={"socket_path": args.socket})
    except ConfigError as exc:
        print(f"prewarmd: {exc}", file=sys.stderr)
        return 2
    ignored = unknown_environment()
    if args.print_config:
        for sentence in ignored:
            print(f"prewarmd: warning: {sentence}", file=sys.stderr)
        sys.stdout.write(render_toml(settings))
        return 0
    if args.claim_roots:
        return _claim_roots(settings, args.owner)
    configure_logging(settings.log_level)
    for sentence in ignored:
        log.warning(sentence)
    return_large_buffers()  # before any thread: freed data-plane buffers go back to the OS
    try:
        asyncio.run(serve(settings))
    except (PrewarmError, ExceptionGroup) as exc:
        reason = _startup_error(exc)
        if reason is None:
            raise
        log.error("cannot start: %s", reason)
        SystemdNotifier.from_environment().status(f"Cannot start: {reason}")
        return 1
    return 0


def exit_with(code: int) -> NoReturn:
    """End the process with ``code`` once ``main()`` has returned, skipping Python's teardown.

    By then every part is closed and what it keeps on disk written. What is left
    is the interpreter's own finalization, which frees module by module all that
    the daemon imported (botocore, pydantic, grpc): about 0.4 s of CPU at every
    stop, for nothing. Logging and the standard streams are flushed first; an
    exception out of ``main()`` never gets here and exits as usual.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _startup_error(exc: BaseException) -> PrewarmError | None:
    """The PrewarmError that stopped the start, also out of a TaskGroup's ExceptionGroup
    (a part that owns tasks wraps what fails inside its block); None for anything else."""
    if isinstance(exc, PrewarmError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        causes = [_startup_error(inner) for inner in exc.exceptions]
        if causes and all(causes):
            return causes[0]
    return None


# Freed large buffers go back to the operating system (glibc's malloc).
#
# glibc serves an allocation above ``M_MMAP_THRESHOLD`` (128 KiB) with a mapping
# of its own and unmaps it when it is freed, but by default it raises that
# threshold to the size of each such block freed (up to 32 MiB). After the first
# data-plane buffer (512 KiB per worker thread of the threads plane) was freed,
# the next ones came from the worker threads' malloc arenas, which keep what they
# held: three rounds of 64 concurrent cold pulls left the daemon at 340 MB instead
# of about 110 MB, and 16 pulls at 179 MB instead of 110 MB. Setting the threshold
# explicitly turns that adjustment off (mallopt(3)); a buffer then costs one mmap
# and one munmap, once per worker and pull.

# mallopt(3) parameter numbers, and glibc's default threshold.
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 128 * 1024


def return_large_buffers() -> bool:
    """Fix glibc's mmap threshold at its default for this process; False where not glibc.

    Call at start, before the process has threads: the setting is process-wide.
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD))
