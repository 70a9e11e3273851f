# The two commands the README promises: `make demo` and `make test`. Both set up first.
VENV := .venv
BIN := $(VENV)/bin
# The slowest tests listed at the end of every run: the default run must stay well under 15 minutes on 2 cores.
PYTEST_ARGS ?= --durations=30
# The default run on two workers: serially one core sat ~75% idle (most tests wait on the real processes and servers
# they start), 14.6 min; on two, ~10 min (docs/testing.md). --dist loadfile keeps a file's tests on one worker, in
# their order, with their module fixtures. PYTEST_PARALLEL= runs it serially.
PYTEST_PARALLEL ?= -n 2 --dist loadfile

.PHONY: setup native demo test test-slow check bench serve mutation clean

setup:
	@bash scripts/setup.sh
	@$(MAKE) --no-print-directory native

# libdsec_inject.so (native/, docs/native.md). Without a C compiler: a warning, and the tests that need it skip.
NATIVE_CC ?= gcc
NATIVE_SO := build/native/libdsec_inject.so
native:
	@if command -v $(NATIVE_CC) >/dev/null 2>&1; then \
		$(MAKE) --no-print-directory -q $(NATIVE_SO) || $(MAKE) --no-print-directory $(NATIVE_SO); \
	else \
		echo "warning: $(NATIVE_CC) not found: $(NATIVE_SO) not built (the C library for native programs; its tests will skip)" >&2; \
	fi

$(NATIVE_SO): native/dsec_inject.c native/dsec_inject.h
	@mkdir -p $(@D)
	$(NATIVE_CC) -std=gnu11 -O2 -fPIC -shared -pthread -Wall -Wextra -fvisibility=hidden \
		-Wl,-soname,libdsec_inject.so -o $@ native/dsec_inject.c -ldl

demo: setup
	$(BIN)/dsec demo

test: setup
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)

# The slow tests also cover RLlib: its extra is installed here only (scripts/setup.sh, DSEC_SETUP_EXTRAS).
test-slow:
	@DSEC_SETUP_EXTRAS=rllib bash scripts/setup.sh
	@$(MAKE) --no-print-directory native
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS) || [ $$? -eq 5 ]

check: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

# Mutation testing (docs/testing.md), not part of `make test` or CI's default run: mutants of the modules that
# [tool.mutmut] in pyproject.toml names, each against the unit tests that execute it. MUTATION_SCOPE narrows the run
# to mutant names, e.g. MUTATION_SCOPE='dsec.breaker*'. Survivors: $(BIN)/mutmut show <name>.
# OMP_NUM_THREADS=1: mutmut forks each test run from a process where torch already ran, and a forked child spins
# forever on the parent's OpenMP thread pool (every snapshot mutant ran into its CPU limit without it).
MUTATION_SCOPE ?=
mutation: setup
	rm -rf mutants
	OMP_NUM_THREADS=1 $(BIN)/mutmut run --max-children 2 $(MUTATION_SCOPE)
	$(BIN)/mutmut results

bench: setup
	$(BIN)/python -m pip --disable-pip-version-check -q install -e ".[bench]"
	$(BIN)/python benchmarks/ingest.py
	$(BIN)/python benchmarks/beat_ceiling.py
	$(BIN)/python benchmarks/probe_overhead.py
	$(BIN)/python benchmarks/probe_bytes.py
	$(BIN)/python benchmarks/simulate.py
	$(BIN)/python benchmarks/recovery.py

serve: setup
	$(BIN)/dsec serve --cluster examples/cluster.yaml

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache mutants
