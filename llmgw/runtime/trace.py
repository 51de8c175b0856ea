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
import contextlib
import dataclasses
import logging
import os
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from llmgw.calibration import Costs, pooled
from llmgw.config import TraceSpec
from llmgw.hashring import ring_position
from llmgw.lifecycle import Hooks, Lifecycle
from llmgw.registry import EndpointState, fresh_metrics_of
from llmgw.runtime.telemetry import decision_reason
from llmgw.scheduling.prefix import PrefixIndex
from llmgw.scheduling.scorers import LatencyScorer
from llmgw.types import CHARS_PER_TOKEN, Outcome, Rationale

BLOCK_TOKENS = 64  # the latency scorer's default block: the same hashes, the same sharing
MAX_BLOCKS = 128  # 8,192 tokens of prefix: more says little more about cache reuse
_blocks = PrefixIndex(block_chars=int(BLOCK_TOKENS * CHARS_PER_TOKEN), max_blocks=MAX_BLOCKS)


def _ends_a_line(path: Path) -> bool:
    """The file's last byte is a newline (or it cannot be read: assume so)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return True
    try:
        size = os.fstat(fd).st_size
        return size == 0 or os.pread(fd, 1, size - 1) == b"\n"
    except OSError:
        return True
    finally:
        os.close(fd)


def session_hash(key: str) -> str:
    """The session key's place on the hash ring (64-bit murmur3, 16 hex digits): names the
    session without its key, and lets a replay put it where the ring put it."""
    return f"{ring_position(key):016x}"


def _terms(rationale: Rationale) -> dict[str, list[float]] | None:
    """{endpoint: [queue, prefill, step] ms} from the latency scorer's column, if any."""
    for column in rationale.columns:
        if column.term_names[1:4] == ("queue_s", "prefill_s", "step_s") and column.term_rows:
            ids, rows = rationale.endpoint_ids, column.term_rows
            return {e: [r[1] * 1e3, r[2] * 1e3, r[3] * 1e3] for e, r in zip(ids, rows, strict=True)}
    return None


def _fleet(lifecycle: Lifecycle, model: str) -> dict[str, float | None] | None:
    """The model's engine speed as the router calibrated it (`llmgw.calibration`): a replay
    shapes its simulated engines to it, since an engine's nominal settings say little about
    how fast it really ran (the demo's ran 2-4x slower than configured on a busy host)."""
    lease = lifecycle.lease
    if lease is None:
        return None
    return _speed(pooled(s.calibration for s in lease.registry.states(model)))


def _speed(costs: Costs) -> dict[str, float | None]:
    return {
        "prefill_us_per_token": _us(costs.per_token),
        "step_ms": None if costs.step is None else costs.step * 1e3,
        "tokens_per_prefill": costs.tokens_per_prefill,
        "service_ms": None if costs.service is None else costs.service * 1e3,
    }


def _costs(costs: Costs) -> dict[str, float | None]:
    """Every field of the costs a pick used, so a replay prices it as the recorded one did:
    without the first tokens' slope and the net cost, a sessionless prompt is priced at the
    engines' ratio (3-15x a token's cost on cache-hit traffic: `llmgw.calibration`)."""
    return {
        **_speed(costs),
        "engine_tokens": costs.engine_tokens,
        "observed_us_per_token": _us(costs.observed),
        "marginal_us_per_token": _us(costs.marginal),
    }


