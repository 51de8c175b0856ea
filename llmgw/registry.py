"""Endpoints per model and what is known about each: inflight, metrics, staleness, breaker.

Pure bookkeeping: the runtime feeds scrapes in, the edges feed dispatches and outcomes
in, the scheduler reads. Time comes from an injected clock.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable

from llmgw.breaker import Breaker, BreakerSettings, BreakerState
from llmgw.calibration import Calibration
from llmgw.kvindex import ExactPrefixIndex
from llmgw.types import Endpoint, EngineMetrics, Outcome

Clock = Callable[[], float]

# How fast the share of an engine's first tokens that are this router's requests forgets
# (per scrape; ~20 scrapes, 2 s at the default interval).
_SHARE_DECAY = 0.95
# Scrapes that must see the engine at its peak running with requests waiting before the
# peak counts as its batch size (`EndpointState.peak_is_batch`).
FULL_SCRAPES = 3
# A rise of the peak running count that needs no second scrape to count (`record_scrape`).
PEAK_STEP = 16.0


class PendingPrefill:
    """One request this router sent whose prefill is not known to be over: open until a
    scrape counts it among the engine's first tokens (`Registry.record_scrape`), its first
    token is seen, or the request ends.

    `blind`: an answer asked for whole (`"stream": false`) where the edge sees first
    tokens: its first byte is its last token, so nothing marks its prefill's end. It
    leaves the pending prefill when a request sent there after it shows its first token
    (engines admit in arrival order), or at the first scrape past its predicted first
    token (`ready_at`), else at its end."""

    __slots__ = ("blind", "open", "owed", "ready_at", "sent_at", "tokens")

    def __init__(
        self, tokens: float, blind: bool = False, sent_at: float = 0.0, ready_at: float = 0.0
    ) -> None:
        self.tokens = tokens
        self.open = True
        # Closed by a first token the engine counts at its next scrape: that count is this
        # entry's, not a later open one's (it would close a prefill not even started).
        self.owed = False
        self.blind = blind
        self.sent_at = sent_at
        self.ready_at = ready_at


class EndpointState:
    """Mutable live state of one endpoint (owned by the Registry)."""

    __slots__ = (
        "blind",
        "breaker",
        "busy_until",
        "calibration",
        "counted_prefill",
        "counters",
        "counts_first_tokens",
        "endpoint",
        "full_at_peak",
        "id",
        "inflight",
        "metrics",
        "misses_first_tokens",
        "peak_is_batch",
        "peak_running",
        "pending_prefill",
        "prefills",
        "released_since_scrape",
        "remote_busy_at",
        "remote_inflight",
        "remote_pending",
        "reports_first_token",
        "restarts",
        "scrape_error",
        "scraped_at",
        "serves_model",
        "share_engine",
        "share_sent",
        "token_at",
        "warming",
        "warming_since",
    )

    def __init__(self, endpoint: Endpoint, breaker: BreakerSettings) -> None:
        self.endpoint = endpoint
        self.id = endpoint.address  # an attribute, not a property: read per endpoint per pick
        self.inflight = 0
        # What the other router replicas (`peers:`) report in flight here and their prefill
        # tokens queued here (the sums over peers; `llmgw.runtime.peers.RemoteLoad`).
        self.remote_inflight = 0
        self.remote_pending = 0.0
        # When a peer last reported a request in flight here, or that its last one ended
        # (registry clock): the on-demand idle timer counts a peer's request that began and
        # ended between two of its checks.
        self.remote_busy_at = float("-inf")
        # When the edge last relayed a token of a stream from this engine (the registry
        # clock): every running sequence gets one at the end of each engine step, so a
        # request sent now starts when the step that began then ends (`Lease.token`).
        self.token_at = float("-inf")
        # Requests this router saw end since the last scrape: the engine's counts still
        # include them until the next scrape (a replica that just answered looks busy).
        self.released_since_scrape = 0
        self.metrics: EngineMetrics | None = None
        self.scraped_at = float("-inf")
        self.scrape_error: str | None = None
        self.serves_model: bool | None = None  # None: not known yet
        self.breaker = Breaker(breaker)
        # The most requests the engine was seen running at once (a far higher reading on two
        # scrapes in a row: `Registry.record_scrape`): its batch size as far as anyone can
        # tell from outside (vLLM does not export max_num_seqs). Beyond it, requests wait
        # for a slot: one frees every `service / slots` seconds.
        self.peak_running = 0.0
        # Whether that peak is the batch size: the engine was seen running at it with
        # requests waiting on `FULL_SCRAPES` scrapes since it last rose (`full_at_peak`).
        # A request waits in the queue until the next step even with slots free, so one
        # such scrape proves nothing; early in a run the peak is low, and taking it for the
        # batch then made every replica look full (TTFT p90 1.5-12x worse, 4 engines x 4
        # cells, bench/fleetsim_robust.py).
        self.full_at_peak = 0
        self.peak_is_batch = False
        self.calibration = Calibration()
        # When the prefill work this router sent here would be done (fluid model, seconds
        # on the registry clock): the latency scorer's queue estimate for its own traffic.
        self.busy_until = float("-inf")
        # Prompt tokens sent here whose first token has not come back yet: the exact queue
        # of prefill work, where the edge reports first tokens (`reports_first_token`).
        self.pending_prefill = 0.0
        self.reports_first_token = False
        # Where the edge does not see first tokens (Envoy without response bodies), the
        # engine's time-to-first-token histogram counts them: each scrape closes as many of
        # the oldest open prefills as first tokens came since the last one (this router's
        # share of them); `counted_prefill` is the tokens left open, as of the last scrape.
        # The latency scorer uses it (`counts_first_tokens`) once the engine published a
        # count and a request here ended with no first token seen (`misses_first_tokens`).
        self.prefills: deque[PendingPrefill] = deque()
        self.counted_prefill = 0.0
        self.counts_first_tokens = False
        self.misses_first_tokens = False
        # Where the edge sees first tokens: unstreamed requests' prefills (`blind`), in the
        # order sent; part of `pending_prefill` while open.
        self.blind: deque[PendingPrefill] = deque()
        # This router's requests and the engine's first tokens over recent scrapes (decayed):
        # other routers and direct clients take their part of the count.
        self.share_sent = 0.0
        self.share_engine = 0.0
        # Added to a running model and not scraped yet: takes a bounded share until then,
        # or until its scrapes have failed for the staleness window (an engine without
        # /metrics was capped for good, where the replicas there at start never were).
        self.warming = False
        self.warming_since = 0.0
        # Times a scrape showed the engine's counters back below the last one's: a new
        # process at the same address (a crash, an OOM kill, a container restart).
        self.restarts = 0
        # The cumulative counters' last values seen, kept across pages that lack one: an
        # engine that creates a counter at its first request (SGLang, TRT-LLM) publishes
        # none just after a restart, so the page before is no witness.
        self.counters: tuple[float | None, ...] = ()

    def fresh_metrics(self, now: float, staleness: float) -> EngineMetrics | None:
        """The last scrape if it is recent enough to trust and no scrape failed since, else None
        (the rule lives in `fresh_metrics_of`, which the scheduler uses for many at once)."""
        return fresh_metrics_of((self,), now, staleness)[self]


def fresh_metrics_of(
    states: Iterable[EndpointState], now: float, staleness: float
) -> dict[EndpointState, EngineMetrics | None]:
    """`fresh_metrics` of many states at once (the same rule, without a call per state)."""
    return {
        s: s.metrics if s.scrape_error is None and now - s.scraped_at <= staleness else None
        for s in states
    }


class Registry:
    def __init__(
        self,
        *,
        breaker: BreakerSettings | None = None,
        staleness: float = 2.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self.clock = clock
        self.staleness = staleness
        self._breaker = breaker or BreakerSettings()
        self._by_model: dict[str, list[EndpointState]] = {}
        self._by_id: dict[tuple[str, str], EndpointState] = {}
        # Endpoints that left with requests in flight: those requests end here (their
        # outcome lands on this state, not on an endpoint that still routes), and an
        # endpoint that comes back (NotReady, then Ready again) gets its state back.
        self._draining: dict[tuple[str, str], EndpointState] = {}
        self._warming: dict[str, int] = {}  # model -> endpoints warming
        # In-flight cap of a warming endpoint; None (no scraper to end the warm-up): off.
        self.warmup_inflight: int | None = None
        self.version = 0  # bumped when any model's endpoint set changes
        # Bumped when a scrape shows an engine restarted (`EndpointState.restarts`): its
        # prefix cache is empty, and each model's router forgets it at its next pick.
        self.restart_epoch = 0
        # What each endpoint's engine reported cached (KV events; empty when none are fed).
        self.kv_index = ExactPrefixIndex()
        # Called with (model, state) after this router's load there changed (a request sent,
        # its first token, its end, a scrape closing prefills): `peers:` tells the others.
        self.on_load: Callable[[str, EndpointState], None] | None = None

    def configure(self, *, breaker: BreakerSettings, staleness: float) -> None:
        """New breaker settings and staleness (a config reload); live state is kept."""
        self._breaker = breaker
        self.staleness = staleness
        # Draining endpoints too: one that comes back returns with its state as it was.
        now = self.clock()
        for state in itertools.chain(self._by_id.values(), self._draining.values()):
            state.breaker.reconfigure(breaker, now)

    def set_endpoints(
        self, model: str, endpoints: Iterable[Endpoint], *, forget: bool = True, fresh: bool = False
    ) -> None:
        """Replace a model's endpoint set, keeping live state of endpoints that stay.

        The one path every source takes (static config and its reloads, on-demand starts,
        Kubernetes discovery). An endpoint added to a model that already has some starts
        warming; one that leaves with requests in flight drains (see `_draining`).
        `forget` False: an endpoint no model lists any more keeps its KV index (a reload
        setting several models calls `forget_unlisted` once all are set). `fresh`: the
        endpoints are new processes (an on-demand start): one at the address of a process
        that left with requests in flight keeps their count but not its breaker (open on
        the crashed process, it refused the new one the control plane had just checked).
        """
        new: list[EndpointState] = []
        current = self._by_model.get(model, [])
        old = {s.id: s for s in current}
        for ep in endpoints:
            state = old.pop(ep.address, None)
            if state is None:
                state = self._draining.pop((model, ep.address), None)
                if state is not None and fresh:
                    state.breaker = Breaker(self._breaker)
            if state is None:
                state = EndpointState(ep, self._breaker)
                state.warming = bool(current)
                state.warming_since = self.clock()
            else:  # same server (say, a new weight): keep its breaker, metrics and inflight
                state.endpoint = ep
            new.append(state)
        for gone in old.values():
            self._by_id.pop((model, gone.id), None)
            # What peers counted there stops counting (it comes back at their next report
            # if the endpoint does).
            gone.remote_inflight, gone.remote_pending = 0, 0.0
            if gone.inflight > 0:
                self._draining[(model, gone.id)] = gone
            # One server may serve several models (a base and its adapters): its cache
            # stays known while another still lists it.
            if forget and not self._listed(gone.id, but=model):
                self.kv_index.forget(gone.id)
        before = [s.id for s in current]
        self._by_model[model] = new
        for s in new:
            self._by_id[(model, s.id)] = s
        self._warming[model] = sum(1 for s in new if s.warming)
        if before != [s.id for s in new]:
            self.version += 1

    def _listed(self, endpoint_id: str, but: str | None = None) -> bool:
        return any((m, endpoint_id) in self._by_id for m in self._by_model if m != but)

    def forget_unlisted(self, endpoint_ids: Iterable[str]) -> None:
        """The KV index forgets those of `endpoint_ids` that no model lists now."""
        for endpoint_id in endpoint_ids:
            if not self._listed(endpoint_id):
                self.kv_index.forget(endpoint_id)

    def warming(self, model: str) -> int:
        """How many of the model's endpoints wait for their first scrape."""
        return self._warming.get(model, 0)

    def draining(self, model: str) -> list[EndpointState]:
        """Endpoints that left the model's set with requests still in flight."""
        return [s for (m, _), s in self._draining.items() if m == model]

    def models(self) -> list[str]:
        return list(self._by_model)

    def states(self, model: str) -> list[EndpointState]:
        return self._by_model.get(model, [])

    def get(self, model: str, endpoint_id: str) -> EndpointState | None:
        return self._by_id.get((model, endpoint_id))

    def all_states(self) -> Iterable[EndpointState]:
        for states in self._by_model.values():
            yield from states

    # -- dispatch accounting -------------------------------------------------------------
    def _live_or_draining(self, model: str, endpoint_id: str) -> EndpointState | None:
        """An endpoint's state, also while it drains (removed, requests still in flight):
        what those requests do is charged there, or its state came back with a prefill
        queued for good when the endpoint did."""
        key = (model, endpoint_id)
        return self._by_id.get(key) or self._draining.get(key)

    def find(self, model: str, endpoint_id: str) -> EndpointState | None:
        """The endpoint's state, live or draining."""
        return self._live_or_draining(model, endpoint_id)

    def acquire(self, model: str, endpoint_id: str) -> int | None:
        """Count a request sent to the endpoint; returns its half-open period's number if
        it is a probe (`Breaker.on_dispatch`), else 0; None: not counted (no such endpoint,
        not even draining: its release must not be charged to one added later there)."""
        # A draining endpoint (a reload removed it) counts too: Envoy may retry on a fallback
        # listed before the reload, and its release is charged there.
        state = self._live_or_draining(model, endpoint_id)
        if state is None:
            return None
        state.inflight += 1
        if self.on_load is not None:
            self.on_load(model, state)
        return state.breaker.on_dispatch()

    def probe_answered(self, model: str, endpoint_id: str, probe: int) -> None:
        """A probe of half-open period `probe` answered well: a success for the breaker,
        its slot freed (`Lease.answered`); its release later carries no probe."""
        state = self._live_or_draining(model, endpoint_id)
        if state is not None:
            state.breaker.record(True, self.clock(), probe=probe)

    def release(
        self,
        model: str,
        endpoint_id: str,
        outcome: Outcome,
        *,
        probe: int = 0,
        prefill_tokens: float = 0.0,
        prefill: PendingPrefill | None = None,
    ) -> None:
        key = (model, endpoint_id)
        state = self._by_id.get(key)
        if state is None:
            state = self._draining.get(key)
            if state is None:
                return  # gone, and nothing else was in flight there
            if state.inflight <= 1:
                del self._draining[key]
        _prefill_over(state, prefill, prefill_tokens)
        now = self.clock()
        state.inflight = max(0, state.inflight - 1)
        state.released_since_scrape += 1
        if self.on_load is not None:
            self.on_load(model, state)
        if outcome is Outcome.CANCELLED or outcome is Outcome.UNKNOWN:  # no verdict
            if probe:
                state.breaker.release_probe(probe)
            return
        state.breaker.record(outcome is Outcome.SUCCESS, now, probe=probe)

    def add_prefill(
        self,
        model: str,
        endpoint_id: str,
        tokens: float,
        *,
        unstreamed: bool = False,
        ready_at: float | None = None,
    ) -> tuple[float, PendingPrefill | None]:
        """A request with `tokens` to prefill was sent there (released at its first token);
        returns the prefill tokens that were pending there before it, and its entry.
        `unstreamed`: its answer comes whole (no first token to see); `ready_at`: when its
        first token is predicted (registry clock)."""
        state = self._by_id.get((model, endpoint_id))
        if state is None:
            return 0.0, None
        out = self._add_prefill(state, tokens, unstreamed, ready_at)
        if self.on_load is not None:
            self.on_load(model, state)
        return out

    def _add_prefill(
        self, state: EndpointState, tokens: float, unstreamed: bool, ready_at: float | None
    ) -> tuple[float, PendingPrefill | None]:
        ahead = state.pending_prefill + state.remote_pending  # peers' queued work too
        state.pending_prefill += tokens
        if state.reports_first_token:  # exact already: nothing for scrapes to count
            if not unstreamed:
                return ahead, None
            now = self.clock()
            entry = PendingPrefill(tokens, True, now, now if ready_at is None else ready_at)
            _drop_ended(state.blind)
            state.blind.append(entry)
            return ahead, entry
        queue = state.prefills
        _drop_ended(queue)
        entry = PendingPrefill(tokens)
        queue.append(entry)
        state.counted_prefill += tokens
        state.share_sent += 1.0
        return ahead, entry

    def first_token(
        self,
        model: str,
        endpoint_id: str,
        ready_at: float,
        prefill_tokens: float = 0.0,
        *,
        observed: bool = True,
        waited: tuple[float, float, float] | None = None,
        prefill: PendingPrefill | None = None,
        sent_at: float | None = None,
        counted: bool = True,
    ) -> None:
        """The request predicted to finish its prefill at `ready_at` produced its first token
        now: its tokens are no longer pending; if it is early, the modelled queue was long.
        Only an `observed` first token (not one inferred at the request's end) says the edge
        reports them, which switches the queue estimate to the pending prefill tokens.
        `counted`: the engine's first-token count will include it (not an error answered)."""
        state = self._live_or_draining(model, endpoint_id)
        if state is None:
            return
        if observed:
            state.reports_first_token = True
            if waited is not None:  # (prefill tokens ahead, its own, seconds to this token)
                state.calibration.saw_first_token(*waited)
            if sent_at is not None and state.blind:
                # Sent before this one, admitted before it: their prefills are over too.
                blind = state.blind
                while blind and blind[0].sent_at <= sent_at:
                    _drop_blind(state, blind.popleft())
        else:
            state.misses_first_tokens = True
        # Owed only to an engine that counts first tokens: else nothing ever settles it.
        counts = state.metrics is not None and state.metrics.ttft_count is not None
        _prefill_over(state, prefill, prefill_tokens, owed=counted and counts)
        _withdraw(state, ready_at, self.clock())
        if self.on_load is not None:
            self.on_load(model, state)

    def prefill_withdrawn(self, model: str, endpoint_id: str, ready_at: float) -> None:
        """A request predicted to finish its prefill at `ready_at` failed there before it
        ran (a fallback takes it): the time-drained queue estimate loses its share."""
        state = self._live_or_draining(model, endpoint_id)
        if state is not None:
            _withdraw(state, ready_at, self.clock())

    def saw_token(self, model: str, endpoint_id: str) -> None:
        """A token of a stream from this endpoint reached the edge: a step ended now."""
        state = self._live_or_draining(model, endpoint_id)
        if state is not None:
            state.token_at = self.clock()

    # -- scrapes -------------------------------------------------------------------------
    def record_scrape(self, model: str, endpoint_id: str, metrics: EngineMetrics) -> None:
        state = self._by_id.get((model, endpoint_id))
        if state is None:
            return
        now = self.clock()
        prev = state.metrics
        count = metrics.ttft_count
        if (
            count is not None
            and not state.reports_first_token
            and prev is not None
            and prev.ttft_count is not None
            and count >= prev.ttft_count  # a restarted engine counts from 0 again
        ):
            _count_first_tokens(state, count - prev.ttft_count)
            state.counts_first_tokens = state.misses_first_tokens
        elif count is not None and prev is not None and prev.ttft_count is not None:
            for entry in state.prefills:  # a restarted engine will not count those first tokens
                entry.owed = False
        if state.blind:
            _drain_blind(state, now)
        restarted = _restarted(state, metrics)
        if restarted:
            # A new engine process: its cache is empty and its batch size may differ.
            state.restarts += 1
            state.peak_running, state.full_at_peak, state.peak_is_batch = 0.0, 0, False
            self.restart_epoch += 1
        # A new peak up to twice the last (and PEAK_STEP more) counts at once. A higher one
        # counts once two scrapes in a row show it (the lower of the two): one glitched
        # reading (a 16-bit underflow: 65535) was its batch until a restart, and that
        # engine, never priced a batch-slot wait again, drew every request. (Two in a row
        # for every rise too kept the peak under a batch a busy engine fills only now and
        # then: it priced slot waits that were not there and moved conversations off their
        # cache, chat-history TTFT p90 1.11x in `bench/fleetsim_regimes.py`.)
        # (Not paired with the last reading of a process that is gone.)
        running, peak = metrics.running, state.peak_running
        if running <= peak + peak + PEAK_STEP:
            held = running
        else:
            held = 0.0 if prev is None or restarted else min(prev.running, running)
        if held > peak:
            state.peak_running = held
            state.full_at_peak, state.peak_is_batch = 0, False
        if metrics.waiting >= 1 and metrics.running == state.peak_running:
            state.full_at_peak += 1
            if state.full_at_peak >= FULL_SCRAPES:
                state.peak_is_batch = True
        state.calibration.on_scrape(metrics, at=now, released=state.released_since_scrape)
        if state.warming:
            self._warmed(model, state)
        state.metrics = metrics
        state.scraped_at = now
        state.released_since_scrape = 0
        state.scrape_error = None
        state.serves_model = True
        if self.on_load is not None:
            self.on_load(model, state)

    def record_scrape_error(
        self, model: str, endpoint_id: str, error: str, *, model_absent: bool = False
    ) -> None:
        """A failed scrape makes the data stale at once; it never touches the breaker."""
        state = self._by_id.get((model, endpoint_id))
        if state is None:
            return
        state.scrape_error = error
        if model_absent:
            state.serves_model = False
        if state.warming and self.clock() - state.warming_since >= self.staleness:
            self._warmed(model, state)  # no first scrape is coming: served as the others
        if self.on_load is not None:  # its queued prefill is no longer told (`own_load`)
            self.on_load(model, state)

    def _warmed(self, model: str, state: EndpointState) -> None:
        state.warming = False
        self._warming[model] = max(0, self._warming.get(model, 0) - 1)

    def breaker_states(self) -> dict[tuple[str, str], BreakerState]:
        now = self.clock()
        out = {}
        for (model, eid), s in self._by_id.items():
            s.breaker.available(now)  # advance open -> half_open for reporting
            out[(model, eid)] = s.breaker.state
        return out


