"""bench/pick_latency.py measures every strategy it lists (a few picks each)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import pick_latency


@pytest.mark.parametrize("name", pick_latency.STRATEGIES)
def test_every_listed_strategy_is_measured(name: str) -> None:
    # chat strategies have no latency scorer: feeding KV events must skip them, not fail.
    result = pick_latency.measure(4, name, picks=20, seed=0)
    assert result["p50_us"] > 0
    assert result["p99_us"] >= result["p50_us"]
