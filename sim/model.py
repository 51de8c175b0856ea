"""Continuous-batching engine model (pure: time is passed in, nothing sleeps).

One engine step = admit waiting sequences in FIFO order while there is a free batch slot
and enough KV blocks, prefill the newly admitted ones (only their uncached tokens cost
time), and decode one token for every sequence that was already running. With
`max_num_batched_tokens` set (chunked prefill, as vLLM v1 does), a step computes at most
that many tokens: one per decoding sequence first, then prefill chunks of partly
prefilled sequences, then of newly admitted ones; a long prompt is prefilled over several
steps, and running sequences keep decoding meanwhile. A driver calls
`schedule(now)`, waits the returned duration, then calls `complete(now)`:

    duration = model.schedule(now)
    ...wait duration...
    result = model.complete(now + duration)

Time to first token = queue wait + the step that prefilled it; each later token costs one
decode step whose time grows with the batch size.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from llmgw.sim.kvcache import Allocation, KVCache

FINISH_LENGTH = "length"
FINISH_STOP = "stop"
FINISH_ABORT = "abort"


class QueueFullError(Exception):
    """The waiting queue is at `max_queue`: the engine applies backpressure (HTTP 429)."""


class RequestTooLargeError(Exception):
    """The request needs more KV blocks than the engine has at all (HTTP 400)."""


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits and latencies; latencies are in simulated time, times `time_scale`."""

    max_num_seqs: int = 64
    max_queue: int = 256
    kv_blocks: int = 2048
    block_size: int = 16
    prefill_us_per_token: float = 50.0
    decode_ms: float = 10.0
    # Relative decode slowdown per extra running sequence: 0.02 = +2 % per sequence.
    decode_batch_factor: float = 0.02
    time_scale: float = 1.0
    enable_prefix_caching: bool = True
    max_model_len: int = 8192
    # Token budget per step (chunked prefill); None = every admitted prompt in one step.
    max_num_batched_tokens: int | None = None
    # Record vLLM KV-cache events (`EngineModel.drain_kv_events`); requests then need
    # `SeqRequest.token_ids`.
    kv_events: bool = False
    # KV blocks as vLLM v1 takes them (KVCacheManager.allocate_slots): a request is admitted
    # with its prompt's blocks, takes one more as its output fills one, and when none is
    # free the newest running request is preempted (its blocks freed, computed again from
    # the queue's head). False: prompt + max_tokens reserved at admission, never preempted
    # (the benchmarks' engine so far; `bench/fleetsim_robust.py --variants kv-on-demand`).
    kv_on_demand: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "kv_blocks", "block_size", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        budget = self.max_num_batched_tokens
        # vLLM's rule too: every running sequence must be able to decode in one step.
        if budget is not None and budget < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        for name in (
            "max_queue",
            "prefill_us_per_token",
            "decode_ms",
            "decode_batch_factor",
            "time_scale",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


@dataclass(frozen=True)
class SeqRequest:
    """What the engine needs to know about a request: sizes and prompt block hashes."""

    prompt_tokens: int
    max_tokens: int
    block_hashes: tuple[bytes, ...] = ()
    # True when the client set no max_tokens: the output ends on "EOS", reason "stop".
    natural_stop: bool = False
    # The prompt's token ids (`tokens.token_ids`), only needed for KV events.
    token_ids: tuple[int, ...] = ()


@dataclass(eq=False)
class Sequence:
    """One request's life in the engine; timestamps are filled in as it progresses."""

    seq_id: int
    request: SeqRequest
    arrival_time: float
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    allocation: Allocation | None = field(default=None, repr=False)
    # Prompt tokens still to compute (set at admission; chunked prefill takes several steps).
    prefill_remaining: int = 0
    last_token_time: float | None = None
    # Gaps between consecutive tokens, for the inter-token latency histogram.
    token_intervals: list[float] = field(default_factory=list, repr=False)

    @property
    def prefilling(self) -> bool:
        return self.scheduled_time is not None and self.prefill_remaining > 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class StepResult:
    """What one step produced: sequences that got a token, and those that finished."""

    emitted: list[Sequence]
    finished: list[Sequence]


@dataclass
class EngineStats:
    """Cumulative counters, in the units vLLM uses (prefix cache in tokens)."""

    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    rejected: int = 0
    preemptions: int = 0


class EngineModel:
    """The scheduler and KV cache of one engine serving one model."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.kv = KVCache(
            config.kv_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            publish_events=config.kv_events,
            block_size=config.block_size,
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = EngineStats()
        self.slowdown = 1.0
        self._ids = itertools.count()
        self._in_step: list[Sequence] = []
        self._step_open = False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def in_step(self) -> bool:
        """A step was scheduled and has not completed yet."""
        return self._step_open

    def blocks_needed(self, request: SeqRequest) -> int:
        total_tokens = request.prompt_tokens + request.max_tokens
        return -(-total_tokens // self.config.block_size)

    def submit(self, request: SeqRequest, now: float) -> Sequence:
        """Queue a request; raises QueueFullError or RequestTooLargeError."""
        if request.prompt_tokens + request.max_tokens > self.config.max_model_len:
            raise RequestTooLargeError(
                f"This model's maximum context length is {self.config.max_model_len} tokens. "
                f"However, you requested {request.prompt_tokens + request.max_tokens} tokens "
                f"({request.prompt_tokens} in the messages, {request.max_tokens} in the "
                "completion)."
            )
        if self.blocks_needed(request) > self.config.kv_blocks:
            raise RequestTooLargeError(
                f"The request needs {self.blocks_needed(request)} KV blocks but the engine "
                f"has {self.config.kv_blocks}."
            )
        if len(self.waiting) >= self.config.max_queue:
            self.stats.rejected += 1
            raise QueueFullError(f"The waiting queue is full ({self.config.max_queue} requests).")
        seq = Sequence(seq_id=next(self._ids), request=request, arrival_time=now)
        self.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence, now: float) -> None:
        """Drop a sequence (client went away); its blocks are released at once. As on vLLM,
        it is not counted as finished (vLLM drops an aborted request's stats)."""
        if seq.finished:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
        self._finish(seq, FINISH_ABORT, now)

    def schedule(self, now: float) -> float:
        """Start a step at `now`: admit what fits, return the step's duration in seconds."""
        if self._step_open:
            raise RuntimeError("complete() the previous step first")
        self._step_open = True
        config = self.config
        budget = config.max_num_batched_tokens
        if config.kv_on_demand:
            self._grow_or_preempt()
        emitting = [seq for seq in self.running if seq.prefill_remaining == 0]
        decoding = len(emitting)
        if budget is not None:
            budget -= decoding
        prefill_tokens = 0
        # Partly prefilled sequences continue first, in admission order (chunked prefill).
        for seq in self.running:
            if seq.prefill_remaining == 0 or (budget is not None and budget <= 0):
                continue
            chunk = self._take_chunk(seq, budget)
            prefill_tokens += chunk
            if budget is not None:
                budget -= chunk
            if seq.prefill_remaining == 0:
                emitting.append(seq)
        # FIFO: the head of the queue blocks everyone behind it, as in vLLM.
        while (
            self.waiting
            and len(self.running) < config.max_num_seqs
            and (budget is None or budget > 0)
        ):
            seq = self.waiting[0]
            request = seq.request
            needed = self.blocks_needed(request)
            if config.kv_on_demand:  # the prompt (and what it had generated, if preempted)
                needed = max(
                    1, -(-(request.prompt_tokens + seq.output_tokens) // config.block_size)
                )
            # vLLM (KVCacheManager.get_computed_blocks): the last prompt token is always
            # computed, for its logits, and a hit is whole blocks: a prompt of exactly n
            # cached blocks hits n - 1 of them and computes the last one again.
            hits = max(request.prompt_tokens - 1, 0) // config.block_size
            if not self.kv.can_allocate(request.block_hashes, needed, hits):
                break
            self.waiting.popleft()
            seq.allocation = self.kv.allocate(
                request.block_hashes, needed, request.token_ids, max_hits=hits
            )
            seq.cached_tokens = seq.allocation.cached_blocks * config.block_size
            seq.scheduled_time = now
            # (A preempted request computes its output so far again, too.)
            seq.prefill_remaining = request.prompt_tokens + seq.output_tokens - seq.cached_tokens
            self.stats.prefix_queries_tokens += request.prompt_tokens
            self.stats.prefix_hits_tokens += seq.cached_tokens
            self.running.append(seq)
            chunk = self._take_chunk(seq, budget)
            prefill_tokens += chunk
            if budget is not None:
                budget -= chunk
            if seq.prefill_remaining == 0:
                emitting.append(seq)
        self._in_step = emitting
        seconds = prefill_tokens * config.prefill_us_per_token / 1e6
        if decoding:
            batch = len(self.running)
            seconds += config.decode_ms / 1e3 * (1 + config.decode_batch_factor * (batch - 1))
        return seconds * config.time_scale * self.slowdown

    def _grow_or_preempt(self) -> None:
        """Each decoding sequence whose blocks are full takes one more for this step's
        token; with none free, the newest running sequence is preempted (vLLM v1's
        `schedule`: `self.running.pop()`), possibly the one asking."""
        size = self.config.block_size
        for seq in list(self.running):
            if seq not in self.running or seq.prefill_remaining or seq.allocation is None:
                continue
            while (seq.request.prompt_tokens + seq.output_tokens + 1) > len(
                seq.allocation.block_ids
            ) * size and not self.kv.grow(seq.allocation):
                victim = self.running.pop()
                self._preempt(victim)
                if victim is seq:
                    break

    def _preempt(self, seq: Sequence) -> None:
        if seq.allocation is not None:
            self.kv.free(seq.allocation)
            seq.allocation = None
        seq.prefill_remaining = 0
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    @staticmethod
    def _take_chunk(seq: Sequence, budget: int | None) -> int:
        chunk = seq.prefill_remaining if budget is None else min(seq.prefill_remaining, budget)
        seq.prefill_remaining -= chunk
        return chunk

    def complete(self, now: float) -> StepResult:
        """End the step at `now`: every sequence in it gets one token; some finish."""
        if not self._step_open:
            raise RuntimeError("schedule() a step first")
        self._step_open = False
        emitted: list[Sequence] = []
        finished: list[Sequence] = []
        for seq in self._in_step:
            if seq.finished:
                continue  # aborted during the step
            if seq.first_token_time is None:
                seq.first_token_time = now
                # vLLM counts the prompt with its first token (the prefix-cache query was
                # counted when the sequence was admitted).
                self.stats.prompt_tokens += seq.request.prompt_tokens
            elif seq.last_token_time is not None:
                seq.token_intervals.append(now - seq.last_token_time)
            seq.last_token_time = now
            seq.output_tokens += 1
            self.stats.generation_tokens += 1
            emitted.append(seq)
            if seq.output_tokens >= seq.request.max_tokens:
                reason = FINISH_STOP if seq.request.natural_stop else FINISH_LENGTH
                self.running.remove(seq)
                self._finish(seq, reason, now)
                self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
                finished.append(seq)
        self._in_step = []
        return StepResult(emitted=emitted, finished=finished)

    def reset_prefix_cache(self) -> None:
        self.kv.clear_cache()

    def drain_kv_events(self) -> list[dict[str, Any]]:
        """KV-cache events since the last call, as vLLM's tagged maps (oldest first)."""
        return self.kv.drain_events()

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        seq.finish_reason = reason
        seq.finished_time = now
        if seq.allocation is not None:
            self.kv.free(seq.allocation)
            seq.allocation = None
