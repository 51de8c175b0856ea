"""The operator-facing CLI on inputs found by a review: a trace across a rollout, a replay
where nothing completes, a line cut inside a character, `demo` on a base install."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import llmgw
from llmgw.cli.replay import main as replay_main
from llmgw.cli.replay_trace import read_trace
from llmgw.hashring import HashRing
from llmgw.runtime.trace import session_hash

OLD = ["10.0.0.1:8000", "10.0.0.2:8000"]  # the pods before a rollout
NEW = ["10.0.0.3:8000", "10.0.0.4:8000"]  # after it: new pod IPs (Kubernetes)


def ring_line(t: float, endpoints: list[str], session: str) -> str:
    """A trace line as the recording router wrote it for a `ring` pick on `endpoints`
    (the fleet of that moment: its pick scored exactly those, `decision.totals`)."""
    row: dict[str, Any] = {
        "t": t,
        "model": "m1",
        "session": session_hash(session),
        "rid": None,
        "prompt_tokens": 100,
        "blocks": [],
        "decision": {
            "endpoint": HashRing(endpoints).candidates(session)[0],
            "totals": dict.fromkeys(endpoints, 1.0),
        },
        "outcome": {"ttft_ms": 20.0, "duration_ms": 120.0},
    }
    return json.dumps(row)


def test_a_trace_across_a_rollout_replays_each_request_on_the_fleet_of_its_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A week of traffic on Kubernetes spans rollouts: the pods come back under new IPs.
    The replay put every endpoint the trace ever names in one fleet for the whole replay,
    so requests recorded after the rollout were spread over pods that were gone (and
    before it, over pods not yet there): replaying the recorded strategy (ring) did not
    give the recorded picks, and capacity was doubled."""
    lines = [ring_line(i * 0.05, OLD, f"user-{i}") for i in range(40)]
    lines += [ring_line(2.0 + i * 0.05, NEW, f"user-{i}") for i in range(40)]
    path = tmp_path / "week.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert replay_main([str(path), "--strategies", "ring", "--json", "--no-mirror"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    ring = next(r for r in rows if r["strategy"] == "ring")
    assert ring["same_as_recorded"] == 1.0, ring


def test_replay_json_is_valid_json_when_no_request_completes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--json` is "for tools": a replay in which nothing completed (one request over the
    simulated engine's context) printed `"req_per_s": NaN`, which no JSON parser but
    Python's accepted (jq, JavaScript, Go refuse the whole document)."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"t": 1.0, "model": "m1", "prompt_tokens": 9000}) + "\n")
    assert replay_main([str(path), "--json"]) == 0
    out = capsys.readouterr().out

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    json.loads(out, parse_constant=refuse)


def test_demo_without_its_extras_says_which_to_install_not_a_traceback(tmp_path: Path) -> None:
    """`pip install llmgw` then `llmgw demo`: demo.py imports llmgw.runtime.trace at module
    level, which imports prometheus_client (not a base dependency), so the dispatcher's
    import failed before the demo's own "needs the extproc, sim and dev extras" check ran:
    a ModuleNotFoundError traceback."""
    script = textwrap.dedent(
        """
        import importlib.abc, sys

        class Missing(importlib.abc.MetaPathFinder):  # a base install: no extras
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("prometheus_client", "grpc", "openai"):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, Missing())
        from llmgw.cli import main
        sys.exit(main(["demo"]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(llmgw.__file__).parent.parent)},
    )
    assert "Traceback" not in done.stderr, done.stderr[-800:]
    assert done.returncode == 2
    assert "extra" in done.stderr


def test_a_line_cut_inside_a_non_ascii_character_loses_that_line_not_the_trace(
    tmp_path: Path,
) -> None:
    """orjson writes model names as raw UTF-8 (`"modèle"`); a full disk (or a copy of a
    live trace) that cuts a line inside a two-byte character left invalid UTF-8 in the
    file, and the writer goes on after it (it ends the cut line on reopening). A cut line
    is meant to be left out with a warning (`test_a_line_cut_by_a_full_disk_does_not_make_
    the_trace_unreadable`); here the whole file was refused as "not UTF-8 text"."""
    rows = [
        json.dumps(
            {"t": i * 0.1, "model": "modèle", "prompt_tokens": 10, "blocks": []},
            ensure_ascii=False,
        ).encode()
        for i in range(4)
    ]
    cut = rows[1][: rows[1].index("è".encode()) + 1]  # the first byte of è alone
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"\n".join([rows[0], cut, rows[2], rows[3]]) + b"\n")
    arrivals = read_trace([path], 10.0, None)
    assert len(arrivals) == 3 and {a.model for a in arrivals} == {"modèle"}
