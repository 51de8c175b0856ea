"""The latency model's cost per prefill token against the simulated engine's, over a run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.fleetsim_calibration import main, trace


def test_a_filling_batch_does_not_price_prefill_tokens_below_the_engines_cost() -> None:
    """On 256-sequence engines the batch fills for the first seconds of a run, while the
    documents of docs-shared find their replicas. The calibration used to read the tokens
    of requests still running against the prefill seconds of the few that finished: 44 of
    194 picks priced a token below half the engine's own 60 us (a move of a cached
    document looked nearly free). Now none is."""
    row = trace("vllm-batch", "docs-shared", "llmgw:latency", seed=1, window=1.0)
    assert row["engine_us_per_token"] == pytest.approx(60.0)
    assert row["picks"] > 100
    assert row["picks_below_half"] <= 0.02 * row["picks"]
    # Before any scrape the model runs on its params (100 us): 1.67x the engine's.
    assert row["model_over_engine"]["0-1s"] == pytest.approx(100 / 60, abs=0.01)


def test_the_bench_refuses_contenders_without_a_latency_model_and_unknown_variants() -> None:
    with pytest.raises(SystemExit, match="not an llmgw contender"):
        trace("base", "docs-shared", "round-robin", seed=1, window=0.2)
    with pytest.raises(SystemExit, match="no latency scorer"):
        trace("base", "docs-shared", "llmgw:chat", seed=1, window=0.2)
    with pytest.raises(SystemExit):
        main(["--variants", "no-such-engine"])
