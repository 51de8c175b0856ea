"""The replayed fleet is the recorded fleet: each model on its own endpoints, a replica
never picked included, and a config's model replayed with its own ring settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmgw.cli.replay import main
from llmgw.config import load_dict
from llmgw.hashring import HashRing
from llmgw.registry import Registry
from llmgw.runtime.trace import session_hash
from llmgw.scheduling.scheduler import Scheduler
from llmgw.types import RequestInfo

M1 = ["10.0.0.1:8000", "10.0.0.2:8000"]
M2 = ["10.0.1.1:8000", "10.0.1.2:8000"]


def ring_line(t: float, model: str, endpoints: list[str], session: str) -> str:
    """A line as the recording router wrote it for a `ring` pick on `endpoints`."""
    endpoint = HashRing(endpoints).candidates(session)[0]
    row: dict[str, Any] = {
        "t": t,
        "model": model,
        "session": session_hash(session),
        "rid": None,
        "prompt_tokens": 100,
        "blocks": [],
        "decision": {"endpoint": endpoint, "totals": dict.fromkeys(endpoints, 1.0)},
        "outcome": {"ttft_ms": 20.0, "duration_ms": 120.0},
    }
    return json.dumps(row)


def test_two_models_on_their_own_endpoints_replay_on_their_own_endpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """m1 served by two replicas, m2 by two others; replaying the recorded strategy (ring)
    must send every request where it went. The replay gives every model every endpoint
    seen in the trace: m1's sessions land on m2's replicas."""
    lines = [ring_line(i * 0.05, "m1", M1, f"user-{i}") for i in range(40)]
    alone = tmp_path / "m1.jsonl"  # m1's lines alone replay exactly: the lines are right
    alone.write_text("\n".join(lines) + "\n")
    assert main([str(alone), "--strategies", "ring", "--json", "--no-mirror"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert next(r for r in rows if r["strategy"] == "ring")["same_as_recorded"] == 1.0
    lines += [ring_line(i * 0.05 + 0.01, "m2", M2, f"user-{i}") for i in range(40)]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert main([str(path), "--strategies", "ring", "--json", "--no-mirror"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    ring = next(r for r in rows if r["strategy"] == "ring")
    assert ring["same_as_recorded"] == 1.0, ring


def test_a_replica_that_was_never_picked_is_still_in_the_replayed_fleet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The recorded model had three candidates (decision.totals) but the short trace
    only ever picked two: `round-robin` on the replay spreads over two replicas, not the
    three the fleet had."""
    three = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
    rows = []
    for i in range(30):
        rows.append(
            json.dumps(
                {
                    "t": i * 0.05,
                    "model": "m1",
                    "session": None,
                    "rid": session_hash(f"r{i}"),
                    "prompt_tokens": 100,
                    "blocks": [],
                    "decision": {"endpoint": three[i % 2], "totals": dict.fromkeys(three, 0.5)},
                    "outcome": {"ttft_ms": 20.0, "duration_ms": 120.0},
                }
            )
        )
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(rows) + "\n")
    assert main([str(path), "--strategies", "round-robin", "--json", "--no-mirror"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(out["endpoints"]) == three, out["endpoints"]


def test_replaying_a_configs_strategy_uses_its_models_ring_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--config` replays each model's strategy "from a config"; the recording router's
    ring there had 7 virtual nodes per replica (`session.num_virtual_nodes`), and its
    picks are replayed exactly only on that ring. The replay builds every model with the
    default session settings (100 nodes), so the config's own strategy lands sessions
    elsewhere than the config's router did."""
    four = [f"10.0.0.{i + 1}:8000" for i in range(4)]
    spec = {"endpoints": four, "strategy": "ring", "session": {"num_virtual_nodes": 7}}
    live = Scheduler(load_dict({"models": {"m1": spec}}), Registry(), seed=1)
    rows = []
    for i in range(60):
        key = f"user-{i}"
        picked = live.pick(RequestInfo(model="m1", request_id=f"r{i}", session_key=key))
        rows.append(
            json.dumps(
                {
                    "t": i * 0.05,
                    "model": "m1",
                    "session": session_hash(key),
                    "rid": None,
                    "prompt_tokens": 100,
                    "blocks": [],
                    "decision": {"endpoint": picked.endpoint.id},
                    "outcome": {"ttft_ms": 20.0, "duration_ms": 120.0},
                }
            )
        )
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(rows) + "\n")
    cfg = tmp_path / "llmgw.yaml"
    cfg.write_text(json.dumps({"models": {"m1": spec}}))  # JSON is YAML
    assert main([str(path), "--strategies", "", "--config", str(cfg), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    replayed = next(r for r in out["rows"] if r["strategy"] == "llmgw.yaml:m1")
    assert replayed["same_as_recorded"] == 1.0, replayed


OLD = ["10.0.0.1:8000", "10.0.0.2:8000"]  # the pods before a rollout
NEW = ["10.0.0.3:8000", "10.0.0.4:8000"]  # after it: new pod IPs (Kubernetes)


def test_a_trace_across_a_rollout_replays_each_request_on_the_fleet_of_its_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A week of traffic on Kubernetes spans rollouts: the pods come back under new IPs.
    The replay put every endpoint the trace ever names in one fleet for the whole replay,
    so requests recorded after the rollout were spread over pods that were gone (and
    before it, over pods not yet there): replaying the recorded strategy (ring) did not
    give the recorded picks, and capacity was doubled."""
    lines = [ring_line(i * 0.05, "m1", OLD, f"user-{i}") for i in range(40)]
    lines += [ring_line(2.0 + i * 0.05, "m1", NEW, f"user-{i}") for i in range(40)]
    path = tmp_path / "week.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert main([str(path), "--strategies", "ring", "--json", "--no-mirror"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    ring = next(r for r in rows if r["strategy"] == "ring")
    assert ring["same_as_recorded"] == 1.0, ring
