"""Scorers: each rates every candidate in [0, 1]; the strategy weighs and sums them."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from itertools import repeat
from operator import truediv
from typing import overload

from llmgw.calibration import Calibration, Costs, DecayedRatio, own_service, pooled, slowdowns
from llmgw.registry import EndpointState
from llmgw.scheduling.interfaces import PickContext
from llmgw.scheduling.prefix import PrefixIndex
from llmgw.tokenize import PromptTokenizer, make_tokenizer
from llmgw.types import CHARS_PER_TOKEN, RequestInfo

# The index's hold on an engine that does not publish its KV size (`_fit_capacity`): refit
# once this many prompt tokens were sent there (and counted there) since the last fit;
# shrink when the engine's share of tokens found cached is below _FIT_LOW x the index's
# predicted share, grow when above _FIT_HIGH x while the index was _FIT_FULL; by at most
# _FIT_STEP a step. With the KV size the two shares agree within 1-6 %.
_FIT_MIN_TOKENS = 16384.0
_FIT_LOW = 0.9
_FIT_HIGH = 0.97
_FIT_FULL = 0.9
_FIT_STEP = 0.75


def relative(values: list[float], smoothing: float) -> list[float]:
    """1 for the least loaded candidate, (min + c) / (x + c) for the others.

    Relative rather than min-max: 3 vs 2 waiting is a small gap, 8 vs 0 a large one.
    """
    if not values:
        return []
    low = min(values) + smoothing
    return [low / (v + smoothing) for v in values]


def _smoothing(value: float) -> float:
    # 0 would divide 0 by 0 on idle endpoints; below 0 scores leave [0, 1].
    if not value > 0:
        raise ValueError(f"smoothing must be > 0, got {value!r}")
    return value


class Positions:
    """Endpoint id -> index in a candidate list, so a scorer that touches a few endpoints
    (a ring's three, a session's home) skips the others. Kept while the pick's own endpoint
    list comes back (`ctx.all_states`: the registry's, replaced, never changed in place,
    whenever no filter dropped anything: nearly every pick); any other list is indexed
    afresh, since a plugin could refill one list object between picks."""

    __slots__ = ("_of", "_positions")

    def __init__(self) -> None:
        self._of: list[EndpointState] | None = None
        self._positions: dict[str, int] = {}

    def __call__(self, ctx: PickContext, candidates: list[EndpointState]) -> dict[str, int]:
        if candidates is self._of:
            return self._positions
        positions = {s.id: i for i, s in enumerate(candidates)}
        if candidates is ctx.all_states:
            self._of, self._positions = candidates, positions
        return positions


class QueueScorer:
    """Fewer waiting requests is better (engine metric; local inflight when stale)."""

    name = "queue"

    def __init__(self, smoothing: float = 1.0) -> None:
        self.smoothing = _smoothing(smoothing)

    def score(self, ctx: PickContext, candidates: list[EndpointState]) -> list[float]:
        fresh = ctx.fresh
        queues: list[float] = []
        append = queues.append
        for s in candidates:
            m = fresh[s]
            inflight = s.inflight + s.remote_inflight  # peers' too (`peers:`)
            if m is None:
                append(float(inflight))
                continue
            # Requests sent since the scrape are not in its queue yet: count the excess.
            excess = inflight - m.running
            append(m.waiting if m.waiting >= excess else excess)
        return relative(queues, self.smoothing)


class InflightScorer:
    """Fewer requests in flight from this router (and its `peers:`) is better (no scrape
    lag)."""

    name = "inflight"

    def __init__(self, smoothing: float = 1.0) -> None:
        self.smoothing = _smoothing(smoothing)

    def score(self, ctx: PickContext, candidates: list[EndpointState]) -> list[float]:
        return relative([float(s.inflight + s.remote_inflight) for s in candidates], self.smoothing)


class LoadScorer:
    """Waiting + running from metrics (less what ended here since the scrape), or local
    inflight if larger: the engine's numbers include other routers' load."""

    name = "load"

    def __init__(self, smoothing: float = 2.0) -> None:
        self.smoothing = _smoothing(smoothing)

    def score(self, ctx: PickContext, candidates: list[EndpointState]) -> list[float]:
        fresh = ctx.fresh
        loads: list[float] = []
        append = loads.append
        for s in candidates:
            m = fresh[s]
            inflight = s.inflight + s.remote_inflight
            if m is None:
                append(inflight)
                continue
            # The scrape still counts requests that ended since: take those off.
            engine = m.waiting + m.running - s.released_since_scrape
            append(engine if engine > inflight else inflight)  # max() costs a call per endpoint
        return relative(loads, self.smoothing)


class KvScorer:
    """Free KV cache is better; at or above `ceiling` the score is 0 (hard penalty)."""

    name = "kv"

    def __init__(self, ceiling: float = 0.9) -> None:
        if not 0 < ceiling <= 1:
            raise ValueError(f"ceiling must be in (0, 1], got {ceiling}")
        self.ceiling = ceiling

    def score(self, ctx: PickContext, candidates: list[EndpointState]) -> list[float]:
        fresh = ctx.fresh
        ceiling = self.ceiling
        out: list[float] = []
        append = out.append
        for s in candidates:
            m = fresh[s]
            if m is None:
                append(0.5)  # unknown: neither reward nor punish
                continue
            usage = m.kv_usage
            append(0.0 if usage >= ceiling else 1.0 - usage)
        return out


class WeightScorer:
    """Configured endpoint weight, relative to the heaviest candidate."""

    name = "weight"

    def score(self, ctx: PickContext, candidates: list[EndpointState]) -> list[float]:
        top = max((s.endpoint.weight for s in candidates), default=1.0)
        return [s.endpoint.weight / top for s in candidates]


class SessionScorer:
    """Ray Serve ring affinity: 1 for the primary, then 1 - i/(k+1) for fallback i.

    With `bounded_load` (from the model's session settings, or a param) the ring skips
    replicas holding more than ceil(c * mean) of the inflight requests.

    A request without a session is hashed by its request id (Ray Serve's uniform spread)
    unless `abstain_without_session`: then every candidate scores 0, so the other scorers
    decide alone instead of against a random preference.
    """

    name = "session"

    def __init__(self, bounded_load: float = 0.0, abstain_without_session: bool = False) -> None:
        if bounded_load != 0 and not bounded_load >= 1.0:
            raise ValueError(f"bounded_load must be 0 (off) or >= 1.0, got {bounded_load!r}")
        self.bounded_load = bounded_load
        self.abstain_without_session = abstain_without_session
        self._positions = Positions()

    def score(self, ctx: PickContext, candidates: list[EndpointState]) -> list[float]:
        request = ctx.request
        key = request.session_key
        if key is None:
            if self.abstain_without_session:
                return [0.0] * len(candidates)
            key = request.request_id  # (`routing_key`, without the property's call)
        c = self.bounded_load or ctx.spec.session.bounded_load or 0.0
        ring = ctx.ring
        positions = self._positions(ctx, candidates)
        position = positions.get
        # Replicas of the ring that are not candidates (filtered, outside a subset hint)
        # hand their keys on clockwise, as Ray Serve's ring rebuilt without them would.
        among = positions if len(candidates) < len(ring) else None
        ring_order: Sequence[str]
        if c >= 1.0:
            loads = {s.id: s.inflight + s.remote_inflight for s in ctx.all_states}
            ring_order = ring.bounded_candidates(key, loads, c, among)
        else:
            ring_order = ring.candidate_tuple(key)
            if among is not None and not all(rid in among for rid in ring_order):
                ring_order = ring.candidates_among(key, among)
        out = [0.0] * len(candidates)
        if ring_order:
            step = 1.0 / (len(ring_order) + 1)
            for i, rid in enumerate(ring_order):
                j = position(rid)
                if j is not None:
                    out[j] = 1.0 - i * step
        return out


class PrefixScorer:
    """Share of the prompt's leading blocks that the endpoint probably has cached."""

    name = "prefix"
    needs_prompt = True

    def __init__(
        self, block_chars: int = 256, max_blocks: int = 128, capacity: int = 16384
    ) -> None:
        self.index = PrefixIndex(block_chars=block_chars, max_blocks=max_blocks, capacity=capacity)
        self._last: tuple[RequestInfo | None, list[int]] = (None, [])

    def _hashes(self, ctx: PickContext) -> list[int]:
        # Keyed by the request object: request ids may come from clients and repeat.
        request = ctx.request
        if self._last[0] is not request:
            # As the latency scorer keys them: behind the salt, none when vLLM skips the cache.
            hashes = self.index.hashes(request.cache_text) if request.reads_cache else []
            self._last = (request, hashes)
        return self._last[1]

    def score(self, ctx: PickContext, candidates: list[EndpointState]) -> list[float]:
        hashes = self._hashes(ctx)
        if not hashes:
            return [0.0] * len(candidates)
        matched = self.index.match(hashes)
        total = len(hashes)
        return [matched.get(s.id, 0) / total for s in candidates]

    def observe(self, ctx: PickContext, chosen: EndpointState) -> None:
        hashes = self._hashes(ctx)
        if hashes:
            self.index.insert(chosen.id, hashes)

    def forget(self, endpoint_id: str) -> None:
        """The endpoint left the pool: drop what the index remembers about it."""
        self.index.forget(endpoint_id)


def slower_endpoints(states: Sequence[EndpointState], band: float) -> dict[str, float]:
    """Endpoints at least `band` x slower than the model's fastest (`slowdowns`): id -> the
    multiple."""
    found = slowdowns((s.id, s.calibration) for s in states)
    return {eid: slow for eid, slow in found.items() if slow >= band}


def softmax_weights(scores: list[float], temperature: float) -> list[float]:
    top = max(scores)
    return [math.exp((s - top) / temperature) for s in scores]


Row = tuple[float, float, float, float, float, float]


class TermRows(Sequence[Row]):
    """The latency scorer's (ttft, queue, prefill, step) seconds, cached tokens and exact
    (1: from KV events) per candidate, as rows built when read: most Decisions are never
    explained, and a tuple per endpoint per pick was ~8 % of the scorer's time at 256."""

    __slots__ = ("_exact", "_prefill", "_queue", "_step", "_tokens", "_uncached")

    def __init__(
        self,
        queue: list[float],
        prefill: list[float],
        step: list[float],
        uncached: list[int],
        tokens: int,
        exact: list[float] | None,  # None: no endpoint exact
    ) -> None:
        self._queue, self._prefill, self._step = queue, prefill, step
        self._uncached, self._tokens, self._exact = uncached, tokens, exact

    def __len__(self) -> int:
        return len(self._queue)

    @overload
    def __getitem__(self, i: int) -> Row: ...

    @overload
    def __getitem__(self, i: slice) -> list[Row]: ...

    def __getitem__(self, i: int | slice) -> Row | list[Row]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        queue, prefill, step = self._queue[i], self._prefill[i], self._step[i]
        exact = 0.0 if self._exact is None else self._exact[i]
        cached = float(self._tokens - self._uncached[i])
        return (queue + prefill + step, queue, prefill, step, cached, exact)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # mutable lists inside, like a list


_HUGE = 1e18  # seconds: past any real prediction; NaN and inf costs are priced at it
_MAX_INDEX_BLOCKS = 1e12  # an index capacity past this is no engine's KV cache
# Sessions whose prompts run past the index's hashed prefix, remembered with the tokens each
# last sent to each endpoint (the least recently seen forgotten first).
_MAX_LONG_SESSIONS = 65536


class LatencyScorer:
    """Predicted time to first token on each endpoint, in seconds; the fastest scores 1.

    ttft = queue + prefill + step, where
      queue   = the prefill work this router already sent there that the engine has not
                done (a fluid model: each pick adds its uncached tokens x seconds per token,
                time drains it, an early first token cuts it), or the engine's own waiting
                count x the prefill of a typical request, or the requests beyond the
                batch's slots (this router's count too) x the time one slot takes to free,
                or, where the prompts ahead and this one need more KV memory than the
                engine has free, the running requests that must end first x the time one
                takes, whichever is longest;
      prefill = (prompt tokens - tokens probably cached there) x seconds per prefill token;
      step    = one engine step at that endpoint's batch size (waiting + running), plus,
                on a busy engine whose engines publish their step, what is left of the
                step in progress: this request starts with the next one. Where the edge
                relays streams' tokens (the proxy, Envoy with response bodies), the last
                token from that engine ended the previous step: a step's length less the
                time since; else half a step.
    Seconds per token and per step come from the model's engines' published histograms
    and counters, pooled over its endpoints (`llmgw.calibration`), else from the params;
    an endpoint whose engine runs `speed_band` x slower or more than the fastest (by its
    step and its prefill seconds per token, `slower_endpoints`) takes that multiple of
    them, and its own time in batch for slot and memory waits (0 turns this off).
    Tokens cached: with a `tokenizer` (`sim` or a tokenizer.json) and an endpoint whose
    engine publishes KV-cache events (`ctx.kv` live there), exactly what the engine holds
    for this prompt's tokens; elsewhere the approximate index (blocks routed there). The
    `exact` term says which (1 or 0), `cached_tokens` how many.
    Leaving a replica costs the prefill of every uncached token; moving buys less queueing:
    both are time, so the comparison holds at any load. The choice minimises
    ttft + work_weight x prefill: a prefill is also work that delays later requests there,
    and a move duplicates a history's cache.
    """

    name = "latency"
    needs_prompt = True
    term_names = ("ttft_s", "queue_s", "prefill_s", "step_s", "cached_tokens", "exact")

    def __init__(
        self,
        prefill_us_per_token: float = 100.0,
        step_ms: float = 20.0,
        batch_factor: float = 0.02,
        work_weight: float = 1.0,
        block_tokens: int = 64,
        max_blocks: int = 256,
        capacity: int = 16384,
        calibrate: bool = True,
        smoothing_ms: float = 1.0,
        shared_sessions: int = 3,
        queue_weighting: bool = True,
        kv_full: float = 0.9,
        tokenizer: str = "",
        kv_sized: bool = True,
        speed_band: float = 1.5,
        step_phase: bool = True,
    ) -> None:
        # Built at config load: a missing optional package or file fails there, with a message.
        self.tokenizer: PromptTokenizer | None = make_tokenizer(tokenizer) if tokenizer else None
        self._tokens: tuple[int, ...] | None = None
        self._block: float = float(block_tokens)  # the last pick's index block, in its tokens
        if shared_sessions < 1:
            raise ValueError(f"shared_sessions must be >= 1, got {shared_sessions!r}")
        self.queue_weighting = queue_weighting
        if not 0 < kv_full <= 1:
            raise ValueError(f"kv_full must be in (0, 1], got {kv_full!r}")
        self.kv_full = kv_full
        if speed_band != 0 and speed_band < 1:
            raise ValueError(f"speed_band must be 0 (off) or >= 1, got {speed_band!r}")
        self.speed_band = speed_band
        # Read the step in progress where the engines publish their step (False: never,
        # e.g. behind a hop that batches the streams' chunks, so a chunk's arrival is not
        # its step's end).
        self.read_phase = step_phase
        # Endpoint id -> how many times slower than the model's fastest endpoint (only
        # those at or past `speed_band`), refreshed with the costs.
        self._speeds: dict[str, float] = {}
        self._mean_queue = 0.0  # mean queue over the last pick's candidates (seconds)
        # Uncached tokens per pick as predicted here (~50 picks of memory): the typical
        # prefill where engines publish no counters to calibrate it from.
        self._own_typical = DecayedRatio(decay=0.98)
        for name, value in (
            ("prefill_us_per_token", prefill_us_per_token),
            ("step_ms", step_ms),
            ("smoothing_ms", smoothing_ms),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        for name, value in (("batch_factor", batch_factor), ("work_weight", work_weight)):
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens!r}")
        self.prefill_s = prefill_us_per_token / 1e6
        self.step_s = step_ms / 1e3
        self.batch_factor = batch_factor
        self.work_weight = work_weight
        self.block_tokens = block_tokens
        self.calibrate = calibrate
        # The approximate index holds at most each engine's published KV cache (its
        # `cache_config_info`) per endpoint; False keeps `capacity` blocks everywhere.
        self.kv_sized = kv_sized
        # Costs to answer instead of the calibration's (`llmgw replay --mirror` sets the
        # recorded pick's); the calibration still runs for its side effects.
        self.costs_override: Costs | None = None
        # Likewise the endpoints' slowdowns (`slower_endpoints`) the recorded pick used,
        # and whether it read the step in progress (`step_phase`).
        self.speeds_override: dict[str, float] | None = None
        self.phase_override: bool | None = None
        self.smoothing = smoothing_ms / 1e3
        self.index = PrefixIndex(
            block_chars=int(block_tokens * CHARS_PER_TOKEN),
            max_blocks=max_blocks,
            capacity=capacity,
            shared_at=shared_sessions,
        )
        self._request: RequestInfo | None = None
        self._hashes: list[int] = []
        # The last pick's leading-digest tokens (`RequestInfo.lead_tokens`) in its block
        # unit, and whether its prompt ran past the hashed prefix.
        self._lead = 0
        self._long = False
        # Session -> endpoint -> the prompt tokens it last sent there, for prompts longer
        # than the hashed prefix: what is past that prefix is known only by its session.
        self._long_sessions: OrderedDict[str, dict[str, int]] = OrderedDict()
        self._costs_at = float("-inf")
        self._costs = Costs(self.prefill_s, self.step_s, None, None)
        # Whether the engines publish their step (the step's phase needs its length).
        self._step_measured = False
        self._candidates: list[EndpointState] = []
        self._uncached: list[int] = []
        self._prompt_tokens = 0
        # The last score call's queue, prefill and step seconds per candidate.
        self._rows: tuple[list[float], list[float], list[float]] = ([], [], [])
        self._terms = TermRows([], [], [], [], 0, None)
        self._positions = Positions()

    def _exact_hits(self, ctx: PickContext, candidates: list[EndpointState]) -> dict[str, int]:
        """Cached tokens per endpoint whose engine's events are live; tokenizes only then."""
        kv = ctx.kv
        request = ctx.request
        if (
            self.tokenizer is None
            or kv is None
            or not kv.any_live()
            or not request.reads_cache
            or request.cache_salt is not None  # salted blocks: the approximate index keys them
        ):
            self._tokens = None
            return {}
        tokens = self.tokenizer.tokens(request.raw_prompt, request.session_key)
        self._tokens = tokens
        if not tokens:
            return {}
        return kv.match(tokens, [s.id for s in candidates], request.model)

    def costs(self, ctx: PickContext) -> Costs:
        """The model's costs: its endpoints' calibration (`pooled`, refreshed at most every
        0.1 s) where they publish it, else the params."""
        if ctx.now - self._costs_at < 0.1:
            return self.costs_override or self._costs
        measured = pooled([s.calibration for s in ctx.all_states]) if self.calibrate else None
        if measured is None:
            costs = Costs(self.prefill_s, self.step_s, None, None)
            self._step_measured = False
        else:
            self._step_measured = measured.step is not None
            # The engine's cache in this router's index blocks (its tokens may count
            # differently from this router's).
            block = self.block_tokens * measured.engine_tokens
            for s in ctx.all_states:
                s.calibration.batch_factor = self.batch_factor  # its steps scale back by it
                if s.calibration.prefix_caching is False:
                    # It computes every prompt whole: nothing held there counts (credited
                    # its history, a session stayed on a queued home that reused none).
                    self.index.set_capacity(s.id, 0)
                    continue
                kv = s.calibration.kv_tokens
                if not self.kv_sized:
                    continue
                if kv is not None:
                    blocks = kv / block
                    # (A non-finite size, from engines that publish absurd ones, raised
                    # here on every pick of the model.)
                    if 0 <= blocks < _MAX_INDEX_BLOCKS:  # False for NaN too
                        self.index.set_capacity(s.id, int(blocks))
                else:
                    self._fit_capacity(s.id, s.calibration)
            # The params fill in what the engines do not publish; every other field as pooled.
            costs = measured._replace(
                per_token=measured.per_token or self.prefill_s,
                step=measured.step or self.step_s,
            )
            if self.speed_band:
                self._speeds = slower_endpoints(ctx.all_states, self.speed_band)
        self._costs_at, self._costs = ctx.now, costs
        return self.costs_override or costs

    def _fit_capacity(self, endpoint_id: str, cal: Calibration) -> None:
        """An engine that does not publish its KV size: hold as much of its traffic in the
        index as its prefix-cache hit counter says it still has. Where the engine found a
        smaller share of its prompt tokens cached than the index predicted for the prompts
        sent there, the index holds blocks the engine evicted: keep that share of its most
        recent ones. Where it found at least as much and the index is full, let it hold
        more. Each step starts a new count. Without this the index, at its default size,
        predicted 1.3-2.8x the hits the engine had on docs-pressure (TTFT p90 1.4-1.6x;
        `bench/fleetsim_robust.py --variants no-kv-size`); with the KV size the two shares
        agree within 1-6 %."""
        engine, predicted = cal.hits, cal.predicted_hits
        if predicted.den < _FIT_MIN_TOKENS or engine.den < _FIT_MIN_TOKENS:
            return
        found, believed = engine.num / engine.den, predicted.num / predicted.den
        index = self.index
        held, limit = index.size(endpoint_id), index.limit(endpoint_id)
        if found < _FIT_LOW * believed:
            ratio = found / believed
            blocks = int(held * (ratio if ratio > _FIT_STEP else _FIT_STEP))
        elif found > _FIT_HIGH * believed and held >= limit * _FIT_FULL:
            blocks = int(limit / _FIT_STEP) + 1
        else:
            return
        index.set_capacity(endpoint_id, blocks)
        engine.reset()
        predicted.reset()

    @property
    def costs_in_use(self) -> Costs:
        """The costs the last pick used (refreshed at most every 0.1 s): for the trace."""
        return self._costs

    @property
    def step_phase(self) -> bool:
        """Whether the last pick read the step in progress (the engines publish their step)."""
        if self.phase_override is not None:
            return self.phase_override
        return self._step_measured and self.read_phase

    @property
    def speeds_in_use(self) -> dict[str, float]:
        """The slowdowns the last pick used (endpoint -> multiple, slower ones only)."""
        return self._speeds

    def score(self, ctx: PickContext, candidates: list[EndpointState]) -> list[float]:
        request = ctx.request
        if request is not self._request:
            self._request = request
            # Read no cache, a prompt shares none (and it is no reason to stay anywhere).
            self._hashes = self.index.hashes(request.cache_text) if request.reads_cache else []
        hashes = self._hashes
        exact = self._exact_hits(ctx, candidates)
        tokens = request.prompt_tokens if request.prompt_tokens > 0 else 1
        block = float(self.block_tokens)
        if self._tokens:
            # Counted by the model's tokenizer: the index's blocks (this router's chars/4
            # estimate) scale by the same ratio, or beside exact hits an endpoint on the
            # index read half uncached at 2 characters a token.
            tokens = len(self._tokens)
            if request.prompt_tokens > 0:
                block = self.block_tokens * tokens / request.prompt_tokens
        self._block = block
        # An agent's tool schemas: one digest in the first block, their tokens in the count.
        lead = int(request.lead_tokens * block / self.block_tokens)
        self._lead = lead
        # A prompt past the hashed prefix (`limits.prompt_prefix_chars`, the index's
        # `max_blocks`): an endpoint holding all of that prefix holds, for a session, what
        # it was last sent of it. Credited the prefix alone, a 59k-token history's home
        # read 51k tokens uncached and the session left it for a replica holding nothing.
        session = request.session_key
        long_at: dict[str, int] | None = None
        self._long = bool(hashes) and tokens > (len(hashes) + 1) * block + lead
        if self._long and session is not None:
            long_at = self._long_sessions.get(session)
        # A prefix many sessions share (a system prompt) ends up cached wherever sessions
        # go: its one-time prefill is amortised, so it must not pin new sessions to the
        # replicas that saw it first (they would herd there). Only what is this session's
        # own (its history) counts as a reason to stay. The same holds over exact hits.
        shared_blocks = (
            self.index.shared_depth(hashes) if hashes and request.session_key is not None else 0
        )
        shared = int(shared_blocks * block) + lead if shared_blocks else 0
        if shared and exact:
            # Engines hold the shared prefix to the token, past its last full index block:
            # count that extent everywhere too, or those few tokens herd new sessions. Its
            # extent: the least that the engines holding it hold (one's history goes further).
            cap = shared + int(block)
            holding = [e if e < cap else cap for e in exact.values() if e >= shared]
            if holding:
                shared = min(holding)
        # Only endpoints holding more than the shared prefix differ from the rest (a
        # session's home: one or two of 256). Read before `costs`, which may trim the index.
        # Each holds at least shared_blocks + 1 blocks, past the (exact-extended) `shared`.
        deeper = self.index.match(hashes, shared_blocks) if hashes else None
        now = ctx.now
        staleness = ctx.staleness
        costs_now = self.costs(ctx)
        per_token = costs_now.per_token or self.prefill_s
        # A request without a session: the seconds a token of prefill takes, where known and
        # below the engines' ratio: this router's first tokens' slope, else (behind Envoy
        # without response bodies) the engines' prefill seconds net of the step each shares.
        # The ratio carries each prefill's share of a whole engine step: on an engine whose
        # misses cost 15 us a token it read 30-394, which kept shared documents and system
        # prompts on busy replicas (fast-prefill docs-shared 1.40x the best, 0.64x of that
        # with the slope; through Envoy 1.90x, 0.72x of that with the net cost;
        # bench/fleetsim_robust.py). Sessions keep the ratio: priced at the true cost, a
        # history's move looks cheap and its later turns pay (README, session 12). Pricing
        # only this request's prefill so, and the queue ahead at the ratio, lost up to 18x
        # in process on engines with no prefill histogram (session 16).
        seen = costs_now.observed
        if seen is None:
            seen = costs_now.marginal
        if seen is not None and seen < per_token and request.session_key is None:
            per_token = seen
        step0 = costs_now.step or self.step_s
        typical, service = costs_now.tokens_per_prefill, costs_now.service
        if typical is None:
            # Engines that publish only gauges (no prompt-token counters or histograms):
            # this router's own predictions. Falling back to this request's whole prompt
            # counted a long history's every token per waiting request, which moved
            # sessions off their homes (1.26x the best TTFT p90 on chat-history-heavy,
            # 1.03x with this; bench/fleetsim_robust.py, gauges-only engine).
            typical = self._own_typical.value
        # Uncached tokens per candidate: the shared prefix counts as cached everywhere.
        n = len(candidates)
        uncached_tokens = [tokens - shared if shared < tokens else 1] * n
        prefills = [per_token * uncached_tokens[0]] * n if n else []
        if deeper:
            position = self._positions(ctx, candidates).get
            for eid, depth in deeper.items():
                i = position(eid)
                if i is not None:
                    hit = int(depth * block) + lead
                    uncached_tokens[i] = uncached = tokens - hit if hit < tokens else 1
                    prefills[i] = per_token * uncached
        if long_at is not None:
            # Where it holds every hashed block, what the session last sent there (also
            # where all of them are shared: a system prompt past the kept prefix).
            position = self._positions(ctx, candidates).get
            whole = len(hashes)
            for eid, sent in long_at.items():
                i = position(eid)
                if i is None or tokens - uncached_tokens[i] >= sent:
                    continue
                depth = deeper.get(eid, 0) if deeper else 0
                if depth != whole and self.index.held(eid, hashes) != whole:
                    continue
                uncached_tokens[i] = uncached = tokens - sent if sent < tokens else 1
                prefills[i] = per_token * uncached
        # Where an engine's events are live, what it holds replaces the index's guess.
        exact_flags: list[float] | None = None
        if exact:
            position = self._positions(ctx, candidates).get
            exact_flags = [0.0] * n
            for eid, held in exact.items():
                i = position(eid)
                if i is not None:
                    hit = held if held > shared else shared
                    uncached_tokens[i] = uncached = tokens - hit if hit < tokens else 1
                    prefills[i] = per_token * uncached
                    exact_flags[i] = 1.0
        # The engine's waiting requests: each a typical prefill (this one, if none known yet);
        # when its KV cache is full they wait for running requests to end instead.
        per_waiting = per_token * (typical or tokens)
        kv_full = self.kv_full
        factor = step0 * self.batch_factor
        # A prefill's work delays every request that queues behind it: when the model's
        # replicas hold queues (n typical requests deep), each second of work costs about
        # n more seconds for others; so duplicating a cached prefix elsewhere costs more.
        work_weight = base_weight = self.work_weight
        mean_queue = self._mean_queue
        # Queued requests counted in typical prefills overstate the queue's depth when most
        # prefills are cache hits and a few long misses make the queue (it holds the long
        # ones): for sessionless shared prefixes (documents, RAG) that weight reached 10-40
        # and pinned each prefix to one busy replica (3.6x the best TTFT p90 on big-batch
        # engines, bench/fleetsim_robust.py). Count requests of this one's size there;
        # sessions keep the typical count (this size moved hot sessions too readily).
        per_queued = per_waiting if request.session_key is not None else per_token * tokens
        if self.queue_weighting and per_queued > 0:
            work_weight += mean_queue / per_queued
        # ... but only the requests queued where it runs wait behind it. For a session, a
        # copy of its history in spare cache there is also a second home for its later
        # turns: so where the destination's queue is shorter than the mean and the copy
        # fits without evicting, charge that queue instead. Sessionless shared prefixes
        # keep the fleet's charge (every request would see the same idle replica and herd
        # there: 6x worse TTFT p90 in the prefix cells with a per-destination charge).
        fits = self.index.fits
        per_block = per_token * block
        smoothing = self.smoothing
        session_charge = (
            self.queue_weighting and per_waiting > 0 and request.session_key is not None
        )
        # This loop runs per endpoint per pick: no calls on its common path (no max(), no
        # properties, no `ctx.fresh` dict), three appends, term rows built only when read.
        # KV memory in the engine's tokens: this prompt's, and a typical waiting request's.
        kv_per_request = tokens * costs_now.engine_tokens
        kv_per_waiting = (typical or tokens) * costs_now.engine_tokens
        queues: list[float] = []
        append_queue = queues.append
        steps: list[float] = []
        append_step = steps.append
        costs: list[float] = []
        append_cost = costs.append
        # Replicas of unequal speed (`slower_endpoints`): a slower one's prefill, step and
        # queued work take its multiple, and its batch slots free at its own pace (its
        # own time in batch). The work a prefill imposes on the requests queued behind it
        # stays in the fastest's seconds: the charge counts those requests as the fleet's
        # queue over a typical prefill, and a slower replica's seconds hold fewer of them
        # (priced at its multiple too, slower replicas went short of work and the rest
        # queued: prefill-heavy 1.13x the TTFT p90 without speeds, 1.01x with this).
        speeds = self._speeds if self.speeds_override is None else self.speeds_override
        # The step in progress, where the engines publish their step's length: the params'
        # guess misread the phase on engines that publish no metrics (docs-shared TTFT p90
        # 1.3x, with replicas of unequal speed 1.6x; bench/fleetsim_robust.py).
        phase = self.step_phase
        for i, s in enumerate(candidates):
            work = prefill = prefills[i]
            slow = speeds.get(s.id, 1.0) if speeds else 1.0
            serv = service
            if slow != 1.0:
                prefill = prefills[i] = work * slow
                if serv is not None:
                    expected = serv * slow
                    own = own_service(s.calibration, expected)
                    serv = own if own is not None else expected
            # A float (compiled, mypyc: an int is another type); peers' requests count too.
            load = s.inflight + s.remote_inflight + 0.0
            if s.reports_first_token:  # the edge sees first tokens: exact pending work
                queue = s.pending_prefill * per_token * slow
            elif (
                s.counts_first_tokens and s.scrape_error is None and now - s.scraped_at <= staleness
            ):
                # The engine's first-token count closed what was done by the last scrape;
                # it has worked since: less that time. (Work sent since the scrape to an
                # engine that ran out of work in between counts as drained for the time
                # before it came: an understatement only where the queue is near empty.)
                # Only while scrapes succeed: with its /metrics failing, the time since the
                # last good scrape grew without bound and erased every prefill sent there
                # since, so a burst of new sessions piled onto that replica.
                queue = s.counted_prefill * per_token * slow - (now - s.scraped_at)
                if queue < 0:
                    queue = 0.0
            else:  # neither (Envoy without body events, no histogram, or no fresh count):
                # time drains the work
                queue = s.busy_until - now
                if queue < 0:
                    queue = 0.0
            if s.remote_pending > 0.0:  # the prefill work other routers queued there
                queue += s.remote_pending * per_token * slow
            m = s.metrics
            # Fresh metrics only: the rule of `registry.fresh_metrics_of`, inline.
            if m is not None and s.scrape_error is None and now - s.scraped_at <= staleness:
                waiting, running = m.waiting, m.running
                engine_load = waiting + running - s.released_since_scrape
                if engine_load > load:  # noqa: PLR1730 (no call per endpoint)
                    load = engine_load
                if waiting >= 1:  # others' work too (other routers, direct clients)
                    engine_queue = waiting * per_waiting * slow
                    if serv is not None and (m.kv_usage >= kv_full or running >= s.peak_running):
                        # Admission waits for memory or a batch slot (as many running as
                        # ever seen): one running request ends every service / running
                        # seconds, on average, and admits the next.
                        freed = serv / (running if running >= 1 else 1)
                        if freed > per_waiting * slow:
                            engine_queue = waiting * freed
                    if engine_queue > queue:  # noqa: PLR1730
                        queue = engine_queue
                # Admission needs KV memory for the prompt: when this request and those
                # ahead of it (the engine's waiting, this router's sent since the scrape;
                # a typical prefill each) need more than the engine has free, they wait for
                # running requests to end and free theirs, one every service / running
                # seconds. At 85 % KV usage the rule above does not see it, yet one
                # 2,000-token prompt may need a third of the cache (hot-D at 15x in
                # `bench/kv_exact.py`: waits were 5x the predicted queue).
                kv_tokens = s.calibration.kv_tokens
                if kv_tokens and serv is not None and running >= 1:
                    used = m.kv_usage * kv_tokens
                    ahead = waiting + load - engine_load  # load >= engine_load (above)
                    deficit = ahead * kv_per_waiting + kv_per_request - kv_tokens + used
                    if deficit > 0 and used > 0:
                        # Running requests each hold used / running tokens: whole ones end.
                        memory_queue = -(-deficit * running // used) * serv / running
                        if memory_queue > queue:  # noqa: PLR1730
                            queue = memory_queue
            # More requests here than the engine was ever seen running at once, counting
            # this router's own ahead of the next scrape: the excess waits for batch slots,
            # one freed every service / slots seconds. Without this the engine's waiting
            # count showed it a scrape late (fast-prefill docs-shared TTFT p90 170 -> 111
            # ms, big-batch 202 -> 162 ms in process; bench/fleetsim_robust.py).
            # Once that peak is known to be the batch (seen full with requests waiting),
            # this request needs a slot too: at a full batch it waits for one. On replicas
            # of unequal speed a full fast one looked better than a slow one with room
            # (2 of 4 replicas 2x slower, decode-heavy: TTFT p90 0.68-0.77x with this).
            slots = s.peak_running
            if serv is not None and slots >= 1:
                over = load - slots + 1.0 if s.peak_is_batch else load - slots
                if over > 0:
                    slot_queue = over * serv / slots
                    if slot_queue > queue:  # noqa: PLR1730
                        queue = slot_queue
            step = (step0 + factor * load) * slow
            if phase and load > 0:
                # A busy engine is partway through a step, and this request starts with the
                # next one: where the edge relayed a token from it within a step's length,
                # that step began then; else, on average, half of one is left.
                full = step0 * slow
                since = now - s.token_at
                step += full - since if 0.0 <= since < full else full * 0.5
            append_queue(queue)
            append_step(step)
            # ttft + work_weight x prefill, where ttft = queue + prefill + step; plus the
            # score's smoothing here rather than in a second pass (the same sum; A/B:
            # 16-endpoint picks ~1 % faster, 256-endpoint ones ~2 %).
            charge = work_weight
            if session_charge and queue < mean_queue and fits(s.id, work / per_block, now):
                charge = base_weight + queue / slow / per_waiting  # this queue, not the fleet's
            append_cost(queue + prefill + step + charge * work + smoothing)
        if not all(c < _HUGE for c in costs):  # NaN or inf: an engine's numbers broke the
            # model there; such a candidate goes last (a NaN anywhere made every score NaN,
            # and the picker took list order), and the mean below counts finite queues only.
            costs = [c if c < _HUGE else _HUGE for c in costs]
            queues_ok = [q for q in queues if q < _HUGE]
            self._mean_queue = sum(queues_ok) / len(queues_ok) if queues_ok else 0.0
        else:
            self._mean_queue = sum(queues) / n if n else 0.0
        self._candidates = candidates
        self._uncached = uncached_tokens
        self._prompt_tokens = tokens
        self._rows = (queues, prefills, steps)
        # New lists each pick: the Decision keeps the old ones.
        self._terms = TermRows(queues, prefills, steps, uncached_tokens, tokens, exact_flags)
        # low / (cost + smoothing), in a C-level map (the same operations as a list
        # comprehension, ~1.5x faster per endpoint). Rounding is monotonic, so the least
        # smoothed cost is the least cost, smoothed: `low` as before.
        low = min(costs) if costs else 0.0
        return list(map(truediv, repeat(low, n), costs))

    def term_rows(self) -> TermRows:
        return self._terms

    def terms(self) -> dict[str, tuple[float, ...]]:
        """The last score call's terms by name, one value per candidate (for tests, tools)."""
        columns = zip(*self._terms, strict=True) if self._terms else [()] * len(self.term_names)
        return dict(zip(self.term_names, columns, strict=True))

    def observe(self, ctx: PickContext, chosen: EndpointState) -> None:
        hashes = self._hashes
        if hashes:
            if chosen.calibration.pairs_picks:
                # What the index believes cached there, for the engine's hit counter to check
                # (walked only where the engine publishes it).
                depth = self.index.held(chosen.id, hashes)
                held = depth * self._block + self._lead if depth else 0.0
                tokens = self._prompt_tokens
                chosen.calibration.picked(tokens, held if held < tokens else tokens)
            session = ctx.request.session_key
            self.index.insert(chosen.id, hashes, session, ctx.now)
            if self._long and session is not None:
                long_sessions = self._long_sessions
                sent = long_sessions.get(session)
                if sent is None:
                    sent = long_sessions[session] = {}
                    if len(long_sessions) > _MAX_LONG_SESSIONS:
                        long_sessions.popitem(last=False)
                else:
                    long_sessions.move_to_end(session)
                sent[chosen.id] = self._prompt_tokens
        candidates = self._candidates
        i = self._positions(ctx, candidates).get(chosen.id)
        if i is None or candidates[i] is not chosen:
            return
        now = ctx.now
        # The row's ttft as `TermRows` adds it, from the lists, without building the whole
        # row (A/B: 16-endpoint picks ~1 % faster, 256-endpoint ones ~3 %).
        queue, prefill, step = self._rows
        prefill_s = prefill[i]
        ttft = queue[i] + prefill_s + step[i]
        uncached = self._uncached[i]
        self._own_typical.add(uncached, 1.0)
        calibration = chosen.calibration  # prompt tokens sent there, in this router's tokens
        calibration.sent_tokens += self._prompt_tokens
        calibration.sent_count += 1.0
        busy = chosen.busy_until
        chosen.busy_until = ready_at = (busy if busy > now else now) + prefill_s
        ctx.prediction = (ready_at, ttft, uncached)

    def forget(self, endpoint_id: str) -> None:
        self.index.forget(endpoint_id)
        for sent in self._long_sessions.values():
            sent.pop(endpoint_id, None)
