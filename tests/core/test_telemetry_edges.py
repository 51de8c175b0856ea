"""The registry's warm-up and the metrics the router exports at their edges: a replica
whose scrapes fail is not capped for good, a departed endpoint's last outcomes are shown
once before its series goes, and a request that waited for an on-demand start is timed."""

from __future__ import annotations

from llmgw.config import load_dict
from llmgw.gateway import Gateway
from llmgw.lifecycle import Lifecycle
from llmgw.registry import Registry
from llmgw.runtime.telemetry import Telemetry
from llmgw.scheduling.scheduler import Scheduler
from llmgw.types import Decision, Endpoint, RequestInfo

from .helpers import FakeClock
from .test_lifecycle import gateway as lifecycle_gateway

M = "m"
A, B = "10.0.0.1:8000", "10.0.0.2:8000"
CHAT = "/v1/chat/completions"


def _eps(*addresses: str) -> list[Endpoint]:
    return [Endpoint(address=a, model=M, pool=M) for a in addresses]


def test_a_replica_whose_scrapes_fail_is_not_capped_by_the_warm_up_for_ever() -> None:
    """A replica added to a running model takes at most `warmup_inflight` requests "until
    its first scrape"; only a *successful* scrape ends that. A replica whose /metrics keeps
    failing (SGLang without --enable-metrics, a 500, a NetworkPolicy) stays capped at 2 in
    flight for as long as it runs, while the replicas that were there at start, failing
    their scrapes just the same, take any load: the README's "/metrics 500: stale but still
    served" holds for those only. Here B's scrapes fail for ten minutes and it is still
    passed over at 2 in flight."""
    clock = FakeClock()
    config = load_dict({"models": {M: {"endpoints": [A], "strategy": "ring"}}})
    sched = Scheduler(config, Registry(clock=clock), seed=1)
    reg = sched.registry
    reg.warmup_inflight = 2  # what Router sets when it scrapes (the default config)
    reg.set_endpoints(M, _eps(A, B))  # a pod added by discovery / a reload
    for _ in range(600):  # ten minutes of failed scrapes of both replicas
        clock.advance(1.0)
        reg.record_scrape_error(M, A, "scrape failed: /metrics answered HTTP 404")
        reg.record_scrape_error(M, B, "scrape failed: /metrics answered HTTP 404")
    homed_on_b = [  # sessions whose ring home is B (nothing in flight yet: no cap)
        s
        for s in (f"s{i}" for i in range(200))
        if sched.pick(RequestInfo(model=M, request_id=s, session_key=s)).endpoint.id == B
    ]
    for _ in range(2):
        reg.acquire(M, B)
    for _ in range(8):
        reg.acquire(M, A)  # A has 8 in flight, B 2
    picks = [sched.pick(RequestInfo(model=M, request_id=s, session_key=s)) for s in homed_on_b[:5]]
    assert homed_on_b, "some sessions' ring home is B"
    assert all(d.endpoint.id == B for d in picks), [d.rationale.filter_drops for d in picks]


def _gateway() -> tuple[Gateway, Telemetry]:
    config = load_dict({"models": {M: {"endpoints": [A, B], "strategy": "ring"}}})
    gateway = Gateway(Scheduler(config, Registry(clock=FakeClock()), seed=1))
    telemetry = Telemetry()
    telemetry.bind(gateway.scheduler.registry)
    return gateway, telemetry


def test_the_outcome_of_a_draining_endpoints_last_request_reaches_metrics() -> None:
    """`_forget_departed` keeps a departed endpoint's counters while it drains, but the
    lifecycle reports the outcome *after* the lease is released, and that release ends the
    draining: the very next /metrics drops the series before it was ever exported with that
    outcome. A pod that turns NotReady (its process dying) with a stream running: the
    stream's failure is counted and removed unseen; `llmgw_outcomes_total` never shows the
    failures of pods that left, which are the ones an operator looks for."""
    gateway, telemetry = _gateway()
    registry = gateway.scheduler.registry
    lifecycle = Lifecycle(gateway, telemetry.hooks("test"))
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    decision = lifecycle.route({"x-session-id": "s1"}, CHAT, body)
    assert isinstance(decision, Decision)
    gone = decision.endpoint.id
    stays = B if gone == A else A
    first = telemetry.render()[0].decode()  # Prometheus scrapes while the request runs
    assert f'endpoint="{gone}"' in first
    registry.set_endpoints(M, _eps(stays))  # its pod turned NotReady: draining
    lifecycle.response(500)  # the dying engine answers 500
    lifecycle.finish()
    sample = telemetry.registry.get_sample_value
    labels = {"model": M, "endpoint": gone, "outcome": "failure"}
    telemetry.render()  # the next scrape
    assert sample("llmgw_outcomes_total", labels) == 1.0, (
        "the failure was counted and dropped before any scrape exported it"
    )


def test_a_request_that_waited_for_an_on_demand_start_is_timed_in_stage_seconds() -> None:
    """`llmgw_stage_seconds{stage="total"}` is "first message of a request to its routing
    answer", but `Lifecycle.activated()` (the pick after an on-demand model's start) times
    no stage at all: the requests whose routing answer took longest (a cold start, tens of
    seconds) are missing from the histogram, whose count also falls short of the requests
    routed. (Its buckets stop at 1 s, so they would land in +Inf; they still belong in its
    count and sum.)"""
    gw, _, activation = lifecycle_gateway(on_demand=True)
    assert activation is not None
    telemetry = Telemetry()
    lifecycle = Lifecycle(gw, telemetry.hooks("test"))
    pending = lifecycle.route({"x-llmgw-model": "lazy"}, CHAT, None)
    assert not isinstance(pending, Decision)  # AwaitActivation: the model starts first
    activation.start()
    assert isinstance(lifecycle.activated(), Decision)
    sample = telemetry.registry.get_sample_value
    assert sample("llmgw_stage_seconds_count", {"stage": "total"}) == 1.0
