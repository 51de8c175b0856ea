# Every target creates .venv on first use, so on a fresh machine one command does all set-up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-fast lint demo native bench bench-quick bench-grid soak clean

# The scheduler's hot modules, compiled with mypyc (llmgw/native.py); rebuilt when one changes.
NATIVE_SRC := llmgw/kvindex.py llmgw/registry.py llmgw/scheduling/blockhash.py \
	llmgw/scheduling/filters.py llmgw/scheduling/pickers.py llmgw/scheduling/picking.py \
	llmgw/scheduling/prefix.py llmgw/scheduling/scorers.py llmgw/tokenize.py
NATIVE := llmgw/native.json

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[extproc,asgi,sim,k8s,exact,native,dev]'
	touch $(STAMP)

# Without a C compiler this says so and leaves the Python sources to run.
$(NATIVE): $(STAMP) $(NATIVE_SRC) llmgw/native.py scripts/build_native.py
	$(PY) scripts/build_native.py > build-native.log || (cat build-native.log; exit 1)

native: $(NATIVE)

# pytest's exit 5 is "collected no tests": said plainly, and a failure (make exits 2).
test: $(STAMP) $(NATIVE)
	@$(PY) -m pytest -q || { rc=$$?; [ $$rc -ne 5 ] || echo "pytest collected no tests (exit 5): failing" >&2; exit $$rc; }

test-fast: $(STAMP) $(NATIVE)
	$(PY) -m pytest -q -m "not e2e and not real_engine and not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

demo: $(STAMP) $(NATIVE)
	$(PY) -m llmgw.cli demo

bench: $(STAMP) $(NATIVE)
	$(PY) bench/pick_latency.py
	$(PY) bench/fleetsim_grid.py --jobs 2
	$(PY) bench/routing.py
	$(PY) bench/asgi_proxy.py
	$(PY) bench/envoy_overhead.py
	$(PY) bench/fault_matrix.py
	$(PY) -m bench.trace_cost
	$(PY) bench/replay_fidelity.py

bench-grid: $(STAMP) $(NATIVE)  # routing strategies over 12 regimes in virtual time, ~4 min
	$(PY) bench/fleetsim_grid.py --jobs 2

bench-quick: $(STAMP) $(NATIVE)  # routing grid: 3 cells, 8 contenders, < 5 min
	$(PY) bench/routing.py --quick

soak: $(STAMP) $(NATIVE)
	$(PY) bench/soak.py

clean:
	rm -f $(NATIVE) build-native.log llmgw/*.so llmgw/scheduling/*.so
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
