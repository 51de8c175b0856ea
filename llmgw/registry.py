"""Endpoints per model and what is known about each: inflight, metrics, staleness, breaker.

Pure bookkeeping: the runtime feeds scrapes in, the edges feed dispatches and outcomes
in, the scheduler reads. Time comes from an injected clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from llmgw.breaker import Breaker, BreakerSettings, BreakerState
from llmgw.calibration import Calibration
from llmgw.kvindex import ExactPrefixIndex
from llmgw.types import Endpoint, EngineMetrics, Outcome

Clock = Callable[[], float]


class EndpointState:
    """Mutable live state of one endpoint (owned by the Registry)."""

    __slots__ = (
        "_prev_finished",
        "breaker",
        "busy_until",
        "calibration",
        "counter_drain_rate",
        "endpoint",
        "id",
        "inflight",
        "metrics",
        "pending_prefill",
        "released_since_scrape",
        "reports_first_token",
        "scrape_error",
        "scraped_at",
        "serves_model",
    )

    def __init__(self, endpoint: Endpoint, breaker: BreakerSettings) -> None:
        self.endpoint = endpoint
        self.id = endpoint.address  # an attribute, not a property: read per endpoint per pick
        self.inflight = 0
        # Requests this router saw end since the last scrape: the engine's counts still
        # include them until the next scrape (a replica that just answered looks busy).
        self.released_since_scrape = 0
        self.metrics: EngineMetrics | None = None
        self.scraped_at = float("-inf")
        self.scrape_error: str | None = None
        self.serves_model: bool | None = None  # None: not known yet
        self.breaker = Breaker(breaker)
        self._prev_finished: tuple[float, float] | None = None
        self.counter_drain_rate: float | None = None
        self.calibration = Calibration()
        # When the prefill work this router sent here would be done (fluid model, seconds
        # on the registry clock): the latency scorer's queue estimate for its own traffic.
        self.busy_until = float("-inf")
        # Prompt tokens sent here whose first token has not come back yet: the exact queue
        # of prefill work, where the edge reports first tokens (`reports_first_token`).
        self.pending_prefill = 0.0
        self.reports_first_token = False

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
        self.version = 0  # bumped when any model's endpoint set changes
        # What each endpoint's engine reported cached (KV events; empty when none are fed).
        self.kv_index = ExactPrefixIndex()

    def configure(self, *, breaker: BreakerSettings, staleness: float) -> None:
        """New breaker settings and staleness (a config reload); live state is kept."""
        self._breaker = breaker
        self.staleness = staleness
        for state in self._by_id.values():
            state.breaker.settings = breaker

    def set_endpoints(self, model: str, endpoints: Iterable[Endpoint]) -> None:
        """Replace a model's endpoint set, keeping live state of endpoints that stay."""
        new: list[EndpointState] = []
        old = {s.id: s for s in self._by_model.get(model, [])}
        for ep in endpoints:
            state = old.pop(ep.address, None)
            if state is None:
                state = EndpointState(ep, self._breaker)
            else:  # same server (say, a new weight): keep its breaker, metrics and inflight
                state.endpoint = ep
            new.append(state)
        for gone in old.values():
            self._by_id.pop((model, gone.id), None)
            self.kv_index.forget(gone.id)
        before = [s.id for s in self._by_model.get(model, [])]
        self._by_model[model] = new
        for s in new:
            self._by_id[(model, s.id)] = s
        if before != [s.id for s in new]:
            self.version += 1

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
    def acquire(self, model: str, endpoint_id: str) -> bool:
        """Count a request sent to the endpoint; returns True if it is a half-open probe."""
        state = self._by_id.get((model, endpoint_id))
        if state is None:
            return False
        state.inflight += 1
        return state.breaker.on_dispatch()

    def release(
        self,
        model: str,
        endpoint_id: str,
        outcome: Outcome,
        *,
        probe: bool = False,
        prefill_tokens: float = 0.0,
    ) -> None:
        state = self._by_id.get((model, endpoint_id))
        if state is None:
            return  # the endpoint left the set while the request was in flight
        if prefill_tokens:
            state.pending_prefill = max(0.0, state.pending_prefill - prefill_tokens)
        now = self.clock()
        state.inflight = max(0, state.inflight - 1)
        state.released_since_scrape += 1
        if outcome is Outcome.CANCELLED:
            if probe:
                state.breaker.release_probe()
            return
        state.breaker.record(outcome is Outcome.SUCCESS, now, probe=probe)

    def add_prefill(self, model: str, endpoint_id: str, tokens: float) -> None:
        """A request with `tokens` to prefill was sent there (released at its first token)."""
        state = self._by_id.get((model, endpoint_id))
        if state is not None:
            state.pending_prefill += tokens

    def first_token(
        self, model: str, endpoint_id: str, ready_at: float, prefill_tokens: float = 0.0
    ) -> None:
        """The request predicted to finish its prefill at `ready_at` produced its first token
        now: its tokens are no longer pending; if it is early, the modelled queue was long."""
        state = self._by_id.get((model, endpoint_id))
        if state is None:
            return
        state.reports_first_token = True
        state.pending_prefill = max(0.0, state.pending_prefill - prefill_tokens)
        now = self.clock()
        if ready_at > now:
            state.busy_until = max(now, state.busy_until - (ready_at - now))

    # -- scrapes -------------------------------------------------------------------------
    def record_scrape(self, model: str, endpoint_id: str, metrics: EngineMetrics) -> None:
        state = self._by_id.get((model, endpoint_id))
        if state is None:
            return
        now = self.clock()
        if metrics.finished_total is not None and state._prev_finished is not None:
            prev_t, prev_v = state._prev_finished
            if now > prev_t and metrics.finished_total >= prev_v:
                state.counter_drain_rate = (metrics.finished_total - prev_v) / (now - prev_t)
        if metrics.finished_total is not None:
            state._prev_finished = (now, metrics.finished_total)
        state.calibration.on_scrape(metrics)
        state.metrics = metrics
        state.scraped_at = now
        state.released_since_scrape = 0
        state.scrape_error = None
        state.serves_model = True

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

    def breaker_states(self) -> dict[tuple[str, str], BreakerState]:
        now = self.clock()
        out = {}
        for (model, eid), s in self._by_id.items():
            s.breaker.available(now)  # advance open -> half_open for reporting
            out[(model, eid)] = s.breaker.state
        return out
