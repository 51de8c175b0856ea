"""Prometheus metrics of one router process, shared by both edges (ext_proc and ASGI).

Usage::

    telemetry = Telemetry()
    telemetry.bind(scheduler.registry, scraper)      # gauges read at scrape time
    telemetry.decision(decision)                     # one routing decision
    telemetry.error(exc)                             # an LlmgwError answered to a client
    telemetry.stage("parse", seconds)                # parse | schedule | total
    body, content_type = telemetry.render()          # the /metrics page

Series (prefix `llmgw_`):
- `decisions_total{model,endpoint,reason}`: `reason` is `decision_reason()` (the scorer
  that gave the chosen endpoint its lead over the runner-up, else the picker's name).
- `errors_total{code,status}`: errors answered to clients, by the error's stable code.
- `stage_seconds{stage}` histogram: `parse` (headers/body -> RequestInfo), `schedule`
  (pick + acquire), `total` (first message of a request to its routing answer).
- `outcomes_total{model,endpoint,outcome}`: how dispatched requests ended.
- `kv_index_blocks{endpoint}`, `kv_events_live{endpoint}` (1 live, 0 unknown),
  `kv_event_gaps_total{endpoint}`, `kv_event_lag_seconds{endpoint}`: the exact prefix
  index, for endpoints whose engines publish KV events.
- `inflight{model,endpoint}`, `breaker_state{model,endpoint,state}` (1 for the current
  state), `metrics_age_seconds{model,endpoint}`, `prefix_hits_confirmed{model,endpoint}`
  (the engine's share of prompt tokens found cached over the one the latency scorer's
  index predicted there), `endpoint_slowdown{model,endpoint}` (how many times slower the
  engine runs than the model's fastest, `llmgw.calibration.slowdowns`, or by this router's
  own first tokens where engines publish no speed; the latency scorer prices it so from
  its `speed_band`, 1.5), `scrape_errors_total{endpoint}`: read
  from the Registry (and the Scraper, if bound) when /metrics is scraped, so the hot
  path pays nothing for them.
- `discovery_stale_seconds{model}`: seconds a Kubernetes-discovered model has been routed
  on its last known endpoints without reaching the API (0: current), when bound.
- `model_state{model,state}` (1 for the current state), `model_starts_total{model}`,
  `model_last_start_seconds{model}` (the last cold start): on-demand models, if bound.
- `peers`, `peer_records_sent_total`, `peer_records_received_total`,
  `peer_load_updates_sent_total`, `peer_load_updates_received_total`,
  `peer_inflight{model,endpoint}`, `peer_queued_prefill_tokens{model,endpoint}`,
  `peer_dropped_total{reason}`: router replicas sharing what they route and their load
  (`peers:`).

Every instance has its own `CollectorRegistry`, so tests and several servers in one
process do not collide. Labelled children are cached: the hot path is a dict lookup
and an increment.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from llmgw.breaker import BreakerState
from llmgw.calibration import hits_confirmed, slowdowns
from llmgw.errors import LlmgwError
from llmgw.lifecycle import Hooks
from llmgw.registry import Registry
from llmgw.types import Decision, Outcome

if TYPE_CHECKING:
    from llmgw.runtime.peers import PeerStats

STAGES = ("parse", "schedule", "total")
# 50 µs .. 1 s: ext_proc work is sub-millisecond; the tail matters.
_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)
# vLLM's time-to-first-token buckets (seconds), so the two histograms line up.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
# Symmetric around 0: under- and over-prediction, from 5 ms to 10 s either way.
_ERROR_BUCKETS = tuple(
    [-x for x in (10.0, 2.5, 1.0, 0.5, 0.25, 0.1, 0.05, 0.025, 0.005)]
    + [0.0, 0.005, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0]
)


class DiscoveryStaleness(Protocol):
    """What telemetry reads from Kubernetes discovery: seconds without the API per model."""

    def staleness(self) -> Mapping[str, float]: ...


class ScrapeCounts(Protocol):
    """What telemetry reads from a scraper: failed scrapes per address."""

    @property
    def errors(self) -> Mapping[str, int]: ...


def decision_reason(decision: Decision) -> str:
    """What made the difference, in one word: the scorer with the largest weighted lead of
    the chosen endpoint over the best other candidate (`session` = affinity, `prefix` =
    cached prompt, `queue`/`kv`/... = load). The picker's name when nothing was scored,
    when it was the only candidate, or when no scorer favoured it (a tie, or a sampling
    picker's choice)."""
    rationale = decision.rationale
    ids = rationale.endpoint_ids
    if not rationale.columns or len(ids) < 2 or decision.endpoint.id not in ids:
        return rationale.picker
    chosen = ids.index(decision.endpoint.id)
    totals = rationale.totals
    runner_up = max((i for i in range(len(ids)) if i != chosen), key=lambda i: totals[i])
    if totals[chosen] < totals[runner_up]:  # a sampling picker's draw, against the scores
        return rationale.picker
    best, best_lead = rationale.picker, 1e-9
    for column in rationale.columns:
        lead = (column.raw[chosen] - column.raw[runner_up]) * column.weight
        if lead > best_lead:
            best, best_lead = column.name, lead
    return best


ModelsStatus = Callable[[], Mapping[str, Mapping[str, object]]]
PeersStatus = Callable[[], "PeerStats | None"]
_MODEL_STATES = ("off", "starting", "ready", "idle", "failed")


class _RegistryCollector(Collector):
    """Gauges read from the live Registry (and scrape errors from the Scraper, on-demand
    model states from the activator) at collect."""

    def __init__(
        self,
        registry: Registry,
        scraper: ScrapeCounts | None,
        prefix: str,
        discovery: DiscoveryStaleness | None = None,
        models: ModelsStatus | None = None,
        peers: PeersStatus | None = None,
    ) -> None:
        self.registry = registry
        self.scraper = scraper
        self.prefix = prefix
        self.discovery = discovery
        self.models = models
        self.peers = peers

    def collect(self) -> Iterable[Metric]:
        p = self.prefix
        inflight = GaugeMetricFamily(
            f"{p}_inflight", "Requests in flight per endpoint", labels=["model", "endpoint"]
        )
        breaker = GaugeMetricFamily(
            f"{p}_breaker_state",
            "Circuit breaker state per endpoint (1 = current state)",
            labels=["model", "endpoint", "state"],
        )
        age = GaugeMetricFamily(
            f"{p}_metrics_age_seconds",
            "Seconds since the endpoint's last good /metrics scrape (+Inf: never)",
            labels=["model", "endpoint"],
        )
        confirmed = GaugeMetricFamily(
            f"{p}_prefix_hits_confirmed",
            "The engine's share of prompt tokens found cached over the share this router's "
            "index predicted there (recent requests; below 1: the index counts blocks the "
            "engine evicted)",
            labels=["model", "endpoint"],
        )
        slowdown = GaugeMetricFamily(
            f"{p}_endpoint_slowdown",
            "How many times slower the endpoint's engine runs than the model's fastest (its "
            "step and its prefill seconds per token, the lesser; where engines publish "
            "neither, this router's first tokens from there, 1 below 1.7x)",
            labels=["model", "endpoint"],
        )
        now = self.registry.clock()
        states = self.registry.breaker_states()
        for model in self.registry.models():
            found = slowdowns((s.id, s.calibration) for s in self.registry.states(model))
            for eid, slow in sorted(found.items()):
                slowdown.add_metric([model, eid], slow)
        for state in self.registry.all_states():
            model, eid = state.endpoint.model, state.id
            inflight.add_metric([model, eid], state.inflight)
            current = states.get((model, eid), BreakerState.CLOSED)
            for s in BreakerState:
                breaker.add_metric([model, eid, s.value], 1.0 if s is current else 0.0)
            scraped = state.scraped_at
            age.add_metric([model, eid], now - scraped if math.isfinite(scraped) else math.inf)
            confirmed_share = hits_confirmed(state.calibration)
            if confirmed_share is not None:
                confirmed.add_metric([model, eid], confirmed_share)
        for model in self.registry.models():  # left the set with requests still running
            for state in self.registry.draining(model):
                inflight.add_metric([model, state.id], state.inflight)
        yield inflight
        yield breaker
        yield age
        yield confirmed
        yield slowdown
        errors = CounterMetricFamily(
            f"{p}_scrape_errors",
            "Failed /metrics scrapes per endpoint address",
            labels=["endpoint"],
        )
        if self.scraper is not None:
            for address, count in sorted(self.scraper.errors.items()):
                errors.add_metric([address], count)
        yield errors
        if self.discovery is not None:
            stale = GaugeMetricFamily(
                f"{p}_discovery_stale_seconds",
                "Seconds a discovered model's endpoints have gone without the Kubernetes API "
                "(0: current)",
                labels=["model"],
            )
            for model, seconds in sorted(self.discovery.staleness().items()):
                stale.add_metric([model], seconds)
            yield stale
        yield from self._on_demand()
        yield from self._kv()
        yield from self._peers()

    def _on_demand(self) -> Iterable[Metric]:
        p = self.prefix
        state = GaugeMetricFamily(
            f"{p}_model_state",
            "On-demand model state (1 = current): off, starting, ready, idle, failed",
            labels=["model", "state"],
        )
        starts = CounterMetricFamily(
            f"{p}_model_starts", "Starts of an on-demand model", labels=["model"]
        )
        cold = GaugeMetricFamily(
            f"{p}_model_last_start_seconds",
            "How long the last start of an on-demand model took (cold start)",
            labels=["model"],
        )
        for model, status in sorted((self.models() if self.models else {}).items()):
            current = status.get("state")
            if current is None:  # a discovered model: no on-demand state to export
                continue
            for name in _MODEL_STATES:
                state.add_metric([model, name], 1.0 if name == current else 0.0)
            count = status.get("starts")
            if isinstance(count, int | float):
                starts.add_metric([model], float(count))
            seconds = status.get("last_start_seconds")
            if isinstance(seconds, int | float):
                cold.add_metric([model], float(seconds))
        yield state
        yield starts
        yield cold

    def _kv(self) -> Iterable[Metric]:
        endpoints = self.registry.kv_index.endpoints()
        if not endpoints:
            return
        p = self.prefix
        blocks = GaugeMetricFamily(
            f"{p}_kv_index_blocks", "Blocks the engine reported cached", labels=["endpoint"]
        )
        live = GaugeMetricFamily(
            f"{p}_kv_events_live",
            "1: the endpoint's KV-event stream is complete (exact matching); 0: unknown",
            labels=["endpoint"],
        )
        gaps = CounterMetricFamily(
            f"{p}_kv_event_gaps", "Sequence gaps not filled by replay", labels=["endpoint"]
        )
        lag = GaugeMetricFamily(
            f"{p}_kv_event_lag_seconds",
            "Last KV-event batch: receive time - engine timestamp",
            labels=["endpoint"],
        )
        for eid, e in sorted(endpoints.items()):
            blocks.add_metric([eid], len(e.blocks))
            live.add_metric([eid], 1.0 if e.state == "live" else 0.0)
            gaps.add_metric([eid], e.gaps)
            lag.add_metric([eid], e.lag_s)
        yield from (blocks, live, gaps, lag)

    def _peers(self) -> Iterable[Metric]:
        stats = self.peers() if self.peers is not None else None
        if stats is None:
            return
        p = self.prefix
        yield GaugeMetricFamily(f"{p}_peers", "Peer router replicas sent to", value=stats.peers)
        yield CounterMetricFamily(
            f"{p}_peer_records_sent", "Prefix-index inserts sent to peers", value=stats.sent
        )
        yield CounterMetricFamily(
            f"{p}_peer_records_received",
            "Peers' prefix-index inserts applied here",
            value=stats.received,
        )
        yield CounterMetricFamily(
            f"{p}_peer_load_updates_sent",
            "Load updates sent to peers (one endpoint's in flight and queued prefill)",
            value=stats.load_sent,
        )
        yield CounterMetricFamily(
            f"{p}_peer_load_updates_received",
            "Peers' load updates taken here",
            value=stats.load_received,
        )
        inflight = GaugeMetricFamily(
            f"{p}_peer_inflight",
            "Requests the peers report in flight per endpoint",
            labels=["model", "endpoint"],
        )
        queued = GaugeMetricFamily(
            f"{p}_peer_queued_prefill_tokens",
            "Prefill tokens the peers report queued per endpoint",
            labels=["model", "endpoint"],
        )
        for model in sorted(self.registry.models()):
            for state in self.registry.states(model):
                inflight.add_metric([model, state.id], state.remote_inflight)
                queued.add_metric([model, state.id], state.remote_pending)
        yield inflight
        yield queued
        dropped = CounterMetricFamily(
            f"{p}_peer_dropped",
            "Peer datagrams or records not applied or not sent (unknown_sender, malformed, "
            "unauthenticated, unknown_endpoint, no_index, stale_sender, replayed, send_error, "
            "overflow, send_buffer_full)",
            labels=["reason"],
        )
        for reason, n in sorted(stats.dropped.items()):
            dropped.add_metric([reason], n)
        yield dropped


class Telemetry:
    def __init__(self, prefix: str = "llmgw") -> None:
        self.prefix = prefix
        self.registry = CollectorRegistry(auto_describe=True)
        self._decisions = Counter(
            f"{prefix}_decisions",
            "Routing decisions by model, chosen endpoint and reason",
            ["model", "endpoint", "reason"],
            registry=self.registry,
        )
        self._errors = Counter(
            f"{prefix}_errors",
            "Errors answered to clients by stable code and HTTP status",
            ["code", "status"],
            registry=self.registry,
        )
        self._outcomes = Counter(
            f"{prefix}_outcomes",
            "How each attempt of a dispatched request ended, per endpoint, as the breaker "
            "reads them (a request that fell back counts once per endpoint tried; an "
            "engine's 4xx answer is a success: the engine worked; 429/503 backpressure)",
            ["model", "endpoint", "outcome"],
            registry=self.registry,
        )
        self._requests = Counter(
            f"{prefix}_requests",
            "Dispatched requests by model and how they ended (once per request, whichever "
            "endpoint answered; refused ones are in errors_total)",
            ["model", "outcome"],
            registry=self.registry,
        )
        self._stages = Histogram(
            f"{prefix}_stage_seconds",
            "Time spent per routing stage (parse, schedule, total)",
            ["stage"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self._stage_children = {s: self._stages.labels(s) for s in STAGES}
        # Time to the first response byte as the edge saw it, and how far the latency
        # model's prediction was off (observed - predicted): an operator sees drift here.
        self._ttft = Histogram(
            f"{prefix}_ttft_observed_seconds",
            "Time from dispatch to the first response body byte, per model (from the first "
            "attempt: a fallback's includes the time lost on the endpoints before it)",
            ["model"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self._ttft_error = Histogram(
            f"{prefix}_ttft_prediction_error_seconds",
            "Observed minus predicted time to first token (latency scorer), per model",
            ["model"],
            buckets=_ERROR_BUCKETS,
            registry=self.registry,
        )
        # The prediction itself (non-negative: Prometheus exports no _sum for a histogram
        # with negative buckets, so the error's sum cannot give the predicted mean).
        self._ttft_predicted = Histogram(
            f"{prefix}_ttft_predicted_seconds",
            "Predicted time to first token (latency scorer) of the requests timed in "
            f"{prefix}_ttft_prediction_error_seconds, per model",
            ["model"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self._decision_children: dict[tuple[str, str, str], Counter] = {}
        self._outcome_children: dict[tuple[str, str, str], Counter] = {}
        # Counted since the last render: a departed endpoint's series goes only at a
        # render that has shown its last count (an outcome is told after its lease ends,
        # which ends the drain: a dying engine's last failures were dropped unseen).
        self._unrendered: set[tuple[str, str, str]] = set()
        self._collector: _RegistryCollector | None = None
        self._bound: Registry | None = None

    def bind(
        self,
        registry: Registry,
        scraper: ScrapeCounts | None = None,
        discovery: DiscoveryStaleness | None = None,
        models: ModelsStatus | None = None,
        peers: PeersStatus | None = None,
    ) -> None:
        """Export inflight, breaker states, metrics age and scrape errors of `registry`, the
        staleness of Kubernetes discovery and the on-demand models' states and cold starts
        from `models` (`Router.models_status`), when given."""
        if self._collector is not None:
            self.registry.unregister(self._collector)
        self._collector = _RegistryCollector(
            registry, scraper, self.prefix, discovery=discovery, models=models, peers=peers
        )
        self.registry.register(self._collector)
        self._bound = registry

    def decision(self, decision: Decision) -> str:
        """Count one decision; returns its reason (see `decision_reason`)."""
        reason = decision_reason(decision)
        key = (decision.model, decision.endpoint.id, reason)
        child = self._decision_children.get(key)
        if child is None:
            child = self._decision_children[key] = self._decisions.labels(*key)
        child.inc()
        self._unrendered.add(key)
        return reason

    def outcome(self, model: str, endpoint_id: str, outcome: Outcome) -> None:
        key = (model, endpoint_id, outcome.value)
        child = self._outcome_children.get(key)
        if child is None:
            child = self._outcome_children[key] = self._outcomes.labels(*key)
        child.inc()
        self._unrendered.add(key)

    def ended(self, model: str, outcome: Outcome) -> None:
        self._requests.labels(model, outcome.value).inc()

    def error(self, error: LlmgwError) -> None:
        self._errors.labels(error.code, str(error.status)).inc()

    def hooks(self, edge: str) -> Hooks:
        """What a request's Lifecycle reports here; `edge` names it in decision logs."""
        return Hooks(
            edge,
            decision=lambda decision, _request_id: self.decision(decision),
            error=self.error,
            outcome=self.outcome,
            stage=self.stage,
            ttft=self.ttft,
            ended=self.ended,
        )

    def ttft(self, model: str, observed: float, predicted: float | None) -> None:
        self._ttft.labels(model).observe(observed)
        if predicted is not None and math.isfinite(predicted):
            self._ttft_error.labels(model).observe(observed - predicted)
            self._ttft_predicted.labels(model).observe(predicted)

    def stage(self, stage: str, seconds: float) -> None:
        """Observe one stage duration; `stage` is one of STAGES."""
        self._stage_children[stage].observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        self._forget_departed()
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def _forget_departed(self) -> None:
        """Drop the per-endpoint counters of endpoints gone from the registry (and done
        draining): with pods coming and going under new IPs, each kept its series forever
        (300 rollouts of 2 pods: 600 outcome series, 150 KB a scrape)."""
        registry = self._bound
        unrendered, self._unrendered = self._unrendered, set()
        if registry is None:
            return
        for children, family in (
            (self._decision_children, self._decisions),
            (self._outcome_children, self._outcomes),
        ):
            for key in [k for k in children if registry.get(k[0], k[1]) is None]:
                model, endpoint_id = key[0], key[1]
                if key in unrendered or any(d.id == endpoint_id for d in registry.draining(model)):
                    continue  # (counted since the last render: shown this once, then gone)
                del children[key]
                family.remove(*key)
