# Two entry points: `make up` (local cluster on the embedded model) and `make test` (the whole suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: up test test-gpu gpu-check gpu-wheels lint install proto docs clean

# GPU machines have torch but no package index and no .venv (../shared/GPU.md): `make gpu-wheels` (here) fetches
# the few packages they lack, pinned to this venv's versions, into $(WHL); `make test-gpu` (there) installs them
# into $(GPU_SITE) and runs tests/gpu with the machine's python3. NIXL's CUDA 13 wheel comes along slimmed to fit the
# device tool's carry limit (deploy/gpu_wheels.py).
WHL := .whl
GPU_SITE := /tmp/site
GPU_PYTHON_VERSION := 3.12
GPU_PACKAGES := msgspec|pyzmq|grpcio|grpcio-health-checking|grpcio-reflection|protobuf

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned first: on a machine without a GPU, torch==2.13.0 resolves to the CPU build that lies on disk
# (pip's find-links); left to the dependency resolver, an unpinned torch would pull the multi-GB CUDA build.
# The Mooncake wheels link Debian's libibverbs1 (the RDMA verbs library; loaded even for its TCP transport).
$(STAMP): pyproject.toml | $(BIN)/python
	@ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || { \
		echo "installing libibverbs1 (the Mooncake transfer engine links it)"; \
		apt-get update -qq && apt-get install -y -qq --no-install-recommends libibverbs1 \
			|| echo "WARNING: cannot install libibverbs1 (run 'apt-get install libibverbs1' as root): the mooncake backend will not load"; }
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "GPU found: installing the CUDA build of torch"; $(BIN)/pip install -q torch==2.13.0; \
	else \
		echo "no GPU: installing the CPU build of torch"; $(BIN)/pip install -q "torch==2.13.0+cpu" || $(BIN)/pip install -q torch==2.13.0; \
	fi
	$(BIN)/pip install -q -e ".[test,mooncake]"
	@$(BIN)/python -c "import mooncake.engine" 2>/dev/null \
		|| echo "WARNING: the Mooncake transfer engine does not load: --kv-transfer-backend mooncake and its tests are off"
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(BIN)/pdcluster up --demo

# TEST_WORKERS pytest-xdist workers, each taking whole test files (--dist loadfile: a module's cluster or node fixture
# starts once; --no-loadscope-reorder: the longest files go first, tests/conftest.py LONGEST_FILES, not the files with
# the most tests). 3 workers suit the 2-core CI machine (its timings: docs/testing.md); TEST_WORKERS=0 runs one process.
# PDCLUSTER_TEST_CPU=<dir> writes the CPU seconds each test file took.
TEST_WORKERS ?= 3

test: $(STAMP)
	$(BIN)/python proto/gen.py --check
	$(BIN)/python -m common.app.flag_docs --check
	$(BIN)/ruff check .
	$(BIN)/pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# The python that runs tests/gpu and the GPU check: the .venv's, or on a GPU machine without one the machine's python3
# with the $(WHL) wheels installed into $(GPU_SITE) first.
GPU_PY = if [ -x $(BIN)/python ]; then PYBIN=$(BIN)/python; else \
	ls $(WHL)/*.whl >/dev/null 2>&1 || { echo "no $(VENV) and no $(WHL)/*.whl: run 'make gpu-wheels' first"; exit 1; }; \
	python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $(GPU_SITE) $(WHL)/*.whl \
		|| exit 1; \
	export PYTHONPATH=$$PWD:$$PWD/proto:$(GPU_SITE) PYTHONUNBUFFERED=1; PYBIN=python3; fi

test-gpu:
	@$(GPU_PY); $$PYBIN -m pytest -q -p no:cacheprovider -rs tests/gpu

# The whole accelerator path in one command (benchmarks/gpu_check.py): results under $$OUT (or GPU_CHECK_ARGS="--out
# DIR"), finished within its --budget-s (default 420 s). `make gpu-check GPU_CHECK_ARGS=--dry-run` runs it on CPU.
GPU_CHECK_ARGS ?=
gpu-check:
	@$(GPU_PY); $$PYBIN -m benchmarks.gpu_check $(GPU_CHECK_ARGS)

gpu-wheels: $(STAMP)
	$(BIN)/python -m pip download --no-deps --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d $(WHL) \
		$$($(BIN)/python -m pip freeze | grep -iE '^($(GPU_PACKAGES))==')
	$(BIN)/python -m deploy.gpu_wheels --dest $(WHL)

lint: $(STAMP)
	$(BIN)/ruff check .

proto: $(STAMP)
	$(BIN)/python proto/gen.py

docs: $(STAMP)
	$(BIN)/python -m common.app.flag_docs

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
