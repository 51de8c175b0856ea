"""The operator-facing CLI on inputs found by a review: a trace across a rollout, a replay
where nothing completes, a line cut inside a character, `demo` on a base install."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import llmgw
from llmgw.cli.replay import main as replay_main
from llmgw.cli.replay_trace import read_trace


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
