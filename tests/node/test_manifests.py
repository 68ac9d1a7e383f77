"""Prefetch manifests: the file format with line numbers, the pin record, the watcher acting on
a watched directory (in process, over the in-memory source), and the real daemon's wiring."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from agent_helpers import AgentFactory, when_logged

from agent._config import ManifestSettings, S3Settings, Settings
from agent._uri import parse_uri
from agent.client import Client
from agent.leases.table import LeaseTable
from agent.prefetch.manifests import CompileCacheHook, ManifestWatcher
from agent.prefetch.pins import load_pins, save_pins
from agent.prefetch.schema import CompileSpec, ManifestError, read_manifest
from agent.pull.puller import Puller
from agent.service.operations import AgentService
from agent.service.request import EnsureRequest
from agent.store.catalog import Store
from agent.testing import MemorySource, SampleModel

MODEL_URI = "s3://models/llama/"
MODEL_BYTES = 3 * 256 * 1024
# A wait that runs out is a failure, reported long before pytest-timeout would.
WAIT_SECONDS = 30


def write_atomically(path: Path, text: str) -> None:
    """Replace a manifest in one rename, as a ConfigMap update or an editor's save does."""
    staged = path.with_name(f".{path.name}.tmp")
    staged.write_text(text)
    staged.replace(path)


