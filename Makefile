# `make demo` and `make test` set up .venv themselves (CPU torch first; GPU users override TORCH_SPEC
# and/or TORCH_INDEX, e.g. TORCH_INDEX="--index-url https://download.pytorch.org/whl/cu128").
# Everything else is installed at the versions in constraints.txt, the set the suite last passed
# with (the package itself keeps ranges for users, setup.cfg); `make constraints` rewrites it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
EXTRAS ?= all
STAMP := $(VENV)/.installed
CONSTRAINTS := constraints.txt

BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: demo test bench venv clean constraints

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" $(TORCH_INDEX)
	$(PY) -m pip install -q -e ".[$(EXTRAS)]" -c $(CONSTRAINTS)
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/selzero demo

# DeepSpeed compiles a comm op on first use into TORCH_EXTENSIONS_DIR: one cache per venv, so
# two clones (or venvs) on one machine do not rebuild it for each other in turn
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions

test: $(STAMP)
	$(PY) -m pytest -q --durations=25 tests

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[$(EXTRAS),bench]" -c $(CONSTRAINTS)
	touch $(BENCH_STAMP)

# side-by-side benchmarks (benchmarks/bench.py); tables and plots in benchmarks/results/
bench: $(BENCH_STAMP)
	$(PY) benchmarks/bench.py $(BENCH_ARGS)
	for w in a c d e f; do $(PY) benchmarks/step_path.py --workload $$w \
		--out benchmarks/results/step-path-$$w.json; done

# on purpose, after a green `make test` with newer packages (pip install -U ... into .venv)
constraints: $(STAMP)
	{ sed -n '1,3p' $(CONSTRAINTS); $(PY) -m pip freeze --exclude-editable | grep -iv '^torch=='; } \
		> $(CONSTRAINTS).new && mv $(CONSTRAINTS).new $(CONSTRAINTS)

clean:
	rm -rf $(VENV) build *.egg-info
