# The two commands the README promises: `make demo` and `make test`. Both set up first.
VENV := .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: setup demo test test-slow check bench serve clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(BIN)/dsec demo

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-slow: setup  # exit 5 = no test is marked slow yet
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS) || [ $$? -eq 5 ]

check: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

bench: setup
	$(BIN)/python benchmarks/ingest.py
	$(BIN)/python benchmarks/probe_overhead.py

serve: setup
	$(BIN)/dsec serve --cluster examples/cluster.yaml

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
