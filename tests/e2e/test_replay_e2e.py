"""A trace recorded from `llmgw demo` (Envoy + ext_proc + simulated replicas) replays."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmgw.cli import demo, replay

pytestmark = pytest.mark.e2e

ENGINE = "replicas=4,decode_ms=4"  # the demo fleet's engines
# A 96-request demo of short histories (no opening notes): the workload the bands below
# and bench/replay_loop.py were measured on.
SHORT_DEMO = ["--sessions", "16", "--turns", "4", "--anonymous", "32", "--context-tokens", "0"]


def replayed(
    trace: Path, strategies: str, capsys: pytest.CaptureFixture[str], engine: str = ENGINE
) -> dict[str, dict[str, Any]]:
    capsys.readouterr()
    assert (
        replay.main([str(trace), "--strategies", strategies, "--engine-args", engine, "--json"])
        == 0
    )
    return {row["strategy"]: row for row in json.loads(capsys.readouterr().out)["rows"]}


def test_a_demo_trace_replays_with_three_strategies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "demo.jsonl"
    assert demo.main(["--trace", str(trace)]) == 0
    rows = replayed(trace, "latency,chat,round-robin", capsys)
    assert list(rows) == ["recorded", "latency", "chat", "round-robin"]
    assert rows["recorded"]["requests"] == 44
    for name in ("latency", "chat", "round-robin"):
        row = rows[name]
        assert row["requests"] == 44 and row["errors"] == 0
        assert row["ttft_p50_ms"] is not None and row["req_per_s"] > 0
    text = trace.read_text()  # the demo's prompts and session ids are not in it
    for needle in ("Lisbon", "travel assistant", "one-off", "user-1"):
        assert needle not in text


@pytest.mark.parametrize("edge", ["envoy", "proxy"])
@pytest.mark.parametrize("strategy", ["latency", "chat", "ring"])
def test_replaying_a_recorded_run_with_its_strategy_reproduces_per_replica_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edge: str, strategy: str
) -> None:
    # The demo's live engines starve for CPU (their queues and speeds are the host's, not
    # the engine model's); the replay mirrors that noise from what the trace recorded at
    # each pick, so the recorded strategy makes the recorded picks again.
    trace = tmp_path / f"{edge}-{strategy}.jsonl"
    argv = [*SHORT_DEMO, "--strategy", strategy, "--edge", edge, "--trace", str(trace)]
    assert demo.main(argv) == 0
    rows = replayed(trace, strategy, capsys, engine="replicas=4")
    recorded, replay_ = rows["recorded"]["per_replica"], rows[strategy]["per_replica"]
    assert isinstance(recorded, dict) and isinstance(replay_, dict)
    assert sum(recorded.values()) == 96 and rows[strategy]["errors"] == 0
    # Within 5 %, or 2 requests (one pick of 96 made elsewhere moves two counts by one; a
    # second, rarer, follows from the first): a CI run failed on 23 -> 25 of ~24 with
    # Envoy and `latency`, where 5 % is 1.2 requests.
    for endpoint, count in recorded.items():
        assert abs(replay_[endpoint] - count) <= max(2, 0.05 * count), (recorded, replay_)
    if edge == "proxy":  # the proxy sees first tokens: the trace has TTFTs
        assert rows["recorded"]["ttft_p50_ms"] is not None


def test_without_mirroring_a_latency_replay_still_predicts_the_recorded_ttft(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The whole path (trace -> fitted fleet -> replayed router -> prediction) stays in the
    # recorded run's units and order of magnitude. How closely it tracks is the starved
    # host's to say: 24 runs here read 0.64-1.72x (the recorded p50 alone 7.6-22 ms), and a
    # 0.5-2x band failed about one CI run in ten. The fitted speeds themselves are checked
    # in tests/cli/test_replay.py (`fit_engine`).
    # With the demo's default ~400-token notes the starved host read 1.1-2.7x over 10 runs.
    trace = tmp_path / "latency.jsonl"
    assert demo.main([*SHORT_DEMO, "--strategy", "latency", "--trace", str(trace)]) == 0
    capsys.readouterr()
    assert replay.main([str(trace), "--strategies", "latency", "--no-mirror", "--json"]) == 0
    rows = {row["strategy"]: row for row in json.loads(capsys.readouterr().out)["rows"]}
    ratio = rows["latency"]["predicted_ttft_p50_ms"] / rows["recorded"]["predicted_ttft_p50_ms"]
    assert 1 / 3 < ratio < 3.0, rows
