"""Scorers: each rates every candidate in [0, 1]; the strategy weighs and sums them."""

from __future__ import annotations

import math

from llmgw.calibration import Costs, pooled
from llmgw.registry import EndpointState
from llmgw.scheduling.interfaces import PickContext
from llmgw.scheduling.prefix import PrefixIndex
from llmgw.tokenize import PromptTokenizer, make_tokenizer
from llmgw.types import CHARS_PER_TOKEN, RequestInfo


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
            if m is None:
                append(float(s.inflight))
                continue
            # Requests sent since the scrape are not in its queue yet: count the excess.
            excess = s.inflight - m.running
            append(m.waiting if m.waiting >= excess else excess)
        return relative(queues, self.smoothing)


class InflightScorer:
    """Fewer requests in flight from this router is better (exact, no scrape lag)."""

    name = "inflight"

    def __init__(self, smoothing: float = 1.0) -> None:
        self.smoothing = _smoothing(smoothing)

    def score(self, ctx: PickContext, candidates: list[EndpointState]) -> list[float]:
        return relative([float(s.inflight) for s in candidates], self.smoothing)


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
            inflight = s.inflight
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

    def score(self, ctx: PickContext, candidates: list[EndpointState]) -> list[float]:
        if self.abstain_without_session and ctx.request.session_key is None:
            return [0.0] * len(candidates)
        key = ctx.request.routing_key
        c = self.bounded_load or ctx.spec.session.bounded_load or 0.0
        if c >= 1.0:
            loads = {s.id: s.inflight for s in ctx.all_states}
            ring_order = ctx.ring.bounded_candidates(key, loads, c)
        else:
            ring_order = ctx.ring.candidates(key)
        step = 1.0 / (len(ring_order) + 1) if ring_order else 0.0
        rank = {rid: 1.0 - i * step for i, rid in enumerate(ring_order)}
        return [rank.get(s.id, 0.0) for s in candidates]


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
            self._last = (request, self.index.hashes(request.prompt))
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


def softmax_weights(scores: list[float], temperature: float) -> list[float]:
    top = max(scores)
    return [math.exp((s - top) / temperature) for s in scores]