def own_load(state: EndpointState) -> tuple[int, float]:
    """What this router has in flight at the endpoint and its prefill tokens queued there
    as far as it can tell, for its peers: exact where the edge sees first tokens; as of
    the last scrape where the engine counts them, while scrapes succeed (a failed one
    leaves them counting only as requests end, prompts long since decoding); none where
    only time drains the work (that estimate is in seconds of this router's model)."""
    if state.reports_first_token:
        return state.inflight, state.pending_prefill
    if state.counts_first_tokens and state.scrape_error is None:
        return state.inflight, state.counted_prefill
    return state.inflight, 0.0


_MAX_FIRST_TOKENS = 1e7  # first tokens one engine produces between two scrapes, at most


def _count_first_tokens(state: EndpointState, first_tokens: float) -> None:
    """The engine produced `first_tokens` first tokens since the last scrape: close this
    router's share of them among its oldest open prefills there (engines schedule in
    arrival order). The share is this router's requests over the engine's first tokens
    in recent scrapes: 1 where it sends all the traffic (other routers', direct clients'
    requests, or fallbacks sent without a prediction, count there too)."""
    if not 0.0 <= first_tokens <= _MAX_FIRST_TOKENS:  # a counter glitch: no count at all
        return
    state.share_engine = state.share_engine * _SHARE_DECAY + first_tokens
    sent = state.share_sent
    state.share_sent = sent * _SHARE_DECAY
    share = sent / state.share_engine if state.share_engine > sent else 1.0
    close = int(first_tokens * share + 0.5)
    queue = state.prefills
    pending = state.counted_prefill
    while queue:
        entry = queue[0]
        if entry.open or entry.owed:
            if close <= 0:
                break
            if entry.open:
                entry.open = False
                pending -= entry.tokens
            entry.owed = False
            close -= 1
        queue.popleft()
    state.counted_prefill = pending if queue and pending > 0.0 else 0.0


