"""bench/workload_trace.py: a bench workload as a trace that `llmgw replay` reads."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.workload_trace import export
from bench.workloads import build
from llmgw.cli.replay_trace import read_trace


def test_a_workload_exports_as_a_trace_replay_reads(tmp_path: Path) -> None:
    out = tmp_path / "w.jsonl"
    count = export("chat", out, seed=3, scale=0.05, service_s=0.5)
    workload = build("chat", seed=3, scale=0.05)
    assert count == workload.requests
    arrivals = read_trace([out], decode_ms=10.0, output_tokens=None)
    assert len(arrivals) == count
    assert [a.t for a in arrivals] == sorted(a.t for a in arrivals)
    max_tokens = sorted(t.max_tokens for c in workload.conversations for t in c.turns)
    assert sorted(a.output_tokens for a in arrivals) == max_tokens
    # Turns of one conversation share their history's leading blocks.
    by_session: dict[str | None, list[tuple[int, ...]]] = {}
    for a in arrivals:
        by_session.setdefault(a.session, []).append(a.blocks)
    first, second = next(b for s, b in by_session.items() if s and len(b) > 1)[:2]
    assert first and second[: len(first) - 1] == first[:-1]
