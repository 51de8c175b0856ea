"""The decision trace: one JSON line per sampled request, for `llmgw replay` and audits.

    trace:                       # in the config; off when `path` is not set
      path: /var/log/llmgw/trace.jsonl
      sample: 0.1                # share of requests written
      max_bytes: 67108864        # rotate past this size: path.1 .. path.<backups>
      backups: 3

A line says what the request looked like, never what it said: the model, a hash of the
session key, the prompt's length in tokens and the chained hashes of its 64-token blocks
(the latency scorer's cache blocks, so a replay sees which requests share prefixes), the
Decision, and the outcome. Prompt text, headers and request ids are not written.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from llmgw.config import TraceSpec
from llmgw.hashring import ring_position
from llmgw.lifecycle import Hooks, Lifecycle
from llmgw.runtime.telemetry import decision_reason
from llmgw.scheduling.prefix import PrefixIndex
from llmgw.types import CHARS_PER_TOKEN, Outcome

BLOCK_TOKENS = 64  # the latency scorer's default block: the same hashes, the same sharing
MAX_BLOCKS = 128  # 8,192 tokens of prefix: more says little more about cache reuse
_blocks = PrefixIndex(block_chars=int(BLOCK_TOKENS * CHARS_PER_TOKEN), max_blocks=MAX_BLOCKS)


def session_hash(key: str) -> str:
    """The session key's place on the hash ring (64-bit murmur3, 16 hex digits): names the
    session without its key, and lets a replay put it where the ring put it."""
    return f"{ring_position(key):016x}"


def trace_record(lifecycle: Lifecycle, outcome: Outcome, edge: str) -> dict[str, Any] | None:
    """The trace line of a finished request (None if it was never dispatched)."""
    request, decision = lifecycle.request, lifecycle.decision
    if request is None or decision is None:
        return None
    ended = time.perf_counter()
    rationale = decision.rationale
    answered = lifecycle.endpoint.id if lifecycle.endpoint is not None else decision.endpoint.id
    return {
        # Unix seconds at arrival: replays keep the gaps between requests.
        "t": round(time.time() - (ended - lifecycle.started), 6),
        "edge": edge,
        "model": request.model,
        "session": session_hash(request.session_key) if request.session_key else None,
        # Without a session the request id is the ring key: its place, not the id.
        "rid": None if request.session_key else session_hash(request.request_id),
        "prompt_tokens": request.prompt_tokens,
        "blocks": _blocks.hashes(request.prompt) if request.prompt else [],
        "stream": request.stream,
        "decision": {
            "endpoint": decision.endpoint.id,
            "fallbacks": [e.id for e in decision.fallbacks],
            "strategy": rationale.strategy,
            "reason": decision_reason(decision),
            "predicted_ttft_ms": (
                None if decision.predicted_ttft is None else decision.predicted_ttft * 1e3
            ),
            "totals": dict(zip(rationale.endpoint_ids, rationale.totals, strict=True)),
        },
        "outcome": {
            "endpoint": answered,
            "status": lifecycle.status,
            "outcome": outcome.value,
            "attempts": lifecycle.attempts,
            "ttft_ms": None if lifecycle.ttft is None else lifecycle.ttft * 1e3,
            "duration_ms": (ended - lifecycle.started) * 1e3,
        },
    }


class RotatingFile:
    """Appends lines to `path`, rotating to path.1 .. path.<backups> before it would pass
    `max_bytes`. Hand-written over logging's RotatingFileHandler, which cost ~20 µs a line
    here (a LogRecord, a lock, formatting twice, a flush syscall) against ~3 µs: writes are
    buffered and flushed within a second (a timer on the running loop, so an idle server
    does not hold its last lines), at rotation and at close."""

    FLUSH_EVERY = 1.0  # seconds: what a crash may lose

    def __init__(self, path: str | Path, max_bytes: int, backups: int) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self._file: BinaryIO | None = None
        self._size = 0
        self._flushed = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None

    def write(self, line: bytes) -> None:
        file = self._file
        if file is None:
            file = self._file = open(self.path, "ab", buffering=1 << 16)  # noqa: SIM115
            self._size = file.tell()
        if self._size and self._size + len(line) > self.max_bytes:
            self._rotate()
            file = self._file
            assert file is not None
        file.write(line)
        self._size += len(line)
        now = time.monotonic()
        if now - self._flushed >= self.FLUSH_EVERY:
            self._flushed = now
            file.flush()
        elif self._timer is None:
            self._timer = _flush_later(self.FLUSH_EVERY, self._timed_flush)

    def _timed_flush(self) -> None:
        self._timer = None
        self._flushed = time.monotonic()
        self.flush()

    def _rotate(self) -> None:
        self.close()
        for i in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._file = open(self.path, "ab", buffering=1 << 16)  # noqa: SIM115
        self._size = 0

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._file is not None:
            self._file.close()
            self._file = None


def _flush_later(delay: float, flush: Callable[[], None]) -> asyncio.TimerHandle | None:
    """A flush `delay` seconds from now on the running loop (None outside one: the next
    write or close flushes)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return loop.call_later(delay, flush)


class TraceWriter:
    """Writes sampled trace lines to a size-rotated file. Call it as a lifecycle
    `finished` hook (see `traced`)."""

    def __init__(self, spec: TraceSpec, edge: str, *, rng: random.Random | None = None) -> None:
        if spec.path is None:
            raise ValueError("trace.path is not set")
        self.sample = spec.sample
        self.edge = edge
        self.written = 0
        self._random = (rng or random.Random()).random
        # `{pid}` in the path: one file per process (`--workers N` must not share one).
        path = spec.path.replace("{pid}", str(os.getpid()))
        self._file = RotatingFile(path, spec.max_bytes, spec.backups)

    def __call__(self, lifecycle: Lifecycle, outcome: Outcome) -> None:
        if self.sample < 1.0 and self._random() >= self.sample:
            return
        record = trace_record(lifecycle, outcome, self.edge)
        if record is None:
            return
        self._file.write(orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE))
        self.written += 1

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def trace_writer(spec: TraceSpec, edge: str) -> TraceWriter | None:
    """A writer when the config asks for a trace, else None."""
    return TraceWriter(spec, edge) if spec.path is not None else None


def shared_trace_problem(spec: TraceSpec, workers: int) -> str | None:
    """Why `workers` processes cannot write this trace (they would rotate one file)."""
    if workers > 1 and spec.path is not None and "{pid}" not in spec.path:
        return (
            f"trace.path: with --workers {workers}, put {{pid}} in the path "
            "(one file per process), e.g. /var/log/llmgw/trace.{pid}.jsonl"
        )
    return None


def traced(hooks: Hooks, spec: TraceSpec) -> Hooks:
    """`hooks` plus the decision trace the config asks for (unchanged when it asks none)."""
    writer = trace_writer(spec, hooks.edge)
    return hooks if writer is None else dataclasses.replace(hooks, finished=writer)


def close_trace(hooks: Hooks) -> None:
    """Close the trace file of hooks made by `traced` (server stop)."""
    if isinstance(hooks.finished, TraceWriter):
        hooks.finished.close()