class LogWatch(logging.Handler):
    """The agent's log records as they are emitted; a test awaits the one it needs."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []
        self._loop = loop
        self._waiters: list[tuple[Callable[[logging.LogRecord], bool], asyncio.Future[None]]] = []

    def emit(self, record: logging.LogRecord) -> None:
        # The directory is read in a worker thread: hand every record to the loop.
        self._loop.call_soon_threadsafe(self._arrived, record)

    def _arrived(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        for matches, future in self._waiters:
            if not future.done() and matches(record):
                future.set_result(None)

    async def wait_for(self, text: str) -> logging.LogRecord:
        """The first record (already emitted or still to come) whose message contains ``text``."""

        def matches(record: logging.LogRecord) -> bool:
            return text in record.getMessage()

        waiter = (matches, self._loop.create_future())
        self._waiters.append(waiter)
        try:
            if not any(matches(record) for record in self.records):
                async with asyncio.timeout(WAIT_SECONDS):
                    await waiter[1]
        except TimeoutError:
            raise AssertionError(f"no log line containing {text!r} in {WAIT_SECONDS} s") from None
        finally:
            self._waiters.remove(waiter)
        return next(record for record in self.records if matches(record))


@pytest.fixture
async def agent_log() -> AsyncIterator[LogWatch]:
    watch = LogWatch(asyncio.get_running_loop())
    logger = logging.getLogger("agent")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(watch)
    yield watch
    logger.removeHandler(watch)
    logger.setLevel(level)


@pytest.fixture
def manifest_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "models.d"
    directory.mkdir()
    return directory


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[AgentService]:
    """The agent's operations over an in-memory bucket holding one small model."""
    source = MemorySource()
    for name in ("a.bin", "b.bin", "config.json"):
        source.put("models", f"llama/{name}", os.urandom(MODEL_BYTES // 3))
    settings = Settings.model_validate(
        {
            "default_tier": "disk",
            "socket_path": tmp_path / "agent.sock",
            "tiers": {"shm_root": tmp_path / "shm", "disk_root": tmp_path / "disk"},
        }
    )
    store = Store({"shm": tmp_path / "shm", "disk": tmp_path / "disk"})
    await store.open()
    async with Puller(store, source, S3Settings()) as puller:
        yield AgentService(store, puller, source, LeaseTable(60, 3600), settings=settings)


def watcher(
    service: AgentService, directory: Path, compile_cache: CompileCacheHook | None = None
) -> ManifestWatcher:
    """A watcher over ``directory`` that records its pins beside it."""
    state = directory.parent / "prefetch-pins.json"
    settings = ManifestSettings(directory=directory)
    return ManifestWatcher(service, settings, state, compile_cache=compile_cache)


def pinned(service: AgentService) -> bool:
    [model] = [m for m in service.list_models() if m.uri == MODEL_URI]
    return service.usage(model.key).pinned


# -- the file format --------------------------------------------------------------------


def test_a_manifest_lists_normalised_entries_with_their_lines(tmp_path: Path) -> None:
    """Entries come back normalised (URI slash, sorted unique globs) with their header lines."""
    path = tmp_path / "models.toml"
    path.write_text(
        "# two models\n"
        "[[model]]\n"
        'uri = "s3://models/llama"\n'
        'tier = "disk"\n'
        "pin = true\n"
        'include = ["*.safetensors", "*.json", "*.json"]\n'
        "\n"
        "[model.compile]\n"
        'engine = "vllm"\n'
        'torch_version = "2.13.0"\n'
        "tensor_parallel = 8\n"
        "\n"
        "[[model]]\n"
        'uri = "s3://models/qwen/"\n'
    )
    first, second = read_manifest(path)
    assert (first.uri, first.tier, first.pin, first.line) == ("s3://models/llama/", "disk", True, 2)
    assert first.include == ("*.json", "*.safetensors")
    assert first.compile == CompileSpec(engine="vllm", torch_version="2.13.0", tensor_parallel=8)
    assert (second.uri, second.tier, second.pin, second.line) == (
        "s3://models/qwen/",
        None,
        False,
        13,
    )
    assert second.compile is None


@pytest.mark.parametrize(
    ("text", "line", "says"),
    [
        ('[[model]]\nuri = "s3://models/a/"\npinned = true\n', 3, "unknown key"),
        (
            '[[model]]\nuri = "s3://models/a/"\n\n'
            '[[model]]\nuri = "s3://models/b/"\ntier = "nvme"\n',
            6,
            "'shm' or 'disk'",
        ),
        (
            '[[model]]\nuri = "s3://models/a/"\n[[model]]\nuri = "https://models/b/"\n',
            4,
            "not an S3 URI",
        ),
        (
            '[[model]]\nuri = "s3://models/a/"\n'
            '[model.compile]\nengine = "vllm"\ntensor_parallel = "eight"\n',
            5,
            "integer",
        ),
        ('[[model]]\ntier = "shm"\n', 1, "required key missing"),
        (
            '[[model]]\nuri = "s3://models/a/"\n\n[model.compile]\nengine = "vllm"\n',
            4,
            "torch_version is required",
        ),
        ('[[model]]\nuri = "s3://models/a/"\ninclude = [""]\n', 3, "empty"),
        ('[[model]]\nuri = "s3://models/a/\n', 2, "not valid TOML"),
    ],
    ids=[
        "unknown-key",
        "bad-tier",
        "bad-uri",
        "bad-compile-part",
        "missing-uri",
        "compile-without-torch-version",
        "empty-glob",
        "toml-syntax",
    ],
)
def test_a_bad_manifest_is_reported_with_its_line(
    tmp_path: Path, text: str, line: int, says: str
) -> None:
    """Each kind of mistake names the file, the line of the offending key and what is wrong."""
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ManifestError) as caught:
        read_manifest(path)
    assert caught.value.line == line
    assert caught.value.path == path
    assert says in str(caught.value)
    assert f"{path}, line {line}" in str(caught.value)


def test_the_pin_record_round_trips_and_an_unreadable_one_is_ignored(tmp_path: Path) -> None:
    """Pins saved are loaded back as they were; a corrupt record loads as no pins at all."""
    path = tmp_path / "state" / "prefetch-pins.json"
    pins = {(MODEL_URI, ("*.json",), ()): "key-1", ("s3://models/qwen/", (), ("x/*",)): "key-2"}
    save_pins(path, pins)
    assert load_pins(path) == pins
    path.write_text('{"format": 1, "pins": [{"uri": "s3://m/"}]}')
    assert load_pins(path) == {}
    assert load_pins(tmp_path / "missing.json") == {}


# -- the watcher, in process ---------------------------------------------------------------


async def test_a_manifest_dropped_into_the_directory_is_prefetched_and_pinned(
    service: AgentService, manifest_dir: Path, agent_log: LogWatch
) -> None:
    """A file written while the watcher runs is pulled onto its tier and pinned."""
    async with watcher(service, manifest_dir):
        assert service.list_models() == []
        write_atomically(
            manifest_dir / "llama.toml",
            f'[[model]]\nuri = "{MODEL_URI}"\ntier = "shm"\npin = true\n',
        )
        await agent_log.wait_for(f"pinned {MODEL_URI}")
    [model] = service.list_models()
    assert (model.uri, model.tier, model.total_bytes) == (MODEL_URI, "shm", MODEL_BYTES)
    assert pinned(service)


async def test_removing_a_manifest_unpins_what_it_pinned(
    service: AgentService, manifest_dir: Path, agent_log: LogWatch
) -> None:
    """Deleting the file undoes the manifest's pin and leaves the snapshot cached."""
    manifest = manifest_dir / "llama.toml"
    manifest.write_text(f'[[model]]\nuri = "{MODEL_URI}"\npin = true\n')
    async with watcher(service, manifest_dir):
        await agent_log.wait_for(f"pinned {MODEL_URI}")
        manifest.unlink()
        await agent_log.wait_for(f"unpinned {MODEL_URI}")
    assert not pinned(service)


async def test_an_entry_removed_while_the_agent_was_down_is_unpinned_at_start(
    service: AgentService, manifest_dir: Path, agent_log: LogWatch
) -> None:
    """The pin record outlives the watcher, so the next start undoes a pin whose entry went."""
    manifest = manifest_dir / "llama.toml"
    manifest.write_text(f'[[model]]\nuri = "{MODEL_URI}"\npin = true\n')
    async with watcher(service, manifest_dir):
        await agent_log.wait_for(f"pinned {MODEL_URI}")
    manifest.unlink()
    async with watcher(service, manifest_dir):  # the first read happens on entry
        assert not pinned(service)


async def test_a_pinned_entry_evicted_by_force_is_pinned_again_at_the_next_rescan(
    service: AgentService, manifest_dir: Path, agent_log: LogWatch
) -> None:
    """evict --force, then any change of the directory: the entry is pulled and pinned again,
    though prefetch-pins.json still names its key."""
    manifest = manifest_dir / "llama.toml"
    manifest.write_text(f'[[model]]\nuri = "{MODEL_URI}"\npin = true\n')
    async with watcher(service, manifest_dir):
        await agent_log.wait_for(f"pinned {MODEL_URI}")
        await service.evict(MODEL_URI, force=True)
        agent_log.records.clear()
        write_atomically(manifest_dir / "other.toml", "")  # any change rescans
        await agent_log.wait_for(f"pinned {MODEL_URI}")
        assert pinned(service)


async def test_a_pinned_entry_evicted_by_force_is_pinned_again_at_the_next_start(
    service: AgentService, manifest_dir: Path, agent_log: LogWatch
) -> None:
    """The pin record names the evicted snapshot's key; the next start pins its new pull."""
    manifest = manifest_dir / "llama.toml"
    manifest.write_text(f'[[model]]\nuri = "{MODEL_URI}"\npin = true\n')
    async with watcher(service, manifest_dir):
        await agent_log.wait_for(f"pinned {MODEL_URI}")
    await service.evict(MODEL_URI, force=True)
    agent_log.records.clear()
    async with watcher(service, manifest_dir):
        await agent_log.wait_for(f"pinned {MODEL_URI}")
        assert pinned(service)


async def test_a_pin_made_by_hand_survives_the_manifest_going_away(
    service: AgentService, manifest_dir: Path, agent_log: LogWatch
) -> None:
    """A manifest never undoes a pin it did not make."""
    async for _ in service.ensure(EnsureRequest(uri=parse_uri(MODEL_URI))):
        pass
    await service.pin(MODEL_URI, True)
    manifest = manifest_dir / "llama.toml"
    async with watcher(service, manifest_dir):
        write_atomically(manifest, f'[[model]]\nuri = "{MODEL_URI}"\npin = true\n')
        await agent_log.wait_for("already pinned by hand")
        manifest.unlink()
        # Every change re-reads the whole directory, so once a file written after
        # the removal has been reported, the removal has been acted on too.
        write_atomically(manifest_dir / "marker.toml", "not toml")
        await agent_log.wait_for(f"{manifest_dir / 'marker.toml'}, line 1")
        assert pinned(service)


async def test_a_malformed_manifest_is_logged_with_its_line_and_ignored(
    service: AgentService, manifest_dir: Path, agent_log: LogWatch
) -> None:
    """Bad files are reported with file and line; a good file beside them is still acted on."""
    (manifest_dir / "a-broken.toml").write_text(
        f'[[model]]\nuri = "{MODEL_URI}"\ntier = "shm"\npin = yes\n'
    )
    async with watcher(service, manifest_dir):
        write_atomically(
            manifest_dir / "b-unknown-key.toml", f'[[model]]\nuri = "{MODEL_URI}"\npinn = true\n'
        )
        write_atomically(manifest_dir / "c-good.toml", f'[[model]]\nuri = "{MODEL_URI}"\n')
        await agent_log.wait_for(f"prefetched {MODEL_URI}")
        broken = await agent_log.wait_for("a-broken.toml, line 4")
        unknown = await agent_log.wait_for("b-unknown-key.toml, line 3")
    assert broken.levelno == unknown.levelno == logging.ERROR
    assert "not valid TOML" in broken.getMessage()
    assert "pinn" in unknown.getMessage()
    assert getattr(unknown, "file") == str(manifest_dir / "b-unknown-key.toml")  # noqa: B009
    [model] = service.list_models()
    assert model.tier == "disk"  # the broken files' tier and pin were ignored
    assert not pinned(service)


async def test_a_file_that_turns_bad_keeps_its_last_good_entries(
    service: AgentService, manifest_dir: Path, agent_log: LogWatch
) -> None:
    """A half-saved edit is reported but unpins nothing until the file is fixed or removed."""
    manifest = manifest_dir / "llama.toml"
    manifest.write_text(f'[[model]]\nuri = "{MODEL_URI}"\npin = true\n')
    async with watcher(service, manifest_dir):
        await agent_log.wait_for(f"pinned {MODEL_URI}")
        write_atomically(manifest, f'[[model]]\nuri = "{MODEL_URI}"\npin = tru')
        await agent_log.wait_for("Keeping its previous 1 entries")
        assert pinned(service)


async def test_a_compile_cache_named_by_an_entry_is_restored_once_its_model_is_cached(
    service: AgentService, manifest_dir: Path
) -> None:
    """The compile hook is called with the entry's key parts and the model's snapshot key."""
    (manifest_dir / "llama.toml").write_text(
        f'[[model]]\nuri = "{MODEL_URI}"\n[model.compile]\nengine = "vllm"\n'
        'torch_version = "2.13.0"\n'
    )
    restored: asyncio.Queue[tuple[CompileSpec, str]] = asyncio.Queue()

    async def restore(spec: CompileSpec, model_key: str) -> None:
        await restored.put((spec, model_key))

    async with watcher(service, manifest_dir, compile_cache=restore):
        async with asyncio.timeout(30):
            spec, model_key = await restored.get()
    assert spec == CompileSpec(engine="vllm", torch_version="2.13.0")
    assert [model_key] == [m.key for m in service.list_models()]


# -- the real daemon ----------------------------------------------------------------------


def test_the_daemon_prefetches_and_pins_what_its_manifest_directory_lists(
    start_agent: AgentFactory, manifest_dir: Path, small_model: SampleModel
) -> None:
    """``[manifests] directory`` reaches the daemon's watcher: a file dropped in gets pinned."""
    agent = start_agent(f'[manifests]\ndirectory = "{manifest_dir}"\n')
    write_atomically(
        manifest_dir / "llama.toml",
        f'[[model]]\nuri = "{small_model.uri}"\ntier = "disk"\npin = true\n',
    )
    pinned = f"pinned {small_model.uri}"
    when_logged(agent, lambda: pinned in agent.log_text() or None, pinned, WAIT_SECONDS)
    with Client(agent.socket_path) as client:
        [model] = client.list_models()
    assert (model.uri, model.tier, model.pinned) == (small_model.uri, "disk", True)