def _us(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e6


# Seconds: an endpoint's last token older than this says nothing of its step's phase.
_TOKEN_WINDOW = 5.0
_FLEET_EVERY = 0.1  # seconds: the speed moves slowly; pooling it per request cost ~5 us


def engine_view(
    lifecycle: Lifecycle, cache: dict[str, tuple[Any, Any]] | None = None
) -> dict[str, Any] | None:
    """What the pick saw of the engines, beyond the router's own state: per endpoint
    [waiting, running, KV usage, requests released since its last scrape, most running
    ever scraped] (null when its metrics were stale; `batches` names those where that peak
    is known to be the batch size), and where the engine's first-token count closes this
    router's prefills (an edge without first tokens) two more: the prefill tokens left
    open and the seconds since that scrape (the latency queue's inputs); the seconds since
    the edge last saw a token from each endpoint (`tokens`: the step's phase, those within
    `_TOKEN_WINDOW`; null where the pick did not read it, so a replay reads it exactly
    where the recorded router did); and the model's calibrated speed (`_fleet`). A replay
    corrects its simulated engines by the difference (`llmgw replay --mirror`)."""
    lease, request = lifecycle.lease, lifecycle.request
    if lease is None or request is None:
        return None
    registry = lease.registry
    states = registry.states(request.model)
    # Unix seconds at the pick: the router's clock between picks drains its queue model, so
    # a replay spaces picks by these, not by arrivals (parsing a body takes its own time).
    now = registry.clock()
    fresh = fresh_metrics_of(states, now, registry.staleness)
    decision = lifecycle.decision
    picked = decision.at if decision is not None and decision.at is not None else now
    engines: dict[str, list[float] | None] = {}
    batches: list[str] = []  # where the peak is known to be the batch (`peak_is_batch`)
    for s in states:
        m = fresh[s]
        view = (
            None
            if m is None
            else [
                m.waiting,
                m.running,
                round(m.kv_usage, 4),
                s.released_since_scrape,
                s.peak_running,  # running >= its peak switches the queue estimate
            ]
        )
        if view is not None and s.counts_first_tokens and not s.reports_first_token:
            pending = s.counted_prefill  # as the pick saw it: before this request's own
            if s.id == lease.endpoint_id and lease.prefill is not None and lease.prefill.open:
                pending = max(0.0, pending - lease.prefill.tokens)
            view += [round(pending, 1), round(now - s.scraped_at, 4)]
        engines[s.id] = view
        if view is not None and s.peak_is_batch:
            batches.append(s.id)
    kept = cache.get(request.model) if cache is not None else None
    if kept is not None and now - kept[0] < _FLEET_EVERY:
        fleet = kept[1]
    else:
        fleet = _fleet(lifecycle, request.model)
        if cache is not None:
            cache[request.model] = (now, fleet)
    used = None
    slowdowns: dict[str, float] | None = None
    tokens: dict[str, float] | None = None  # None: the pick did not read the step's phase
    router = lifecycle.snapshot.scheduler.routers.get(request.model)
    for scorer, _ in router.scorers if router is not None else ():
        if isinstance(scorer, LatencyScorer):  # the costs this pick used (cached 0.1 s)
            slowdowns = {e: round(x, 3) for e, x in scorer.speeds_in_use.items()}
            if scorer.step_phase:
                tokens = _phases(states, picked)
            costs, slot = scorer.costs_in_use, f"costs:{request.model}"
            seen = cache.get(slot) if cache is not None else None
            if seen is not None and seen[0] is costs:  # one dict per refresh, not per line
                used = seen[1]
            else:
                used = _costs(costs)
                if cache is not None:
                    cache[slot] = (costs, used)
    wall = time.time()
    return {
        "at": wall - (registry.clock() - picked),  # the pick's own clock, in Unix seconds
        "engines": engines,
        "batches": batches,
        "tokens": tokens,
        "fleet": fleet,
        "costs": used,
        "slowdowns": slowdowns,
    }


def _phases(states: Sequence[EndpointState], picked: float) -> dict[str, float]:
    """Seconds since the edge last relayed a token from each endpoint, within
    `_TOKEN_WINDOW` of the pick."""
    phases: dict[str, float] = {}
    for s in states:
        age = picked - s.token_at
        if age < _TOKEN_WINDOW:
            phases[s.id] = round(age, 6)  # µs: at 0.1 ms a replay flipped a 0.003 ms margin
    return phases


def trace_record(
    lifecycle: Lifecycle, outcome: Outcome, edge: str, view: dict[str, Any] | None = None
) -> dict[str, Any] | None:
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
        "t_pick": None if view is None else view["at"],  # unrounded: picks µs apart
        # The router's own clock (seconds, one process) at the pick, the first token and
        # the end: a replay orders these against picks exactly; wall-clock anchors jitter.
        "clock": _clock(lifecycle),
        "edge": edge,
        "model": request.model,
        "session": session_hash(request.session_key) if request.session_key else None,
        # Without a session the request id is the ring key: its place, not the id.
        "rid": None if request.session_key else session_hash(request.request_id),
        "prompt_tokens": request.prompt_tokens,
        # Keyed as the engines and the latency scorer's index key them: salted blocks by
        # their salt (unsalted, two tenants' prompts shared blocks here, and a replay sent
        # one to the other's replica; the trace also linked what the salt keeps apart).
        "blocks": _blocks.hashes(request.cache_text) if request.prompt else [],
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
            # The latency model's inputs per endpoint (ms): what a replay must reproduce.
            "prefill_tokens": decision.prefill_tokens,
            "terms": _terms(rationale),
        },
        # At the pick when the writer saw it (the `dispatched` hook), else at the end.
        "fleet": view["fleet"] if view is not None else _fleet(lifecycle, request.model),
        "engines": None if view is None else view["engines"],
        "batches": None if view is None else view["batches"],
        "costs": None if view is None else view["costs"],
        # The latency scorer's per-endpoint slowdowns at the pick (slower ones only).
        "slowdowns": None if view is None else view["slowdowns"],
        # Seconds since the edge last relayed a token from each endpoint (the step phase).
        "tokens": None if view is None else view["tokens"],
        "outcome": {
            "endpoint": answered,
            "status": lifecycle.status,
            "outcome": outcome.value,
            "attempts": lifecycle.attempts,
            "ttft_ms": None if lifecycle.ttft is None else lifecycle.ttft * 1e3,
            "duration_ms": (ended - lifecycle.started) * 1e3,
        },
    }