class LatencyScorer:
    """Predicted time to first token on each endpoint, in seconds; the fastest scores 1.

    ttft = queue + prefill + step, where
      queue   = the prefill work this router already sent there that the engine has not
                done (a fluid model: each pick adds its uncached tokens x seconds per token,
                time drains it, an early first token cuts it), or the engine's own waiting
                count x the prefill of a typical request, whichever is longer;
      prefill = (prompt tokens - tokens probably cached there) x seconds per prefill token;
      step    = one engine step at that endpoint's batch size (waiting + running).
    Seconds per token and per step come from the model's engines' published histograms
    and counters, pooled over its endpoints (`llmgw.calibration`), else from the params.
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
    ) -> None:
        # Built at config load: a missing optional package or file fails there, with a message.
        self.tokenizer: PromptTokenizer | None = make_tokenizer(tokenizer) if tokenizer else None
        self._tokens: tuple[int, ...] | None = None
        if shared_sessions < 1:
            raise ValueError(f"shared_sessions must be >= 1, got {shared_sessions!r}")
        self.shared_sessions = shared_sessions
        self.queue_weighting = queue_weighting
        if not 0 < kv_full <= 1:
            raise ValueError(f"kv_full must be in (0, 1], got {kv_full!r}")
        self.kv_full = kv_full
        self._mean_queue = 0.0  # mean queue over the last pick's candidates (seconds)
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
        self.smoothing = smoothing_ms / 1e3
        self.index = PrefixIndex(
            block_chars=int(block_tokens * CHARS_PER_TOKEN),
            max_blocks=max_blocks,
            capacity=capacity,
        )
        self._request: RequestInfo | None = None
        self._hashes: list[int] = []
        self._costs_at = float("-inf")
        self._costs = Costs(self.prefill_s, self.step_s, None, None)
        self._candidates: list[EndpointState] = []
        self._uncached: list[int] = []
        self._terms: list[tuple[float, float, float, float, float, float]] = []

    def _exact_hits(self, ctx: PickContext, candidates: list[EndpointState]) -> dict[str, int]:
        """Cached tokens per endpoint whose engine's events are live; tokenizes only then."""
        kv = ctx.kv
        if self.tokenizer is None or kv is None or not kv.any_live():
            self._tokens = None
            return {}
        request = ctx.request
        tokens = self.tokenizer.tokens(request.raw_prompt, request.session_key)
        self._tokens = tokens
        if not tokens:
            return {}
        return kv.match(tokens, [s.id for s in candidates])

    def costs(self, ctx: PickContext) -> Costs:
        """The model's costs: its endpoints' calibration (`pooled`, refreshed at most every
        0.1 s) where they publish it, else the params."""
        if ctx.now - self._costs_at < 0.1:
            return self._costs
        if self.calibrate:
            block = self.block_tokens
            for s in ctx.all_states:
                kv = s.calibration.kv_tokens
                if kv is not None:
                    self.index.set_capacity(s.id, int(kv // block))
        measured = pooled([s.calibration for s in ctx.all_states]) if self.calibrate else None
        if measured is None:
            costs = Costs(self.prefill_s, self.step_s, None, None)
        else:
            costs = Costs(
                measured.per_token or self.prefill_s,
                measured.step or self.step_s,
                measured.tokens_per_prefill,
                measured.service,
            )
        self._costs_at, self._costs = ctx.now, costs
        return costs

    @property
    def costs_in_use(self) -> Costs:
        """The costs the last pick used (refreshed at most every 0.1 s): for the trace."""
        return self._costs

    def score(self, ctx: PickContext, candidates: list[EndpointState]) -> list[float]:
        request = ctx.request
        if request is not self._request:
            self._request = request
            self._hashes = self.index.hashes(request.prompt)
        hashes = self._hashes
        matched = self.index.match(hashes) if hashes else {}
        get_matched = matched.get
        exact = self._exact_hits(ctx, candidates)
        get_exact = exact.get
        tokens = request.prompt_tokens if request.prompt_tokens > 0 else 1
        if self._tokens:
            tokens = len(self._tokens)
        block = self.block_tokens
        # A prefix many sessions share (a system prompt) ends up cached wherever sessions
        # go: its one-time prefill is amortised, so it must not pin new sessions to the
        # replicas that saw it first (they would herd there). Only what is this session's
        # own (its history) counts as a reason to stay. The same holds over exact hits.
        shared = (
            self.index.shared_depth(hashes, self.shared_sessions) * block
            if hashes and request.session_key is not None
            else 0
        )
        if shared and exact:
            # Engines hold the shared prefix to the token, past its last full index block:
            # count that extent everywhere too, or those few tokens herd new sessions. Its
            # extent: the least that the engines holding it hold (one's history goes further).
            cap = shared + block
            holding = [e if e < cap else cap for e in exact.values() if e >= shared]
            if holding:
                shared = min(holding)
        now = ctx.now
        fresh = ctx.fresh
        costs_now = self.costs(ctx)
        per_token = costs_now.per_token or self.prefill_s
        step0 = costs_now.step or self.step_s
        typical, service = costs_now.tokens_per_prefill, costs_now.service
        # The engine's waiting requests: each a typical prefill (this one, if none known);
        # when its KV cache is full they wait for running requests to end instead.
        per_waiting = per_token * (typical or tokens)
        kv_full = self.kv_full
        factor = step0 * self.batch_factor
        # A prefill's work delays every request that queues behind it: when the model's
        # replicas hold queues (n typical requests deep), each second of work costs about
        # n more seconds for others; so duplicating a cached prefix elsewhere costs more.
        work_weight = self.work_weight
        if self.queue_weighting and per_waiting > 0:
            work_weight += self._mean_queue / per_waiting
        # (ttft, queue, prefill, step) seconds per candidate; this loop runs per endpoint per
        # pick, so it avoids calls (no max(), no properties) and appends once.
        terms: list[tuple[float, float, float, float, float, float]] = []
        append = terms.append
        costs: list[float] = []
        append_cost = costs.append
        uncached_tokens: list[int] = []
        append_uncached = uncached_tokens.append
        for s in candidates:
            load: float = s.inflight
            if s.reports_first_token:  # the edge sees first tokens: exact pending work
                queue = s.pending_prefill * per_token
            else:  # it does not (Envoy without body events): time drains the work
                queue = s.busy_until - now
                if queue < 0:
                    queue = 0.0
            m = fresh[s]
            if m is not None:
                engine_load = m.waiting + m.running - s.released_since_scrape
                if engine_load > load:  # noqa: PLR1730 (no call per endpoint)
                    load = engine_load
                if m.waiting >= 1:  # others' work too (other routers, direct clients)
                    engine_queue = m.waiting * per_waiting
                    if service is not None and (
                        m.kv_usage >= kv_full or m.running >= s.peak_running
                    ):
                        # Admission waits for memory or a batch slot (as many running as
                        # ever seen): one running request ends every service / running
                        # seconds, on average, and admits the next.
                        freed = service / (m.running if m.running >= 1 else 1)
                        if freed > per_waiting:
                            engine_queue = m.waiting * freed
                    if engine_queue > queue:  # noqa: PLR1730
                        queue = engine_queue
            exact_hit = get_exact(s.id)
            if exact_hit is None:  # no live events there: what this router sent there
                hit = get_matched(s.id, 0) * block
                is_exact = 0.0
            else:  # what the engine holds
                hit = exact_hit
                is_exact = 1.0
            if hit < shared:  # noqa: PLR1730
                hit = shared
            uncached = tokens - hit if hit < tokens else 1
            append_uncached(uncached)
            prefill = per_token * uncached
            step = step0 + factor * load
            ttft = queue + prefill + step
            append((ttft, queue, prefill, step, float(tokens - uncached), is_exact))
            append_cost(ttft + work_weight * prefill)
        self._candidates = candidates
        self._uncached = uncached_tokens
        self._terms = terms  # a new list each pick: the Decision keeps the old one
        self._mean_queue = sum([t[1] for t in terms]) / len(terms) if terms else 0.0
        smoothing = self.smoothing
        low = min(costs) + smoothing if costs else 0.0
        return [low / (c + smoothing) for c in costs]

    def term_rows(self) -> list[tuple[float, float, float, float, float, float]]:
        return self._terms

    def terms(self) -> dict[str, tuple[float, ...]]:
        """The last score call's terms by name, one value per candidate (for tests, tools)."""
        columns = zip(*self._terms, strict=True) if self._terms else [()] * len(self.term_names)
        return dict(zip(self.term_names, columns, strict=True))

    def observe(self, ctx: PickContext, chosen: EndpointState) -> None:
        if self._hashes:
            self.index.insert(chosen.id, self._hashes, ctx.request.session_key)
        try:
            i = self._candidates.index(chosen)
        except ValueError:
            return
        now = ctx.now
        ttft, _, prefill, *_ = self._terms[i]
        start = chosen.busy_until if chosen.busy_until > now else now
        chosen.busy_until = ready_at = start + prefill
        ctx.prediction = (ready_at, ttft, self._uncached[i])

    def forget(self, endpoint_id: str) -> None:
        self.index.forget(endpoint_id)
