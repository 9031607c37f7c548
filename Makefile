# The two commands a new user needs: `make demo` and `make test`
# (`make test-fast` while working: the tests not marked slow).
# Each creates .venv and installs the project into it when pyproject.toml changed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-fast demo typecheck lint format docs bench bench-quick studies clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,bench,docs]'
	touch $(STAMP)

# Two test processes, a file each at a time (pytest-xdist): the tests wait on
# processes and sockets far more than they compute. JOBS=0 runs in one process.
JOBS ?= 2
PARALLEL = $(if $(filter 0,$(JOBS)),,-n $(JOBS) --dist loadfile)

test: $(STAMP)
	$(BIN)/python -m pytest $(PARALLEL)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" $(PARALLEL)

demo: $(STAMP)
	$(BIN)/ctrps demo

typecheck: $(STAMP)
	$(BIN)/python -m mypy

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The site (mkdocs.yml) into site/: the flag reference written again from the
# settings declarations and the recorded runs of docs/measurements.md from
# bench/results/, then a strict build, where a broken link fails.
docs: $(STAMP)
	$(BIN)/python tools/settings_reference.py
	$(BIN)/python tools/measurements.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# --record keeps each run's JSON line in bench/results/ (`make docs` puts them
# in docs/measurements.md).
bench-quick: $(STAMP)
	for b in bench/bench_*.py; do echo "== $$b"; $(BIN)/python $$b --quick --record || exit 1; done

bench: $(STAMP)
	for b in bench/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

studies: $(STAMP)
	for b in bench/studies/*.py; do echo "== $$b"; $(BIN)/python $$b --quick || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .hypothesis site
