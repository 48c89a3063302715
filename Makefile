# `make demo` and `make test` set up .venv themselves (CPU torch first; GPU users override TORCH_SPEC
# and/or TORCH_INDEX, e.g. TORCH_INDEX="--index-url https://download.pytorch.org/whl/cu128").
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
EXTRAS ?= all
STAMP := $(VENV)/.installed

BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: demo test bench venv clean

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" $(TORCH_INDEX)
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/selzero demo

test: $(STAMP)
	$(PY) -m pytest -q tests

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[$(EXTRAS),bench]"
	touch $(BENCH_STAMP)

# side-by-side benchmarks (benchmarks/bench.py); tables and plots in benchmarks/results/
bench: $(BENCH_STAMP)
	$(PY) benchmarks/bench.py $(BENCH_ARGS)
	for w in a c d; do $(PY) benchmarks/step_path.py --workload $$w \
		--out benchmarks/results/step-path-$$w.json; done

clean:
	rm -rf $(VENV) build *.egg-info
