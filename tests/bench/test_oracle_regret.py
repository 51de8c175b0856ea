from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.oracle_regret import describe, run


def test_every_pick_is_compared_on_every_replica_with_a_regret_of_at_least_zero() -> None:
    """The probe sees each pick the router makes, the true time on every replica (the
    chosen one can only be at or above the least) and the latency scorer's prediction for
    every replica; the blind truth differs from the exact one only by the step's phase."""
    row, picks = run("base", "decode-heavy", "llmgw:latency", 1, blind=False, window=0.4)
    assert row["picks"] == len(picks) > 20
    assert all(p.regret >= 0 for p in picks)
    assert all(len(p.true) == len(p.predicted) == 4 for p in picks)
    assert all(pred is not None and pred["ttft_s"] > 0 for p in picks for pred in p.predicted)
    assert 0 <= row["missed"] <= 1 and row["regret_p90_ms"] >= 0
    worst = max(picks, key=lambda p: p.regret)
    lines = describe(worst)
    assert len(lines) == 5 and lines[0].startswith(f"regret {worst.regret * 1e3:.1f} ms")
    _, blind = run("base", "decode-heavy", "llmgw:latency", 1, blind=True, window=0.4)
    assert [p.chosen for p in blind] == [p.chosen for p in picks]  # the router's own picks
    assert any(b.true != p.true for b, p in zip(blind, picks, strict=True))
