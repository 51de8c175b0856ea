"""bench/crosscheck.py: its fleet's ports, its table, and a run that goes on past a
contender that fails to start (no engine or router runs here: they are stand-ins)."""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import crosscheck, routing
from bench.routing import Contender, all_contenders, best_p90


def test_the_fleet_takes_a_base_port_free_for_every_replica(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """base_port() checked routing's 4 ports: with --replicas 8 a busy base + 4 made the
    engine fail to bind ('xsim engine did not start'). (found by a review helper)"""
    monkeypatch.setattr(routing, "_port_free", lambda port: port != 18104)
    commands: list[list[str]] = []

    class Popen:
        def __init__(self, cmd: list[str], **_: object) -> None:
            commands.append(cmd)
            self.stdout = types.SimpleNamespace(readline=lambda: "READY http://x\n")

    monkeypatch.setattr(subprocess, "Popen", Popen)
    crosscheck.Fleet(8, 100, "full", False)
    crosscheck.Fleet(4, 100, "full", False)
    bases = [int(cmd[cmd.index("--base-port") + 1]) for cmd in commands]
    assert bases == [28100, 18100]  # 18100-18107 holds the busy port; 18100-18103 does not


def test_the_ratio_divides_by_the_best_the_star_compares_with() -> None:
    """The ratio divided by the lowest p90 of all contenders, errors or not, while `*`
    compares with best_p90 (error-free ones first): the 1.00x contender was not the best
    the star meant. (found by a review helper)"""
    results = {
        "w": {
            "a": {"ttft_p90_ms": 50.0, "ttft_p90_ci_ms": [48.0, 52.0], "errors": 1},
            "b": {"ttft_p90_ms": 100.0, "ttft_p90_ci_ms": [95.0, 105.0], "errors": 0},
            "c": {"ttft_p90_ms": 80.0, "ttft_p90_ci_ms": [70.0, 90.0], "errors": 0},
        }
    }
    assert best_p90(results["w"]) == 80.0
    contenders = [Contender(n, "client") for n in "abc"]
    rows = {r["contender"]: r["w"] for r in crosscheck._rows(results, ["w"], contenders)}
    assert rows == {"a": "50 (0.62x)", "b": "100 (1.25x)*", "c": "80 (1.00x)"}


def test_a_contender_that_fails_to_start_is_skipped_and_the_run_goes_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A RuntimeError from one contender's start (a peer that exits, Envoy not ready,
    warm-up never 200) ended the whole run, which wrote nothing; routing.py's grid skips
    it. (found by a review helper)"""

    class Fleet:
        def __init__(self, *_: object) -> None:
            self.urls = ["http://127.0.0.1:1"]

        def close(self) -> None:
            pass

    @contextlib.contextmanager
    def start(contender: Contender, *_: object) -> Iterator[str]:
        if contender.name == "sglang-router:cache_aware":
            raise RuntimeError("sglang-router exited with 1")
        yield ""

    async def run_one(*_: object) -> dict[str, Any]:
        return {"ttft_p50_ms": 1.0, "ttft_p90_ms": 2.0, "prefix_hit_rate": 0.5,
                "busy_max_mean": 1.0, "errors": 0, "unread_tokens": 0.0}  # fmt: skip

    monkeypatch.setattr(crosscheck, "Fleet", Fleet)
    monkeypatch.setattr(crosscheck, "start_contender", start)
    monkeypatch.setattr(crosscheck, "run_one", run_one)
    by_name = {c.name: c for c in all_contenders()}
    contenders = [by_name[n] for n in ("sglang-router:cache_aware", "client:ring")]
    args = argparse.Namespace(
        replicas=4, metrics="full", cache_info=False, role_chunk="with-token", timeout=60.0
    )
    results = crosscheck._run_seed(args, 1, 1.0, ["decode-long"], contenders, {}, None)
    assert list(results["decode-long"]) == ["client:ring"]
    assert (
        "sglang-router:cache_aware: failed: sglang-router exited with 1" in capsys.readouterr().out
    )


def test_a_p90_that_fell_on_failures_reads_fail_not_not_run() -> None:
    """A contender whose p90 fell on failed requests (written None) read `-`, as one that
    did not run. (found by a review helper)"""
    results: dict[str, dict[str, dict[str, Any]]] = {
        "w": {
            "a": {"ttft_p90_ms": 50.0, "ttft_p90_ci_ms": [48.0, 52.0], "errors": 0},
            "b": {
                "ttft_p90_ms": None,
                "ttft_p90_ci_ms": [60.0, None],
                "errors": 3,
                "ttft_failed": 3,
            },
        }
    }
    contenders = [Contender(n, "client") for n in "abc"]
    rows = {r["contender"]: r["w"] for r in crosscheck._rows(results, ["w"], contenders)}
    assert rows == {"a": "50 (1.00x)", "b": "fail*", "c": None}