def _close(state: EndpointState, entry: PendingPrefill, owed: bool = False) -> None:
    """A prefill is over before a scrape counted it (its first token seen, or it ended);
    `owed`: the engine's next count includes its first token."""
    if entry.open:
        entry.open = False
        entry.owed = owed
        left = state.counted_prefill - entry.tokens
        state.counted_prefill = left if left > 0.0 else 0.0


_MAX_OWED = 4096  # entries kept for the engine's next count (scrapes failing for long)


def _drop_ended(queue: deque[PendingPrefill]) -> None:
    """Ended entries at the head leave, but those the engine's next count includes wait for
    it: the queue stays bounded by the requests in flight and one scrape's first tokens."""
    while queue and not queue[0].open and (not queue[0].owed or len(queue) > _MAX_OWED):
        queue.popleft()


def _withdraw(state: EndpointState, ready_at: float, now: float) -> None:
    """The time-drained queue estimate (`busy_until`) loses what is left of a prefill
    predicted to end at `ready_at`: it ended, or will never run there."""
    if ready_at > now:
        state.busy_until = max(now, state.busy_until - (ready_at - now))


def _prefill_over(
    state: EndpointState, prefill: PendingPrefill | None, tokens: float, owed: bool = False
) -> None:
    """A request's prefill is over (its first token, or its end): it leaves whichever
    estimate holds it, once; `owed`: the engine counts its first token."""
    if prefill is not None and prefill.blind:
        _drop_blind(state, prefill)
        return
    if tokens:
        state.pending_prefill = max(0.0, state.pending_prefill - tokens)
    if prefill is not None:
        _close(state, prefill, owed)


