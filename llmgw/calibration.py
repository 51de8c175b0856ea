"""Online calibration of the latency model from what engines publish: seconds of prefill
per computed prompt token, seconds per engine step (time between tokens) for a batch of
one, and prompt tokens computed per request.

Pure: counters arrive through `on_scrape`, the router's own first tokens through
`saw_first_token` (a fit for engines that publish no per-token cost, and each endpoint's
speed against the others' where the engines publish none). Each estimate from the
engines is a ratio of decayed sums (sum of seconds / sum of tokens over recent scrapes),
so a scrape window that saw one short request does not swing it. The scorer uses one set
of costs per model (`pooled`): replicas of one model share hardware and per-token costs,
while one replica's own numbers also carry its load (a busy engine's prefills share steps
with others and look slower per token), and routing on those would feed back into them.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple, TypeVar

from llmgw.types import EngineMetrics

_K = TypeVar("_K")  # an endpoint's key: its id, or its position in a list

_DECAY = 0.9  # per scrape that carried new data: ~10 scrapes of memory
_MIN_TOKENS = 16.0  # a window with fewer computed tokens says little about per-token cost
_MIN_SAMPLES = 20.0  # first tokens seen before the router's own fit is trusted
# An endpoint's own first tokens before they say how fast it runs against the others
# (`observed_slowdowns`), and how many times slower than the fastest it must read. Equal
# replicas read at most 1.5x apart, replicas 2x slower 1.9-2.7x (`bench/fleetsim_robust.py`,
# no-metrics variants, seeds 1-2): the band sits between; 10 samples flagged no equal replica
# and found the slow ones early enough to matter in a 40-second run.
_OBSERVED_MIN = 10.0
_OBSERVED_BAND = 1.7
# The decode step's floor follows a slower window up by this share of the gap a scrape (~100
# windows of memory), and a faster one down at once.
_FLOOR_RISE = 0.01
# The engines' tokenizer against this router's estimate: a constant of the model, so a long
# memory (~200 scrapes, 20 s at the default interval) over enough requests on both sides.
_RATIO_DECAY = 0.995
# The engine's share of prompt tokens found cached, and the index's: ~50 scrapes (5 s).
_HITS_DECAY = 0.98
_SENT_MAX = 4096  # picks waiting for the engine to count them (the oldest drop first)
_MIN_REQUESTS = 20.0
_LONG_DECAY = 0.99
# Ratios this near 1 are left at 1: engines that count about as this router estimates (a
# chat template's markers add a few percent) keep their costs as published. The estimate
# reads within 1 % of the true ratio (p5-p95 per engine over bench/fleetsim_robust.py runs).
_RATIO_BAND = (0.9, 1.1)


def _delta(new: float | None, old: float | None) -> float | None:
    """Counter increase, or None when unknown or reset (engine restart)."""
    if new is None or old is None or new < old:
        return None
    return new - old


class DecayedRatio:
    """sum(num) / sum(den) over recent updates, older ones weighing `decay` less each."""

    __slots__ = ("decay", "den", "num", "value")

    def __init__(self, decay: float = _DECAY) -> None:
        self.decay = decay
        self.num = 0.0
        self.den = 0.0
        self.value: float | None = None  # None until the first update

    def add(self, num: float, den: float) -> None:
        decay = self.decay
        self.num = self.num * decay + num
        self.den = self.den * decay + den
        self.value = self.num / self.den if self.den > 0 else None

    def reset(self) -> None:
        """Forget every update (a new count starts)."""
        self.num = self.den = 0.0
        self.value = None

    def after(self, num: float, den: float) -> float | None:
        """The value `add(num, den)` would leave, without adding."""
        den = self.den * self.decay + den
        return (self.num * self.decay + num) / den if den > 0 else None


class DecayedSlope:
    """The least-squares slope of y on x over recent samples, older ones weighing `decay`
    less each: seconds per token from (tokens, seconds) pairs whose intercept (a step, the
    edge's own overhead) is unknown."""

    __slots__ = ("decay", "n", "x", "xx", "xy", "y")

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self.n = self.x = self.y = self.xx = self.xy = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.n = self.n * d + 1.0
        self.x = self.x * d + x
        self.y = self.y * d + y
        self.xx = self.xx * d + x * x
        self.xy = self.xy * d + x * y

    def through_origin(self, min_samples: float) -> float | None:
        """y per x with no intercept (None: fewer samples or no positive one). Seconds per
        token with the step and the edge's overhead folded in: a biased cost, but a steady
        one (p5-p95 within 5 % over a run where the slope's spanned 1.4-3.5x on equal
        replicas), so one endpoint's compares with another's."""
        if self.n < min_samples or self.xx <= 0 or self.xy <= 0:
            return None
        return self.xy / self.xx


def _slope(fits: Iterable[DecayedSlope]) -> float | None:
    """One slope over all the samples (None: too few, or no positive slope)."""
    n = x = y = xx = xy = 0.0
    for f in fits:
        n, x, y, xx, xy = n + f.n, x + f.x, y + f.y, xx + f.xx, xy + f.xy
    # n var(x) over mean(x^2): samples of one size (a templated workload at low load) say
    # nothing of the cost per token, and in floats their spread is rounding residue, not
    # 0 (the slope of noise over it read 61-366 us a token, by the size). Under 1e-6: one x.
    spread = n * xx - x * x
    if n < _MIN_SAMPLES or spread <= 1e-6 * n * xx:
        return None
    slope = (n * xy - x * y) / spread
    return slope if slope > 0 else None


def _pooled(
    ratios: Iterable[DecayedRatio],
    bounds: tuple[float, float] | None = None,
    *,
    outliers: bool = False,
) -> float | None:
    """One ratio over all endpoints' samples; with `bounds`, endpoints whose own value is
    outside them are left out; with `outliers`, also one 10x off the others' median (a
    look-alike publishing milliseconds for seconds: pooled, it set every endpoint's slot
    wait 250x too long). Not for values that differ by traffic (uncached tokens)."""
    kept = [r for r in ratios if bounds is None or _plausible(r.value, bounds) is not None]
    if outliers and len(kept) >= 3:
        values = sorted(v for r in kept if (v := r.value) is not None)
        if values:
            middle = values[len(values) // 2]
            kept = [r for r in kept if r.value is None or middle / 10 <= r.value <= middle * 10]
    num = den = 0.0
    for r in kept:
        num += r.num
        den += r.den
    return num / den if den > 0 else None


# What an engine's published numbers can mean; outside, a glitch (a counter reset mid-window,
# an overflow, another unit), and the endpoint's value is not used: one endpoint's absurd
# number set the whole model's price (the minimum over endpoints) and sent it every request.
PER_TOKEN_S = (1e-9, 1.0)  # seconds a prefill token takes
NET_PER_TOKEN_S = (-1.0, 1.0)  # the same less a step's share: an estimate, may dip below 0
STEP_S = (1e-5, 60.0)  # seconds an engine step takes
SERVICE_S = (1e-4, 86_400.0)  # seconds a request holds its batch slot
TOKENS_PER_PREFILL = (1.0, 1e8)
MAX_SLOWDOWN = 100.0  # an endpoint priced at most this multiple of the fastest


def _plausible(value: float | None, bounds: tuple[float, float]) -> float | None:
    if value is None or not math.isfinite(value) or not bounds[0] <= value <= bounds[1]:
        return None
    return value


def own_service(cal: Calibration, expected: float) -> float | None:
    """An endpoint's own time in batch where it is plausible and within 10x of `expected`
    (the model's, at that endpoint's speed), as the pooled value leaves outliers out: a
    look-alike publishing milliseconds priced its slot waits 1000x, one publishing 0 s
    freed its full batch at once and drew every request."""
    own = _plausible(cal.service.value, SERVICE_S)
    if own is None or not expected / 10 <= own <= expected * 10:
        return None
    return own


class Calibration:
    """Per-endpoint latency estimates; None until the endpoint has published enough."""

    __slots__ = (
        "_batch_seconds",
        "_cached_carry",
        "_pending",
        "_prev",
        "_prev_at",
        "batch_factor",
        "engine_prompt",
        "floor",
        "hits",
        "kv_tokens",
        "net",
        "observed",
        "predicted_hits",
        "prefill",
        "prefill_long",
        "prefix_caching",
        "router_prompt",
        "sent",
        "sent_count",
        "sent_tokens",
        "service",
        "step",
        "tokens",
        "unqueued",
    )

    def __init__(self) -> None:
        # A step's growth per running request: the latency scorer's `batch_factor`, which
        # it sets here, so a step taken to a batch of one scales back to what was measured.
        self.batch_factor = 0.02
        self._prev: EngineMetrics | None = None
        self._prev_at: float | None = None  # when it was scraped (seconds, any clock)
        self._batch_seconds = 0.0  # requests in the batch x seconds, since one last left
        # Deltas not yet folded in: engines count prompt tokens when a request is admitted
        # but observe its prefill time when it finishes, so one scrape window can hold one
        # without the other; folding only windows with both would drop seconds (a bias).
        # Prefill seconds, computed tokens, prefills, requests the tokens belong to, and the
        # batch's growth in running requests meanwhile.
        self._pending = [0.0, 0.0, 0.0, 0.0, 0.0]
        self.prefill = DecayedRatio()  # seconds per computed prompt token
        # The same over ~100 scrapes (10 s at the default interval): one endpoint's speed
        # against the others' (`slowdowns`), where a window's load would swing it.
        self.prefill_long = DecayedRatio(_LONG_DECAY)
        self.tokens = DecayedRatio()  # computed prompt tokens per request
        self.step = DecayedRatio()  # seconds per engine step, normalised to a batch of one
        self.service = DecayedRatio()  # seconds a request holds its batch slot
        self.kv_tokens: float | None = None  # the engine's KV cache size, if it says
        # Whether it reuses cached prefixes, if it says (vLLM's cache_config_info does).
        self.prefix_caching: bool | None = None
        # What this router saw itself: time to first token against the prefill tokens ahead
        # of and in the request (its own estimate, in its own tokens), where the edge sees
        # first tokens. Its slope is seconds per token for engines that publish none.
        self.observed = DecayedSlope()
        # The same for the requests sent with no prefill pending ahead of them here: their
        # first token took their own prefill and a step, whatever the load. A request that
        # queued for a batch slot waited for decodes to finish, which its tokens ahead do not
        # count, so on a replica holding hot sessions `observed` alone read 2.1-2.4x its
        # equal neighbours' (`bench/fleetsim_robust.py`, no-metrics, hot-zipf).
        self.unqueued = DecayedSlope()
        # Seconds per computed prompt token net of the engine step each prefill shares
        # (`floor` at the window's batch): what a token adds, where `prefill` is what a token
        # costs on average. A prefill of a few uncached tokens still waits out a whole step,
        # so where most prompts are cache hits the ratio read 3-15x the engine's marginal
        # cost (`bench/fleetsim_robust.py`, docs-shared). May be negative while noisy.
        self.net = DecayedRatio()
        # The step a prefill shares, for a batch of one: the fastest recent window's. The
        # mean (`step`) carries the prefill chunks that stall decodes: on prefill-bound
        # engines it read 2-8x the decode step, and taking that out of each prefill left
        # 15-40 % of a token's true cost (bench/fleetsim_robust.py, prefill-heavy).
        self.floor: float | None = None
        # Prompt tokens per request as the engine counts them (its prompt-token counter over
        # the requests that entered its batch) and as this router estimated the ones it sent
        # there (picks add to `sent_*`, each scrape folds them in): their ratio converts the
        # engine's per-token numbers into this router's tokens (`pooled`).
        self.engine_prompt = DecayedRatio(_RATIO_DECAY)
        self.router_prompt = DecayedRatio(_RATIO_DECAY)
        self.sent_tokens = 0.0
        self.sent_count = 0.0
        # The share of prompt tokens the engine found cached (its cached-token counter over
        # its prompt-token counter), and the share this router's index predicted cached for
        # the same prompts: where the engine's is lower, the index believes cached what the
        # engine no longer holds (`hits_confirmed`). The engine counts a prompt when it
        # admits it, a queue after the pick, so picks wait in `sent` (prompt tokens, tokens
        # predicted cached; oldest first) until the engine's prompt counter has counted as
        # many tokens: compared window by window instead, the two shares read 0.19-0.83
        # and 0.27-0.82, uncorrelated, on prefill-heavy's long queues.
        self.hits = DecayedRatio(_HITS_DECAY)
        self.predicted_hits = DecayedRatio(_HITS_DECAY)
        self.sent: deque[list[float]] = deque(maxlen=_SENT_MAX)
        self._cached_carry = 0.0  # cache hits counted before their prompts' tokens were

    def saw_first_token(self, ahead: float, tokens: float, seconds: float) -> None:
        """A request sent with `ahead` prefill tokens pending here (this router's count) and
        `tokens` of its own produced its first token `seconds` after it was sent."""
        self.observed.add(ahead + tokens, seconds)
        if ahead <= 0:
            self.unqueued.add(tokens, seconds)

    @property
    def pairs_picks(self) -> bool:
        """Whether `picked` keeps a pick: the engine's last page had both counters to pair
        it with (so a caller can skip working out what it would have passed)."""
        last = self._prev  # the last page scraped
        return (
            last is not None
            and last.cached_tokens_total is not None
            and last.prompt_tokens_total is not None
        )

    def picked(self, tokens: float, cached: float) -> None:
        """A prompt of `tokens` sent here, `cached` of them cached as this router believes
        (kept only while the engine publishes both counters to pair it with)."""
        if self.pairs_picks:
            self.sent.append([tokens, cached])

    def _match_sent(self, cached: float, prompt: float) -> None:
        """The engine counted `prompt` tokens admitted, `cached` of them found cached: pair
        them with as many of the oldest picks' tokens (converted into this router's)."""
        engine, router = self.engine_prompt.value, self.router_prompt.value
        left = prompt * router / engine if engine and router else prompt
        tokens = hits = 0.0
        sent = self.sent
        while sent and left > 0:
            pick = sent[0]
            if pick[0] <= left:
                sent.popleft()
                left -= pick[0]
                tokens += pick[0]
                hits += pick[1]
            else:  # admitted in part (a chunked prefill): the rest waits
                share = left / pick[0]
                tokens += left
                hits += pick[1] * share
                pick[0] -= left
                pick[1] -= pick[1] * share
                left = 0.0
        if tokens > 0:  # other clients' prompts count at the engine only: not paired
            self.hits.add(cached, prompt)
            self.predicted_hits.add(hits, tokens)

    def on_scrape(
        self,
        m: EngineMetrics,
        batch_factor: float | None = None,
        at: float | None = None,
        released: int | None = None,
    ) -> None:
        """`at`: when it was scraped; `released`: requests this router saw end there since
        the previous scrape (what finished, if the engine counts nothing itself)."""
        prev, self._prev = self._prev, m
        prev_at, self._prev_at = self._prev_at, at
        if m.kv_tokens is not None:
            self.kv_tokens = m.kv_tokens
        if m.prefix_caching is not None:
            self.prefix_caching = m.prefix_caching
        sent_tokens, sent_count = self.sent_tokens, self.sent_count
        self.sent_tokens = self.sent_count = 0.0  # folded in below (dropped before a first page)
        if prev is None:
            return
        if batch_factor is None:
            batch_factor = self.batch_factor
        # An engine step at the window's mean batch over one at a batch of one.
        batch_scale = 1 + batch_factor * (max(1.0, (m.running + prev.running) / 2) - 1)
        prompt = _delta(m.prompt_tokens_total, prev.prompt_tokens_total)
        # Engines count a request's prompt tokens when it enters the batch (vLLM: at its
        # first token), long before it finishes: the requests counted in a window are the
        # ones that finished plus the batch's growth. Finished requests alone read 1.3-2.1x
        # for the first seconds of a run, while the batch filled.
        started = _delta(m.finished_total, prev.finished_total)
        if started is not None:
            started += m.running - prev.running
        if prompt is not None and started is not None and (prompt or started or sent_count):
            # Both sides decay together, once a scrape: the same window of traffic. An idle
            # window adds nothing: it decayed the ratio below its minimum requests within a
            # minute of idling, and prices jumped by the ratio when traffic came back.
            self.engine_prompt.add(prompt, started)
            self.router_prompt.add(sent_tokens, sent_count)
        cached = _delta(m.cached_tokens_total, prev.cached_tokens_total)
        if cached is None or prompt is None:
            self._cached_carry = 0.0
        else:
            # vLLM counts a prompt's cache hits when it admits it and its prompt tokens at
            # its first token, often a scrape later: hits of a window without a first
            # token are carried to the next one that has some. Dropped, the engine's share
            # read low on long prompts (chunked prefills span scrapes), the index was cut to
            # a sliver and sessions spread: 2.3-9x the best TTFT p90 on chat-history and
            # prefill-heavy (`bench/fleetsim_robust.py`, engines without cache_config_info).
            cached += self._cached_carry
            if prompt > 0:
                self._cached_carry = 0.0
                self._match_sent(cached, prompt)
            else:
                self._cached_carry = cached
        tokens = _delta(m.computed_tokens_sum, prev.computed_tokens_sum)
        if tokens is None and prompt is not None:
            tokens = prompt - (cached or 0.0)
        prefill = _delta(m.prefill_seconds_sum, prev.prefill_seconds_sum)
        prefills = _delta(m.prefill_count, prev.prefill_count)
        untimed = m.prefill_count is None and prev.prefill_count is None
        if untimed and m.ttft_count is not None and prev.ttft_count is not None:
            # No prefill histogram, but time to first token (most vLLM look-alikes, SGLang):
            # the prefill is what is left of it once the queue-time histogram's seconds are
            # taken out. Without one the queue counts as prefill, an upper bound like the
            # step a prefill shares (`pooled` takes the least loaded engine's). Little's
            # law over the waiting gauge instead took out too much under heavy queueing
            # (prefill-heavy: 400 us a token where the prefill histogram said 710).
            untimed = False
            prefill = _delta(m.ttft_seconds_sum, prev.ttft_seconds_sum)
            prefills = _delta(m.ttft_count, prev.ttft_count)
            queued = _delta(m.queue_seconds_sum, prev.queue_seconds_sum)
            if prefill is not None and queued is not None:
                prefill -= queued  # each window's may go negative; the pending sum pairs up
        elif untimed:
            # No histogram at all: the token counters over finished requests still give the
            # typical prefill in tokens, though not its seconds.
            prefill, prefills = 0.0, _delta(m.finished_total, prev.finished_total)
        # Token counters (prompt - cached) count a request when it enters the batch; the
        # prefill histogram counts it when it finishes. While the batch fills, a window's
        # tokens include those of requests still running: dividing the finished prefills'
        # seconds by them read 6-40 us a token for the first seconds of a run on an engine
        # whose misses cost 60-115 (bench/fleetsim_robust.py, vllm-batch), and moves of
        # cached documents looked cheap. So the tokens of the batch's growth (its change
        # in running requests x tokens per request) wait for their finish; in a steady
        # state the growth sums to nothing. The computed-tokens histogram, and time to
        # first token, count at the same moment as their tokens.
        at_start = m.computed_tokens_sum is None
        lead = at_start and m.prefill_count is not None  # seconds from the prefill histogram
        pending = self._pending
        if tokens is not None and prefill is not None and prefills is not None:
            pending[0] += prefill
            pending[1] += tokens
            pending[2] += prefills
            pending[3] += started if at_start and started is not None else prefills
            pending[4] += m.running - prev.running if lead else 0.0
        else:  # a counter went missing or was reset: what is pending no longer pairs up
            pending[:] = [0.0, 0.0, 0.0, 0.0, 0.0]
        seconds, tokens_in, count, owners_in, growth = pending
        if (seconds > 0 or untimed) and count >= 1:
            typical = self.tokens
            started_some = tokens_in > 0 and owners_in >= 1
            if started_some:  # tokens per request, this window's included
                per_request = typical.after(tokens_in, owners_in) or 0.0
            else:
                per_request = typical.value or 0.0
            finished_tokens = tokens_in - growth * per_request
            if finished_tokens >= _MIN_TOKENS:
                pending[:] = [0.0, 0.0, 0.0, 0.0, 0.0]
                if seconds > 0:
                    self.prefill.add(seconds, finished_tokens)
                    self.prefill_long.add(seconds, finished_tokens)
                    one = self.floor
                    if one is not None:
                        self.net.add(seconds - count * one * batch_scale, finished_tokens)
                if started_some:
                    typical.add(tokens_in, owners_in)
        steps = _delta(m.step_count, prev.step_count)
        step_time = _delta(m.step_seconds_sum, prev.step_seconds_sum)
        if steps and step_time is not None:
            one = step_time / batch_scale
            self.step.add(one, steps)
            if steps >= 2:  # one step says little: it may have been a light one
                floor, window = self.floor, one / steps
                if floor is None or window < floor:
                    self.floor = window
                else:
                    self.floor = floor + (window - floor) * _FLOOR_RISE
        served = _delta(m.service_count, prev.service_count)
        service = _delta(m.service_seconds_sum, prev.service_seconds_sum)
        if served and service is not None:
            self.service.add(service, served)
        elif m.service_count is None and at is not None and prev_at is not None:
            # No time-in-batch histogram (SGLang, TRT-LLM): Little's law, requests in the
            # batch x seconds / requests that left it, summed until a window saw one leave
            # (dropping windows where none did biased it 10x low). Without a finished
            # counter either, the requests this router saw end (other clients' requests
            # make that an overestimate).
            if m.finished_total is None and prev.finished_total is None:
                finished = None if released is None else float(released)
            else:
                finished = _delta(m.finished_total, prev.finished_total)
            if finished is None or at <= prev_at:
                self._batch_seconds = 0.0
            else:
                self._batch_seconds += (m.running + prev.running) / 2 * (at - prev_at)
                if finished:
                    self.service.add(self._batch_seconds, finished)
                    self._batch_seconds = 0.0


def hits_confirmed(cal: Calibration) -> float | None:
    """The engine's share of prompt tokens found cached over the share this router's index
    predicted for the prompts it sent there (None: nothing predicted yet)."""
    engine, predicted = cal.hits.value, cal.predicted_hits.value
    if engine is None or not predicted:
        return None
    return engine / predicted


class Costs(NamedTuple):
    """A model's latency costs, from its endpoints' calibrations (None: not published), in
    this router's tokens (its chars / 4 estimate, or its tokenizer's)."""

    per_token: float | None  # seconds per computed prefill token
    step: float | None  # seconds per engine step, batch of one
    tokens_per_prefill: float | None  # prompt tokens computed per request
    service: float | None  # seconds a request holds its batch slot
    # Engine tokens per token of this router's (1.0 until both sides counted enough): an
    # engine's KV size in tokens divides by it.
    engine_tokens: float = 1.0
    # Seconds per token as this router saw them drain: its first tokens' slope (None where
    # the edge sees no first tokens, or too few yet).
    observed: float | None = None
    # Seconds a computed token adds to an engine's prefill, net of the step it shares
    # (None: no prefill seconds and step published, or not positive yet).
    marginal: float | None = None


def slowdowns(cals: Iterable[tuple[str, Calibration]]) -> dict[str, float]:
    """How many times slower each endpoint of a model runs than its fastest, by two signals
    that must agree: the engine step (its fastest recent window, `floor`) and the seconds a
    prefill token takes over ~10 s (`prefill_long`), each over the fastest endpoint's; the
    lesser of the two. Either alone differs between equal replicas: on prefill-bound engines
    every step carries a prefill chunk (floors read 1.3-6x apart), and a busier replica's
    prefills share more steps (1.2-1.9x); the lesser stayed within 1.45x on equal replicas
    and read 1.7-2.3x on replicas 2x slower (`bench/fleetsim_robust.py`, prefill-heavy).
    Endpoints without both signals are left out. While fewer than two have them (engines
    that publish no step or prefill seconds), this router's own first tokens, if it sees
    them (`observed_slowdowns`)."""
    cals = list(cals)
    floors: dict[str, float] = {}
    prefills: dict[str, float] = {}
    for eid, cal in cals:
        floor = _plausible(cal.floor, STEP_S)
        prefill = _plausible(cal.prefill_long.value, PER_TOKEN_S)
        if floor is not None and prefill is not None:
            floors[eid] = floor
            prefills[eid] = prefill
    if len(floors) < 2:
        return observed_slowdowns(cals)
    fastest_floor = min(floors.values())
    fastest_prefill = min(prefills.values())
    return {
        eid: min(floor / fastest_floor, prefills[eid] / fastest_prefill, MAX_SLOWDOWN)
        for eid, floor in floors.items()
    }


def observed_slowdowns(cals: Iterable[tuple[_K, Calibration]]) -> dict[_K, float]:
    """How many times slower each endpoint runs than the fastest by this router's own first
    tokens: seconds per token through the origin over all its requests and over those sent
    with nothing queued ahead (`Calibration.unqueued`), each over the fastest endpoint's, the
    lesser of the two. The first carries load the tokens ahead do not count (a replica full of
    hot sessions read 2x its equal neighbours); the second is few samples on a busy replica;
    both read 1.9-2.7x on replicas 2x slower. Endpoints past `_OBSERVED_BAND` get their
    multiple, the others 1.0 (a read this indirect is no finer); endpoints without
    `_OBSERVED_MIN` samples of both are left out, and nothing comes back while fewer than two
    have them. Without engine metrics this took a fleet whose two slow replicas served 38-42 %
    of the requests to 12-15 % (`bench/crosscheck.py --metrics none`, chat-mixed-gpu)."""
    reads: dict[_K, float] = {}
    for eid, cal in cals:
        every = cal.observed.through_origin(_OBSERVED_MIN)
        alone = cal.unqueued.through_origin(_OBSERVED_MIN)
        if every is not None and alone is not None:
            reads[eid] = min(every, alone)
    if len(reads) < 2:
        return {}
    fastest = min(reads.values())
    if not (math.isfinite(fastest) and fastest > 0):
        return {}
    return {
        eid: min(read / fastest, MAX_SLOWDOWN) if read >= fastest * _OBSERVED_BAND else 1.0
        for eid, read in reads.items()
    }


def token_ratio(cals: Iterable[Calibration]) -> float:
    """Engine tokens per token of this router's estimate, from prompt tokens per request on
    each side (a ratio of means: other routers' and clients' requests count at the engine
    too, so totals would not compare). 1.0 until both sides saw enough requests, and while
    it is within `_RATIO_BAND` of 1."""
    engine_num = engine_den = router_num = router_den = 0.0
    for c in cals:
        e, r = c.engine_prompt, c.router_prompt
        if e.den > 0 and r.den > 0:
            engine_num, engine_den = engine_num + e.num, engine_den + e.den
            router_num, router_den = router_num + r.num, router_den + r.den
    if engine_den < _MIN_REQUESTS or router_den < _MIN_REQUESTS or router_num <= 0:
        return 1.0
    ratio = (engine_num / engine_den) / (router_num / router_den)
    low, high = _RATIO_BAND
    if not (math.isfinite(ratio) and 0.01 <= ratio <= 100.0):  # no tokenizer is that far off
        return 1.0
    return ratio if not low <= ratio <= high else 1.0


def pooled(cals: Iterable[Calibration]) -> Costs:
    """A model's costs over its endpoints. Per-token and per-step costs are upper bounds on
    each engine (a request's prefill time covers the whole step it shared with other
    prefills and decodes; the time between tokens includes steps stalled by prefills), so
    the lowest endpoint's is the tightest; where no endpoint publishes one, this router's
    own fit over all of them but those its first tokens show slower (`observed_slowdowns`).
    The means are pooled ratios (busier endpoints, more data, weigh more). The engines' token
    counts convert into this router's tokens (`token_ratio`). `observed` is this router's
    own fit wherever it has one (the scorer prices requests without a session at it when it
    is below the engines')."""
    cals = list(cals)
    ratio = token_ratio(cals)
    per_token = min(
        (v for c in cals if (v := _plausible(c.prefill.value, PER_TOKEN_S)) is not None),
        default=None,
    )
    observed = _slope(c.observed for c in cals)
    if per_token is not None:
        per_token *= ratio
    else:  # no engine publishes it: what this router saw (its own tokens), if it sees tokens
        slow = observed_slowdowns(enumerate(cals))
        if any(v > 1.0 for v in slow.values()):
            # Those are priced at their multiple of the fastest's cost: fit the others alone.
            observed = _slope(c.observed for i, c in enumerate(cals) if slow.get(i, 1.0) == 1.0)
        per_token = observed
    step = min(
        (v for c in cals if (v := _plausible(c.step.value, STEP_S)) is not None), default=None
    )
    tokens = _pooled((c.tokens for c in cals), TOKENS_PER_PREFILL)
    # Net of a step, one endpoint's estimate may be below 0 (noise): pooled, not dropped.
    marginal = _pooled((c.net for c in cals), NET_PER_TOKEN_S)
    return Costs(
        per_token,
        step,
        None if tokens is None else tokens / ratio,
        _pooled((c.service for c in cals), SERVICE_S, outliers=True),
        ratio,
        observed,
        marginal * ratio if marginal is not None and marginal > 0 else None,
    )
