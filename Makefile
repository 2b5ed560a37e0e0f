# fedmed: two commands on a fresh clone — `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fedmed-installed
DATA ?=

.PHONY: setup demo test test-fast bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# CPU torch first (local wheel), then everything else constrained to it.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/fedmed demo $(if $(DATA),--data $(DATA),)

# two workers, one file to each at a time (a file's tests keep their order and share its fixtures)
test: $(STAMP)
	$(BIN)/python -m pytest -q -ra -n 2 --dist loadfile --no-loadscope-reorder

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -ra -n 2 --dist loadfile --no-loadscope-reorder -m "not slow"

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_server_math.py
	$(BIN)/python benchmarks/bench_simulator.py
	$(BIN)/python benchmarks/bench_memory.py --sites 20 --rounds 30 --from-round 5

clean:
	rm -rf $(VENV) workspace results .pytest_cache