def _drop_blind(state: EndpointState, entry: PendingPrefill) -> None:
    """An unstreamed request's prefill is taken as over: it leaves the pending prefill."""
    if entry.open:
        entry.open = False
        left = state.pending_prefill - entry.tokens
        state.pending_prefill = left if left > 0.0 else 0.0


def _drain_blind(state: EndpointState, now: float) -> None:
    """At a scrape: unstreamed prefills past their predicted first token are over (no
    event will say so before their answers end, seconds later)."""
    kept: deque[PendingPrefill] = deque()
    for entry in state.blind:
        if entry.open and entry.ready_at <= now:
            _drop_blind(state, entry)
        if entry.open:
            kept.append(entry)
    state.blind = kept


def _restarted(state: EndpointState, new: EngineMetrics) -> bool:
    """Whether a cumulative counter went back below its last value seen: the engine
    started counting from 0 again. Updates the values seen (after a restart, only this
    page's: a counter it lacks starts afresh)."""
    counters = (
        new.finished_total,
        new.prompt_tokens_total,
        new.ttft_count,
        new.prefill_count,
        new.step_count,
    )
    seen = state.counters or (None,) * len(counters)
    went_back = any(
        a is not None and b is not None and b < a for a, b in zip(seen, counters, strict=True)
    )
    state.counters = (
        counters
        if went_back
        else tuple(a if b is None else b for a, b in zip(seen, counters, strict=True))
    )
    return went_back