def _clock(lifecycle: Lifecycle) -> dict[str, float | None] | None:
    lease, decision = lifecycle.lease, lifecycle.decision
    if lease is None or decision is None or decision.at is None:
        return None
    first = lease.first_at if lifecycle.ttft is not None else None  # seen, not inferred
    return {"pick": decision.at, "first": first, "end": lease.ended_at}


class RotatingFile:
    """Appends lines to `path`, rotating to path.1 .. path.<backups> before it would pass
    `max_bytes`. Hand-written over logging's RotatingFileHandler, which cost ~20 µs a line
    here (a LogRecord, a lock, formatting twice, a flush syscall) against ~3 µs: writes are
    buffered and flushed within a second (a timer on the running loop, so an idle server
    does not hold its last lines), at rotation and at close."""

    FLUSH_EVERY = 1.0  # seconds: what a crash may lose
    BUFFER = 1 << 16  # bytes buffered; flushed here before the file object would flush

    def __init__(self, path: str | Path, max_bytes: int, backups: int) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self._file: BinaryIO | None = None
        self._size = 0
        self._flushed = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        # The lines (and bytes) in the buffer: a failed close loses them (`dropped`).
        self._pending = 0
        self._buffered = 0
        self.dropped = 0  # lines `write` accepted that a failed close lost (a full disk)

    def write(self, line: bytes) -> None:
        """Appends `line` (buffered), or raises OSError and the line is not written."""
        file = self._file
        if file is None:
            file = self._file = self._open()
        if self._size and self._size + len(line) > self.max_bytes:
            self._rotate()
            file = self._file
            assert file is not None
        if self._buffered + len(line) > self.BUFFER:
            self.flush()  # here, not within file.write: a failure leaves the line out
        file.write(line)
        self._size += len(line)
        if len(line) <= self.BUFFER:  # a longer one went straight to the file
            self._pending += 1
            self._buffered += len(line)
        now = time.monotonic()
        if now - self._flushed >= self.FLUSH_EVERY:
            self._flushed = now
            with contextlib.suppress(OSError):  # the line is buffered: a later flush retries
                self.flush()
        elif self._timer is None:
            self._timer = _flush_later(self.FLUSH_EVERY, self._timed_flush)

    def _open(self) -> BinaryIO:
        file = open(self.path, "ab", buffering=self.BUFFER)  # noqa: SIM115
        self._size = file.tell()
        self._pending = self._buffered = 0
        if self._size and not _ends_a_line(self.path):
            # A full disk cut the last line (a short write, then ENOSPC): end it, or the
            # next line is glued on and the reader refuses the whole file.
            file.write(b"\n")
            file.flush()
            self._size += 1
        return file

    def _timed_flush(self) -> None:
        self._timer = None
        self._flushed = time.monotonic()
        with contextlib.suppress(OSError):  # the next write meets it again, and counts it
            self.flush()

    def _rotate(self) -> None:
        self.close()
        for i in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._file = self._open()

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
            self._pending = self._buffered = 0

    def close(self) -> None:
        """Flushes and closes; on an error (a full disk) the buffered lines are lost (counted
        in `dropped`) and the file is closed all the same: the next write reopens it."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        file, self._file = self._file, None
        if file is None:
            return
        try:
            file.close()
        except BaseException:
            self.dropped += self._pending
            raise
        finally:
            self._pending = self._buffered = 0


def _flush_later(delay: float, flush: Callable[[], None]) -> asyncio.TimerHandle | None:
    """A flush `delay` seconds from now on the running loop (None outside one: the next
    write or close flushes)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return loop.call_later(delay, flush)


