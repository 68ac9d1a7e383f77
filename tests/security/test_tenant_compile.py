"""Compile caches between tenants, as a hostile tenant's pods would try them (issue 16, 3 and 4).

The real daemon serving two tenant sockets, the moto S3 server as the shared compile-cache
prefix, and pods played by the test (root, as many engine images run) and by child processes
run as an unprivileged user in one tenant's group.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import AgentFactory, when_logged

from agent._exceptions import AccessDenied, NoSpace, NotFound
from agent.client import Client, CompileKeyParts, Progress
from agent.testing import Fault, FaultProxy, InProcessAgent, S3Server, SampleModel, unsealed
from agent.testing._process import purge_tree

PARTS = CompileKeyParts(torch_version="2.13.0", model_key="shared-model")
NOBODY = 65534
# Two groups every Debian-like system has: one tenant's pods in each.
GROUP_A, GROUP_B = "audio", "voice"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: Unix socket paths are limited to 107 bytes."""
    directory = Path(tempfile.mkdtemp(prefix="pw-tc-", dir="/tmp"))
    yield directory
    purge_tree(directory)


def _config(bucket: str, sockets: Path, extra: str = "", groups: bool = False) -> str:
    """Two tenants, team-a and team-b, and a compile-cache prefix in ``bucket``."""
    config = f'[compile_cache]\nuri = "s3://{bucket}/cc"\nquiet_seconds = 3600\n{extra}\n'
    for name, group in (("team-a", GROUP_A), ("team-b", GROUP_B)):
        config += f'[[access.sockets]]\nname = "{name}"\npath = "{sockets / name}.sock"\n'
        config += f'group = "{group}"\n\n' if groups else "\n"
    return config


def _kernel(directory: Path, name: str = "k.so", content: bytes = b"kernel") -> Path:
    """A compiled artifact, written where inductor writes them."""
    path = directory / "inductor" / "ab" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(content)
    return path


def test_tenants_asking_for_the_same_key_get_their_own_directory_and_s3_prefix(
    start_agent: AgentFactory, s3_client: Any, bucket: str, short_dir: Path
) -> None:
    """The same key parts on two tenant sockets give two directories; A's upload goes under
    A's prefix, and on a new node B's request restores nothing of A's while A's restores."""
    first = start_agent(_config(bucket, short_dir))
    with Client(short_dir / "team-a.sock") as a, Client(short_dir / "team-b.sock") as b:
        mine, theirs = a.compile_cache(PARTS), b.compile_cache(PARTS)
        assert mine.key == theirs.key
        assert mine.path != theirs.path
        _kernel(mine.path, content=b"tenant A's kernel")
        pushed = a.push_compile_cache(mine.key)
    assert pushed.uploaded
    assert pushed.uri == f"s3://{bucket}/cc/team-a/{mine.key}/"
    listed = s3_client.list_objects_v2(Bucket=bucket, Prefix="cc/")["Contents"]
    # The key's archive and manifest, and its entry in the domain's index of keys by model.
    assert all(o["Key"].startswith("cc/team-a/") for o in listed)
    assert {o["Key"].split("/")[2] for o in listed} == {mine.key, "by-model"}
    first.close()
    second_sockets = short_dir / "node-2"
    second_sockets.mkdir()
    start_agent(_config(bucket, second_sockets))
    with Client(second_sockets / "team-b.sock") as b:
        restored_for_b = b.compile_cache(PARTS)
    with Client(second_sockets / "team-a.sock") as a:
        restored_for_a = a.compile_cache(PARTS)
    assert not restored_for_b.restored
    assert f"cc/team-b/{mine.key}/" in restored_for_b.restore_note
    assert not list((restored_for_b.path / "inductor").rglob("*.so"))
    assert restored_for_a.restored
    assert (restored_for_a.path / "inductor" / "ab" / "k.so").read_bytes() == b"tenant A's kernel"


