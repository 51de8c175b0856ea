"""A trace recorded from `llmgw demo` (Envoy + ext_proc + simulated replicas) replays."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from llmgw.cli import demo, replay

pytestmark = pytest.mark.e2e

ENGINE = "replicas=4,decode_ms=4"  # the demo fleet's engines


def replayed(
    trace: Path, strategies: str, capsys: pytest.CaptureFixture[str], engine: str = ENGINE
) -> dict[str, dict[str, Any]]:
    capsys.readouterr()
    assert (
        replay.main([str(trace), "--strategies", strategies, "--engine-args", engine, "--json"])
        == 0
    )
    return {row["strategy"]: row for row in json.loads(capsys.readouterr().out)["rows"]}


def test_a_demo_trace_replays_with_three_strategies_in_under_a_minute(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "demo.jsonl"
    assert demo.main(["--trace", str(trace)]) == 0
    started = time.monotonic()
    rows = replayed(trace, "latency,chat,round-robin", capsys)
    assert time.monotonic() - started < 60
    assert list(rows) == ["recorded", "latency", "chat", "round-robin"]
    assert rows["recorded"]["requests"] == 44
    for name in ("latency", "chat", "round-robin"):
        row = rows[name]
        assert row["requests"] == 44 and row["errors"] == 0
        assert row["ttft_p50_ms"] is not None and row["req_per_s"] > 0
    text = trace.read_text()  # the demo's prompts and session ids are not in it
    for needle in ("Lisbon", "travel assistant", "one-off", "user-1"):
        assert needle not in text


def test_replaying_a_recorded_run_with_its_strategy_reproduces_per_replica_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "ring.jsonl"
    argv = ["--sessions", "16", "--turns", "4", "--anonymous", "32", "--strategy", "ring"]
    assert demo.main([*argv, "--trace", str(trace)]) == 0
    rows = replayed(trace, "ring", capsys)
    recorded, ring = rows["recorded"]["per_replica"], rows["ring"]["per_replica"]
    assert isinstance(recorded, dict) and isinstance(ring, dict)
    assert sum(recorded.values()) == 96
    for endpoint, count in recorded.items():
        assert abs(ring[endpoint] - count) <= 0.05 * count, (recorded, ring)


def test_a_latency_replay_predicts_the_ttft_the_recording_router_predicted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The demo's engines run several times slower than configured on a busy host; a replay
    # with their nominal settings predicted TTFTs ~5x too short (6 vs 27-31 ms), so the
    # latency strategy weighed queueing against prefill differently than it did live.
    trace = tmp_path / "latency.jsonl"
    argv = ["--sessions", "16", "--turns", "4", "--anonymous", "32", "--strategy", "latency"]
    assert demo.main([*argv, "--trace", str(trace)]) == 0
    rows = replayed(trace, "latency", capsys, engine="replicas=4")
    recorded, replay_ = rows["recorded"], rows["latency"]
    assert replay_["requests"] == 96 and replay_["errors"] == 0
    ratio = replay_["predicted_ttft_p50_ms"] / recorded["predicted_ttft_p50_ms"]
    assert 0.5 < ratio < 2.0, (recorded, replay_)
