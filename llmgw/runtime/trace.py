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

import dataclasses
import logging
import random
import time
from logging.handlers import RotatingFileHandler
from typing import Any

import mmh3
import orjson

from llmgw.config import TraceSpec
from llmgw.lifecycle import Hooks, Lifecycle
from llmgw.runtime.telemetry import decision_reason
from llmgw.scheduling.prefix import PrefixIndex
from llmgw.types import CHARS_PER_TOKEN, Outcome

BLOCK_TOKENS = 64  # the latency scorer's default block: the same hashes, the same sharing
MAX_BLOCKS = 128  # 8,192 tokens of prefix: more says little more about cache reuse
_blocks = PrefixIndex(block_chars=int(BLOCK_TOKENS * CHARS_PER_TOKEN), max_blocks=MAX_BLOCKS)


def session_hash(key: str) -> str:
    """A stable, non-reversible name for a session key (64-bit murmur3, hex)."""
    return f"{mmh3.hash64(key.encode('utf-8', 'surrogatepass'), seed=0x5E55)[0] & (2**64 - 1):016x}"


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


class TraceWriter:
    """Writes sampled trace lines to a size-rotated file (stdlib RotatingFileHandler: it
    rotates safely and keeps `backups` old files). Call it as a lifecycle `finished` hook."""

    def __init__(self, spec: TraceSpec, edge: str, *, rng: random.Random | None = None) -> None:
        if spec.path is None:
            raise ValueError("trace.path is not set")
        self.sample = spec.sample
        self.edge = edge
        self.written = 0
        self._random = (rng or random.Random()).random
        self._handler = RotatingFileHandler(
            spec.path,
            maxBytes=spec.max_bytes,
            backupCount=spec.backups,
            encoding="utf-8",
            delay=True,
        )
        self._handler.setFormatter(logging.Formatter("%(message)s"))

    def __call__(self, lifecycle: Lifecycle, outcome: Outcome) -> None:
        if self.sample < 1.0 and self._random() >= self.sample:
            return
        record = trace_record(lifecycle, outcome, self.edge)
        if record is None:
            return
        line = orjson.dumps(record).decode()
        self._handler.handle(logging.makeLogRecord({"msg": line, "levelno": logging.INFO}))
        self.written += 1

    def close(self) -> None:
        self._handler.close()


def trace_writer(spec: TraceSpec, edge: str) -> TraceWriter | None:
    """A writer when the config asks for a trace, else None."""
    return TraceWriter(spec, edge) if spec.path is not None else None


def traced(hooks: Hooks, spec: TraceSpec) -> Hooks:
    """`hooks` plus the decision trace the config asks for (unchanged when it asks none)."""
    writer = trace_writer(spec, hooks.edge)
    return hooks if writer is None else dataclasses.replace(hooks, finished=writer)


def close_trace(hooks: Hooks) -> None:
    """Close the trace file of hooks made by `traced` (server stop)."""
    if isinstance(hooks.finished, TraceWriter):
        hooks.finished.close()