def test_a_tenant_sees_and_touches_none_of_another_tenants_compile_caches(
    start_agent: AgentFactory, bucket: str, short_dir: Path
) -> None:
    """On A's socket, B's key is not listed, counted or found: CompileReady, PullCompileCache,
    PushCompileCache and ExplainCompileCache on it are NOT_FOUND, CompactCompileCache is not
    served at all, and B's files stay; A holding the compile lock for the same parts does not
    make B wait."""
    agent = start_agent(_config(bucket, short_dir))
    with Client(short_dir / "team-a.sock") as a, Client(short_dir / "team-b.sock") as b:
        theirs = b.compile_cache(PARTS)
        kernel = _kernel(theirs.path)
        assert b.push_compile_cache(theirs.key).uploaded
        assert a.list_compile_caches() == []
        assert a.status().compile_cache_count == 0
        for call in (
            a.compile_ready,
            a.pull_compile_cache,
            a.push_compile_cache,
            a.explain_compile_cache,
        ):
            with pytest.raises(NotFound):
                call(theirs.key)
            with pytest.raises(NotFound):
                call(f"team-b/{theirs.key}")
        for ref in (theirs.key, f"team-b/{theirs.key}"):
            with pytest.raises(AccessDenied, match="CompactCompileCache is not served"):
                a.compact_compile_cache(ref)
        assert kernel.read_bytes() == b"kernel"
        with a.compile_lock(PARTS, client_name="pod-a") as held:
            assert held.exclusive
            with b.compile_lock(PARTS, client_name="pod-b") as also_held:
                assert also_held.exclusive
                assert not also_held.waited
        assert [c.key for c in b.list_compile_caches()] == [theirs.key]
    with Client(agent.socket_path) as node:
        assert [(c.domain, c.key) for c in node.list_compile_caches()] == [("team-b", theirs.key)]


def test_a_tenants_status_shows_only_its_own_pulls_and_leases(
    s3_server: S3Server, small_model: SampleModel, bucket: str, short_dir: Path
) -> None:
    """While B's pull is in flight (its GETs stalled) and B holds a lease, A's Status lists no
    pull and no lease; B's and the node's list them."""
    config = "[s3]\nlow_speed_seconds = 1\nretries = 20\n\n" + _config(bucket, short_dir)
    with FaultProxy(s3_server.endpoint_url) as proxy, ThreadPoolExecutor(1) as pool:
        proxy.add(Fault.stall(key=f"/{small_model.bucket}/{small_model.prefix}", times=None))
        env = s3_server.env() | {"AWS_ENDPOINT_URL": proxy.endpoint_url}
        with InProcessAgent(env=env, config=config) as agent:
            joined = threading.Event()

            def seen(progress: Progress) -> None:
                if progress.key:
                    joined.set()

            def pull_for_b() -> None:
                with Client(short_dir / "team-b.sock") as b:
                    b.ensure(small_model.uri, lease=True, lease_ttl=600, progress=seen)

            pulling = pool.submit(pull_for_b)
            assert joined.wait(30)
            with Client(short_dir / "team-a.sock") as a:
                assert a.status().pulls == ()
            with Client(short_dir / "team-b.sock") as b:
                assert [p.uri for p in b.status().pulls] == [small_model.uri]
            with Client(agent.socket_path) as node:
                assert [p.uri for p in node.status().pulls] == [small_model.uri]
            proxy.clear()
            pulling.result(timeout=120)
            with Client(short_dir / "team-a.sock") as a, Client(short_dir / "team-b.sock") as b:
                assert (a.status().lease_count, b.status().lease_count) == (0, 1)


def test_a_domain_past_its_key_cap_gets_resource_exhausted(
    start_agent: AgentFactory, bucket: str, short_dir: Path
) -> None:
    """compile_cache.max_keys_per_domain = 2: A's third key is RESOURCE_EXHAUSTED naming the
    limit, while B (another domain) still gets keys; A's existing keys still answer."""
    start_agent(_config(bucket, short_dir, "max_keys_per_domain = 2\n"))
    with Client(short_dir / "team-a.sock") as a, Client(short_dir / "team-b.sock") as b:
        a.compile_cache(PARTS, extras={"n": "1"})
        a.compile_cache(PARTS, extras={"n": "2"})
        with pytest.raises(NoSpace, match="max_keys_per_domain"):
            a.compile_cache(PARTS, extras={"n": "3"})
        assert b.compile_cache(PARTS, extras={"n": "3"}).path.is_dir()
        assert a.compile_cache(PARTS, extras={"n": "1"}).path.is_dir()


def test_a_compile_lock_waiter_is_let_go_after_lock_wait_seconds(
    start_agent: AgentFactory, bucket: str, short_dir: Path
) -> None:
    """A pod holding a key's compile lock forever keeps another pod waiting lock_wait_seconds
    (here 1 s), not forever: the waiter is granted without the lock (exclusive False)."""
    start_agent(_config(bucket, short_dir, "lock_wait_seconds = 1\n"))
    with Client(short_dir / "team-a.sock") as first, Client(short_dir / "team-a.sock") as second:
        key = first.compile_cache(PARTS).key
        with first.compile_lock(PARTS, client_name="hung-pod") as held:
            assert (held.key, held.exclusive) == (key, True)
            with second.compile_lock(PARTS, client_name="next-pod") as let_go:
                assert let_go.waited
                assert not let_go.exclusive
                assert let_go.waited_for == "hung-pod"


