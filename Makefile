# Every target creates .venv on first use, so on a fresh machine one command does all set-up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-fast lint demo bench bench-quick bench-grid soak clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[extproc,asgi,sim,k8s,exact,dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not e2e and not real_engine and not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

demo: $(STAMP)
	$(PY) -m llmgw.cli demo

bench: $(STAMP)
	$(PY) bench/pick_latency.py
	$(PY) bench/fleetsim_grid.py --jobs 2
	$(PY) bench/routing.py
	$(PY) bench/asgi_proxy.py
	$(PY) bench/envoy_overhead.py
	$(PY) bench/fault_matrix.py
	$(PY) -m bench.trace_cost
	$(PY) bench/replay_fidelity.py

bench-grid: $(STAMP)  # routing strategies over 12 regimes in virtual time, ~4 min
	$(PY) bench/fleetsim_grid.py --jobs 2

bench-quick: $(STAMP)  # routing grid: 3 cells, 8 contenders, < 5 min
	$(PY) bench/routing.py --quick

soak: $(STAMP)
	$(PY) bench/soak.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
