"""The trace's blocks share exactly what the engines' caches share (prompts of different
`cache_salt` share none), and a full disk loses trace lines, not the trace."""

from __future__ import annotations

import errno
import io
import json
from pathlib import Path
from typing import Any

import orjson
import pytest

import llmgw.runtime.trace as trace_module
from llmgw.cli.replay import main
from llmgw.config import load_dict
from llmgw.gateway import Gateway
from llmgw.lifecycle import Hooks, Lifecycle
from llmgw.runtime.trace import TraceWriter, close_trace, traced
from llmgw.scheduling.scheduler import Scheduler

TEXT = "Summarise the attached quarterly report for the board. " * 60  # ~800 tokens


def test_prompts_with_different_cache_salts_do_not_share_blocks_in_the_trace(
    tmp_path: Path,
) -> None:
    path = tmp_path / "trace.jsonl"
    cfg = load_dict(
        {
            "models": {"m1": {"endpoints": ["10.0.0.1:8000"], "strategy": "latency"}},
            "trace": {"path": str(path)},
        }
    )
    gateway = Gateway(Scheduler(cfg, seed=1))
    hooks = traced(Hooks("test"), cfg.trace)
    for salt in ("tenant-a", "tenant-b"):
        body = {
            "model": "m1",
            "cache_salt": salt,
            "messages": [{"role": "user", "content": TEXT}],
        }
        lifecycle = Lifecycle(gateway, hooks)
        lifecycle.route({}, "/v1/chat/completions", orjson.dumps(body))
        lifecycle.first_byte()
        lifecycle.response(200)
        lifecycle.finish()
    close_trace(hooks)
    a, b = (json.loads(line) for line in path.read_text().splitlines())
    assert len(a["blocks"]) > 5
    # vLLM keys every block of a salted prompt by its salt, and so does the latency
    # scorer's index (`\x00salt\x00prompt`): tenant-b's request found nothing of
    # tenant-a's cached. A replay reading these lines must not see them share a prefix.
    assert not set(a["blocks"]) & set(b["blocks"]), "salted prompts share blocks in the trace"


class Disk:
    """A disk with `room` bytes free (None: plenty): a write fills what is left and
    returns the short count, the next one fails ENOSPC, as write(2) does."""

    def __init__(self) -> None:
        self.room: int | None = None

    def open(self, path: Any, mode: str = "r", buffering: int = -1, **_: Any) -> Any:
        disk = self

        class Raw(io.FileIO):
            def write(self, data: Any) -> int:
                if disk.room is None:
                    return super().write(data)
                if disk.room == 0:
                    raise OSError(errno.ENOSPC, "No space left on device")
                n = super().write(bytes(data)[: disk.room])
                disk.room -= n
                return n

        return io.BufferedWriter(Raw(path, mode.replace("b", "")), buffer_size=buffering)


def run(gateway: Gateway, hooks: Hooks, turn: int) -> None:
    body = {"model": "m1", "messages": [{"role": "user", "content": f"question {turn} " * 30}]}
    lifecycle = Lifecycle(gateway, hooks)
    lifecycle.route({"x-session-id": f"s{turn}"}, "/v1/chat/completions", orjson.dumps(body))
    lifecycle.first_byte()
    lifecycle.response(200)
    lifecycle.finish()


def test_a_line_cut_by_a_full_disk_does_not_make_the_trace_unreadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    disk = Disk()
    monkeypatch.setattr(trace_module, "open", disk.open, raising=False)
    path = tmp_path / "trace.jsonl"
    cfg = load_dict(
        {
            "models": {"m1": {"endpoints": ["10.0.0.1:8000", "10.0.0.2:8000"]}},
            "trace": {"path": str(path)},
        }
    )
    gateway = Gateway(Scheduler(cfg, seed=1))

    def server() -> tuple[TraceWriter, Hooks]:
        writer = TraceWriter(cfg.trace, "test")
        return writer, Hooks("test", finished=writer, dispatched=writer.dispatched)

    writer, hooks = server()
    for turn in range(3):
        run(gateway, hooks, turn)
    writer.flush()
    run(gateway, hooks, 3)  # buffered
    disk.room = 100  # the disk fills: the stop's flush writes 100 bytes of that line
    writer.close()  # as documented: the buffered line is lost, the stop does not raise
    assert writer.lost == 1
    disk.room = None  # space is back; the router restarts and traces on
    writer, hooks = server()
    for turn in range(4, 6):
        run(gateway, hooks, turn)
    writer.close()
    # 5 whole lines were written; the replay should read them (and at most skip the cut
    # one), not refuse the whole trace.
    code = main([str(path), "--strategies", "round-robin", "--json"])
    err = capsys.readouterr().err
    assert code == 0, err
