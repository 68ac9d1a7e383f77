# prewarm developer tasks. On a fresh machine: `make demo`, then `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: venv demo bench bench-gpu test lint typecheck pytest soak fuzz proto wheel clean

# Python writes the bytecode of what it imports, whatever the environment says. uv, unlike
# pip, compiles nothing at install, and this project's CI image sets PYTHONDONTWRITEBYTECODE:
# together, every process the suite started (agents, the CLI, torch.compile probes) compiled
# torch, botocore and the agent from source (the daemon's imports: 4.7 s of CPU from source,
# 1.1 s from .pyc). Compiling the whole venv at install (uv --compile-bytecode) costs 54 s
# of CPU for 11,800 files, of which the suite imports about 3,500.
unexport PYTHONDONTWRITEBYTECODE

# The venv is (re)built when pyproject.toml changes. torch is pinned to the CPU
# build (2.13.0): an unpinned torch would pull a multi-GB CUDA build. uv installs
# it: pip's resolver took 2 min 36 s of a clean clone's make test over the dev
# extra's ~120 packages, uv 14 s. uv does not read pip's configuration, so the
# wheel directory pip is pointed at (PIP_FIND_LINKS: where this machine keeps the
# CPU build of torch) is passed on; set UV_FIND_LINKS to point it elsewhere.
UV_FIND_LINKS ?= $(PIP_FIND_LINKS)
UV := $(VENV)/bin/uv
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet 'uv>=0.9'
	@# The distribution was called "prewarm" before it had a name of its own (prewarm-agent).
	-@$(UV) pip uninstall --python $(PY) --quiet prewarm 2>/dev/null
	$(UV) pip install --python $(PY) --quiet $(foreach dir,$(UV_FIND_LINKS),--find-links $(dir)) \
		'torch==2.13.0' -e '.[dev]'
	@touch $@

venv: $(STAMP)

## demo: local S3 server + agent; pull a small model cold, then warm
demo: $(STAMP)
	$(PY) scripts/demo.py

## bench: the benchmark suite (by hand, never in CI; see docs/benchmarks.md).
## Options through BENCH_ARGS, e.g. make bench BENCH_ARGS="--size 8GiB --only ceiling,cold"
bench: $(STAMP)
	$(PY) -m bench $(BENCH_ARGS)

## bench-gpu: vLLM launch to ready on a CUDA machine (by hand; bench/engine_launch.py): the
## seed's recipe, its warm restart, prewarm exec's first launch and relaunches on a generated
## BENCH_GPU_SIZE_GIB (8) GiB Llama. The machine has no network: vLLM's CUDA build must be
## installed there first (pip install 'vllm[runai]==0.16.0' in a venv; VLLM=that venv's vllm).
BENCH_GPU_MODEL ?= /dev/shm/llama-bench
BENCH_GPU_SIZE_GIB ?= 8
BENCH_GPU_LOGS ?= /tmp/bench-gpu-logs
VLLM ?= vllm
# Not on $(STAMP): offline, a venv that looks older than pyproject.toml is used as it is.
bench-gpu:
	@# Checked before the model is written: that takes a while, and GPU time is scarce.
	@test -x $(PY) || { echo "bench-gpu: no $(PY): make venv (or VENV=...) before, with network" >&2; exit 1; }
	@command -v $(VLLM) >/dev/null || { echo "bench-gpu: no vLLM at '$(VLLM)': install vLLM's CUDA build (no network there: beforehand), then VLLM=VENV/bin/vllm" >&2; exit 1; }
	$(PY) -m bench.llama_model $(BENCH_GPU_MODEL) --size-gib $(BENCH_GPU_SIZE_GIB)
	$(PY) -m bench.engine_launch --device cuda --vllm $(VLLM) --model-dir $(BENCH_GPU_MODEL) \
		--rows seed,seed-warm,first,relaunch,mega,streamer-copy --log-dir $(BENCH_GPU_LOGS) \
		$(BENCH_GPU_ARGS)

## test: lint, type-check and the whole test suite (what CI runs)
# mypy runs beside pytest: it is single-threaded (30 s on a clean clone), so run
# before the suite it left one of two cores idle. -Oline keeps each line whole.
test: lint
	$(MAKE) --no-print-directory -j2 -Oline typecheck pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The checkout's modules compiled up front, so pytest's workers, which start together,
# do not each compile them (a stale .pyc is ignored: Python checks the source's mtime).
pytest: $(STAMP)
	$(PY) -m compileall -q -j 0 agent tests bench
	$(VENV)/bin/pytest

## soak: the soak at full length, 48 clients for SOAK_SECONDS (60); make test runs it for 10 s.
## Run before a release (and after a change to leases, eviction or the pull path).
SOAK_SECONDS ?= 60
soak: $(STAMP)
	$(VENV)/bin/pytest -n 0 tests/node/test_soak.py --soak-seconds=$(SOAK_SECONDS)

## fuzz: every RPC fuzzed with FUZZ_EXAMPLES (6000) requests; make test sends 600.
## Run before a release (and after a change to the request checks or the proto).
FUZZ_EXAMPLES ?= 6000
fuzz: $(STAMP)
	$(VENV)/bin/pytest -n 0 tests/edge/test_fuzz_rpcs.py --fuzz-examples=$(FUZZ_EXAMPLES)

## wheel: build dist/prewarm_agent-<version>-py3-none-any.whl, the install path until a
## release is published: pods pip install it (or with [cli], [torch]); nodes use
## packaging/install.sh --wheel, which adds [daemon]. Offline: the build backend
## (setuptools, setuptools-scm) is the venv's (the dev extra), not fetched from an index.
wheel: $(STAMP)
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir dist .
	@ls dist/prewarm_agent-*-py3-none-any.whl

## proto: regenerate agent/_proto from proto/ (commit the result)
proto: $(STAMP)
	$(PY) scripts/gen_proto.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache *.egg-info