def _groups() -> tuple[int, int]:
    try:
        return grp.getgrnam(GROUP_A).gr_gid, grp.getgrnam(GROUP_B).gr_gid
    except KeyError:
        pytest.skip(f"groups {GROUP_A} and {GROUP_B} are needed (a Debian-like system has them)")


# Runs as nobody in one group: tries each path given, prints what happened to each.
_POD = """
import json, os, sys
os.setgroups([int(sys.argv[1])]); os.setgid(int(sys.argv[1])); os.setuid(65534)
done = {}
for path in sys.argv[2:]:
    try:
        if os.path.basename(path) == "compile":
            os.listdir(path)
        else:
            open(os.path.join(path, "from-the-pod.so"), "wb").close()
        done[path] = "ok"
    except PermissionError:
        done[path] = "denied"
print(json.dumps(done))
"""


def test_a_pod_writes_its_own_domains_compile_directory_and_no_one_elses(
    start_agent: AgentFactory, bucket: str, short_dir: Path
) -> None:
    """An unprivileged pod in tenant A's group writes into A's key directory (and its sub-caches),
    but cannot write into B's, nor list the compile root to learn the domains or keys."""
    gid_a, _ = _groups()
    agent = start_agent(_config(bucket, short_dir, groups=True))
    agent.root.chmod(0o711)  # a pod reaches the tiers as it would at /var/lib/prewarm
    with Client(short_dir / "team-a.sock") as a, Client(short_dir / "team-b.sock") as b:
        mine, theirs = a.compile_cache(PARTS), b.compile_cache(PARTS)
    targets = [mine.path, mine.path / "inductor", theirs.path, agent.disk_root / "compile"]
    done = subprocess.run(
        [sys.executable, "-c", _POD, str(gid_a), *map(str, targets)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(done.stdout) == {
        str(mine.path): "ok",
        str(mine.path / "inductor"): "ok",
        str(theirs.path): "denied",
        str(agent.disk_root / "compile"): "denied",
    }
    assert (mine.path / "from-the-pod.so").stat().st_gid == gid_a


def test_files_moved_or_linked_in_from_outside_the_domain_are_never_uploaded(
    start_agent: AgentFactory, s3_client: Any, bucket: str, short_dir: Path
) -> None:
    """In A's key directory, a file of B's group (moved in from elsewhere) and a hard link to a
    file outside are not uploaded; A's own artifact is."""
    _, gid_b = _groups()
    start_agent(_config(bucket, short_dir, groups=True))
    with Client(short_dir / "team-a.sock") as a:
        mine = a.compile_cache(PARTS)
        _kernel(mine.path, "own.so")
        planted = _kernel(mine.path, "planted.so", b"from another tenant")
        os.chown(planted, -1, gid_b)
        outside = short_dir / "outside.so"
        outside.write_bytes(b"linked in")
        with contextlib.suppress(FileExistsError):
            os.link(outside, mine.path / "inductor" / "ab" / "linked.so")
        assert a.push_compile_cache(mine.key).uploaded
    body = s3_client.get_object(Bucket=bucket, Key=f"cc/team-a/{mine.key}/manifest.json")["Body"]
    listed = [f[0] for archive in unsealed(body.read())["archives"] for f in archive["files"]]
    assert listed == ["inductor/ab/own.so"]


def test_a_manifest_entry_restores_its_compile_cache_into_the_domain_it_names(
    start_agent: AgentFactory, small_model: SampleModel, bucket: str, short_dir: Path
) -> None:
    """A prefetch manifest's [model.compile] with domain = "team-a" makes the cache in team-a's
    domain, where A's pods find it; without a domain it would be the node's, which they do not
    see."""
    manifests = short_dir / "models.d"
    manifests.mkdir()
    (manifests / "llama.toml").write_text(
        f'[[model]]\nuri = "{small_model.uri}"\n\n[model.compile]\n'
        'torch_version = "2.13.0"\ndomain = "team-a"\n'
    )
    agent = start_agent(_config(bucket, short_dir) + f'[manifests]\ndirectory = "{manifests}"\n')
    made = "compile cache team-a/"
    when_logged(agent, lambda: made in agent.log_text() or None, made)
    with Client(short_dir / "team-a.sock") as a, Client(short_dir / "team-b.sock") as b:
        [cache] = a.list_compile_caches()
        assert cache.parts.model_key == a.ensure(small_model.uri).key
        assert b.list_compile_caches() == []
