# Two entry points: `make up` (local cluster on the embedded model) and `make test` (the whole suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: up test lint install proto clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned first: on a machine without a GPU, torch==2.13.0 resolves to the CPU build that lies on disk
# (pip's find-links); left to the dependency resolver, an unpinned torch would pull the multi-GB CUDA build.
$(STAMP): pyproject.toml | $(BIN)/python
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "GPU found: installing the CUDA build of torch"; $(BIN)/pip install -q torch==2.13.0; \
	else \
		echo "no GPU: installing the CPU build of torch"; $(BIN)/pip install -q "torch==2.13.0+cpu" || $(BIN)/pip install -q torch==2.13.0; \
	fi
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(BIN)/pdcluster up --demo

test: $(STAMP)
	$(BIN)/python proto/gen.py --check
	$(BIN)/ruff check .
	$(BIN)/pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check .

proto: $(STAMP)
	$(BIN)/python proto/gen.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
