# prewarm developer tasks. On a fresh machine: `make demo`, then `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: venv demo bench test lint typecheck pytest proto wheel clean

# The venv is (re)built when pyproject.toml changes. torch is pinned to the CPU
# build (2.13.0): an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet 'torch==2.13.0'
	@# The distribution was called "prewarm" before it had a name of its own (prewarm-agent).
	-@$(PY) -m pip uninstall --quiet --yes prewarm 2>/dev/null
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $@

venv: $(STAMP)

## demo: local S3 server + agent; pull a small model cold, then warm
demo: $(STAMP)
	$(PY) scripts/demo.py

## bench: the benchmark suite (by hand, never in CI; see docs/benchmarks.md).
## Options through BENCH_ARGS, e.g. make bench BENCH_ARGS="--size 8GiB --only ceiling,cold"
bench: $(STAMP)
	$(PY) -m bench $(BENCH_ARGS)

## test: lint, type-check and the whole test suite (what CI runs)
test: lint typecheck pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(VENV)/bin/mypy

pytest: $(STAMP)
	$(VENV)/bin/pytest

## wheel: build dist/prewarm_agent-<version>-py3-none-any.whl, the install path until a
## release is published: pods pip install it (or with [cli], [torch]); nodes use
## packaging/install.sh --wheel, which adds [daemon]
wheel: $(STAMP)
	$(PY) -m pip wheel --quiet --no-deps --wheel-dir dist .
	@ls dist/prewarm_agent-*-py3-none-any.whl

## proto: regenerate agent/_proto from proto/ (commit the result)
proto: $(STAMP)
	$(PY) scripts/gen_proto.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache *.egg-info
