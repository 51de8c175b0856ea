"""bench/envoy_overhead.py's exact-matching scenario builds the configuration the README
documents (no Envoy here: the benchmark itself runs it)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.envoy_overhead import SCENARIOS, llmgw_config, table


def test_exact_scenario_follows_kv_events_with_the_sim_tokenizer() -> None:
    config = llmgw_config(["127.0.0.1:1", "127.0.0.1:2"], "latency", exact=True)
    model = config.models["m1"]
    assert model.kv_events is not None and model.kv_events.discover
    strategy = model.strategy
    assert not isinstance(strategy, str)
    assert strategy.scorers["latency"].params["tokenizer"] == "sim"


def test_exact_scenario_is_compared_with_the_same_router_without_it() -> None:
    by_key = {s.key: s for s in SCENARIOS}
    assert by_key["7"].exact and by_key["7"].sim
    assert not by_key["6"].exact and by_key["6"].sim
    assert llmgw_config(["127.0.0.1:1"], "latency").models["m1"].kv_events is None


def test_errors_count_a_non_2xx_answer_once() -> None:
    """h2load's `failed` already holds the 4xx / 5xx answers; the table added the non-2xx
    count again. (found by a review helper)"""
    run = {"scenario": "1", "label": "direct", "rps": 1000.0, "p50_ms": 1.0, "p99_ms": 2.0}
    run |= {"succeeded": 85, "failed": 15, "non_2xx": 5, "extproc_cpu_us_per_req": 0.0}
    run |= {"envoy_cpu_us_per_req": 10.0}
    (row,) = table([run])
    assert row["errors"] == 15