_UNSAMPLED = object()
log = logging.getLogger("llmgw.trace")
WARN_EVERY = 60.0  # seconds between warnings that trace lines are being lost


class TraceWriter:
    """Writes sampled trace lines to a size-rotated file. Call it as a lifecycle
    `finished` hook (see `traced`)."""

    def __init__(self, spec: TraceSpec, edge: str, *, rng: random.Random | None = None) -> None:
        if spec.path is None:
            raise ValueError("trace.path is not set")
        self.sample = spec.sample
        self.edge = edge
        self.written = 0
        self.lost = 0  # lines a write error lost (a missing directory, a full disk)
        self._dropped = 0  # the file's `dropped` already counted in `lost`
        self._warned = float("-inf")
        self._random = (rng or random.Random()).random
        # Views taken at dispatch, by lifecycle, until it ends (only sampled requests).
        self._views: dict[int, Any] = {}
        self._hooked = False  # `dispatched` is wired: sampling happens there
        self._fleets: dict[str, tuple[Any, Any]] = {}  # per model: (when, speed), (costs, dict)
        # `{pid}` in the path: one file per process (`--workers N` must not share one).
        path = spec.path.replace("{pid}", str(os.getpid()))
        self._file = RotatingFile(path, spec.max_bytes, spec.backups)

    def dispatched(self, lifecycle: Lifecycle) -> None:
        """Samples the request and keeps what its pick saw until it ends."""
        self._hooked = True
        if self.sample < 1.0 and self._random() >= self.sample:
            return
        self._views[id(lifecycle)] = engine_view(lifecycle, self._fleets)

    def __call__(self, lifecycle: Lifecycle, outcome: Outcome) -> None:
        view = self._views.pop(id(lifecycle), _UNSAMPLED)
        if view is _UNSAMPLED:
            if self._hooked or (self.sample < 1.0 and self._random() >= self.sample):
                return
            view = None
        record = trace_record(lifecycle, outcome, self.edge, view)
        if record is None:
            return
        try:
            self._file.write(orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE))
        except (OSError, ValueError) as exc:
            # The request has been served: losing its line must not fail its answer.
            self._lose(1, exc)
            return
        self.written += 1

    def _lose(self, lines: int, exc: BaseException) -> None:
        """Counts `lines` lost to `exc`, and the buffered lines a failed close lost (counted
        written when they were buffered); warns at most once a `WARN_EVERY`."""
        dropped = self._file.dropped - self._dropped
        self._dropped += dropped
        self.written -= dropped
        self.lost += lines + dropped
        now = time.monotonic()
        if now - self._warned >= WARN_EVERY:
            self._warned = now
            log.warning("decision trace: %s; %d lines lost so far", exc, self.lost)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        try:
            self._file.close()
        except (OSError, ValueError) as exc:  # a full disk at stop: the buffered lines
            self._lose(0, exc)


def trace_writer(spec: TraceSpec, edge: str) -> TraceWriter | None:
    """A writer when the config asks for a trace, else None."""
    return TraceWriter(spec, edge) if spec.path is not None else None


def trace_problem(spec: TraceSpec, workers: int) -> str | None:
    """Why this trace cannot be written (checked at start), or None: `workers` processes
    would rotate one file, or its directory is missing or not writable."""
    if spec.path is None:
        return None
    if workers > 1 and "{pid}" not in spec.path:
        return (
            f"trace.path: with --workers {workers}, put {{pid}} in the path "
            "(one file per process), e.g. /var/log/llmgw/trace.{pid}.jsonl"
        )
    if Path(spec.path).is_dir():
        return f"trace.path: {spec.path} is a directory; name a file in it"
    folder = Path(spec.path).absolute().parent
    if not folder.is_dir():
        return f"trace.path: the directory {folder} does not exist; create it first"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"trace.path: this process cannot create files in {folder}"
    return None


def traced(hooks: Hooks, spec: TraceSpec) -> Hooks:
    """`hooks` plus the decision trace the config asks for (unchanged when it asks none)."""
    writer = trace_writer(spec, hooks.edge)
    if writer is None:
        return hooks
    return dataclasses.replace(hooks, finished=writer, dispatched=writer.dispatched)


def close_trace(hooks: Hooks) -> None:
    """Close the trace file of hooks made by `traced` (server stop)."""
    if isinstance(hooks.finished, TraceWriter):
        hooks.finished.close()
