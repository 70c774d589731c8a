# `make demo` and `make test` set everything up on a fresh machine first (a virtualenv in .venv).
#
# torch is installed before the package so pip never swaps in another build:
#   default            torch==2.13.0 (here a local CPU wheel; on PyPI the standard build, CUDA on Linux)
#   CPU-only machine   make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
#   a CUDA version     make install TORCH_SPEC=torch TORCH_INDEX=https://download.pytorch.org/whl/cu126
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast lint format docs bench-decode bench-train bench-data clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

demo: install
	$(BIN)/seq2seq demo

# One pytest process per core; a test module stays in one process, so its shared fixtures are made once.
# Modules go out in the order tests/conftest.py puts them (those that train first), not by test count.
PYTEST := $(BIN)/python -m pytest -q -n auto --dist loadscope --no-loadscope-reorder

test: install
	$(PYTEST)

test-fast: install
	$(PYTEST) -m "not slow"

lint: install
	$(BIN)/ruff check seq2seq tests scripts benchmarks
	$(BIN)/ruff format --check seq2seq tests scripts benchmarks

format: install
	$(BIN)/ruff check --fix seq2seq tests scripts benchmarks
	$(BIN)/ruff format seq2seq tests scripts benchmarks

docs: install  # the pages written from the code: the configuration reference, the benchmark ledger
	$(BIN)/python -m seq2seq.config_reference docs/configuration.md
	$(BIN)/python benchmarks/ledger.py render

bench-decode: install
	$(BIN)/python benchmarks/benchmark_decode.py

bench-train: install
	$(BIN)/python benchmarks/benchmark_train.py

bench-data: install
	$(BIN)/python benchmarks/benchmark_data.py

clean:
	rm -rf $(VENV) runs data/demo .pytest_cache .ruff_cache
