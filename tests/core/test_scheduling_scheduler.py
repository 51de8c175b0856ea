"""Scheduler.pick: typed errors, the Decision and its rationale, determinism, affinity."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.breaker import BreakerSettings, BreakerState
from llmgw.errors import (
    LlmgwError,
    ModelDisabled,
    ModelLoading,
    ModelNotFound,
    ModelNotReady,
    NoCapacity,
    NoHealthyEndpoint,
)
from llmgw.hashring import HashRing
from llmgw.registry import EndpointState, Registry
from llmgw.scheduling.interfaces import PickContext
from llmgw.scheduling.scheduler import Scheduler
from llmgw.scheduling.strategies import PRESETS
from llmgw.types import EngineMetrics, Outcome, RequestInfo

from .helpers import FakeClock, config, static_model

ADDRS = [f"10.0.0.{i + 1}:8000" for i in range(5)]


def scheduler(
    models: dict[str, Any] | None = None, *, seed: int = 1, failure_threshold: int = 1
) -> tuple[Scheduler, Registry, FakeClock]:
    cfg = config(models or {"chat": static_model(5)})
    clock = FakeClock()
    reg = Registry(breaker=BreakerSettings(failure_threshold=failure_threshold), clock=clock)
    return Scheduler(cfg, reg, seed=seed), reg, clock


def scrape(reg: Registry, model: str, address: str, waiting: float = 0, kv: float = 0.1) -> None:
    reg.record_scrape(model, address, EngineMetrics(waiting=waiting, running=1, kv_usage=kv))


def trip(reg: Registry, model: str, address: str) -> None:
    reg.acquire(model, address)
    reg.release(model, address, Outcome.FAILURE)
    assert reg.breaker_states()[(model, address)] is BreakerState.OPEN


def req(model: str = "chat", rid: str = "r-1", **kw: Any) -> RequestInfo:
    return RequestInfo(model=model, request_id=rid, **kw)


def expect(
    error: type[LlmgwError], status: int, code: str, sched: Scheduler, request: RequestInfo
) -> LlmgwError:
    with pytest.raises(LlmgwError) as info:
        sched.pick(request)
    assert type(info.value) is error
    assert (info.value.status, info.value.code) == (status, code)
    return info.value


def test_all_endpoints_unhealthy_is_503_no_healthy_endpoint_with_retry_after() -> None:
    """Retry-After names the first breaker's cooldown end (the README promised it; the 503
    had none, so clients retried at once or gave up)."""
    clock = FakeClock()
    reg = Registry(breaker=BreakerSettings(failure_threshold=1, base_cooldown=30), clock=clock)
    sched = Scheduler(config({"chat": static_model(5)}), reg, seed=1)
    for a in ADDRS:
        trip(reg, "chat", a)
        clock.advance(2.0)  # the first one's cooldown ends first: 30 s after its trip
    err = expect(NoHealthyEndpoint, 503, "no_healthy_endpoint", sched, req())
    assert "'chat'" in err.message
    assert err.response_headers()["retry-after"] == "20"
    clock.advance(19.5)
    assert (
        expect(NoHealthyEndpoint, 503, "no_healthy_endpoint", sched, req()).headers["retry-after"]
        == "1"
    )  # half a second left: at least 1


def test_all_endpoints_saturated_is_429_all_saturated() -> None:
    """With the `not-saturated` filter (the `chat` preset has it; `latency` queues instead)."""
    sched, reg, _ = scheduler({"chat": static_model(5, strategy="chat")})
    for i, a in enumerate(ADDRS):
        scrape(reg, "chat", a, waiting=64 if i % 2 else 0, kv=0.99 if i % 2 == 0 else 0.1)
    assert expect(NoCapacity, 429, "all_saturated", sched, req()).headers["retry-after"] == "1"


def test_default_strategy_queues_on_saturated_engines_rather_than_shedding() -> None:
    sched, reg, _ = scheduler()
    for a in ADDRS:
        scrape(reg, "chat", a, waiting=64, kv=0.99)
    assert sched.pick(req()).endpoint.address in ADDRS


def test_a_tuned_latency_param_still_queues_on_saturated_engines_as_latency() -> None:
    """Setting a latency param as the README shows swapped in `not-saturated` (a 429 here)
    and reported the strategy as `custom` (found by a review helper)."""
    tuned = {"scorers": {"latency": {"params": {"step_ms": 20}}}}
    sched, reg, _ = scheduler({"chat": static_model(5, strategy=tuned)})
    for a in ADDRS:
        scrape(reg, "chat", a, waiting=80, kv=0.99)
    decision = sched.pick(req())
    assert decision.endpoint.address in ADDRS and decision.rationale.strategy == "latency"


def test_unknown_model_is_404_not_loading() -> None:
    sched, _, _ = scheduler()
    err = expect(ModelNotFound, 404, "model_not_found", sched, req("gpt-9"))
    assert not isinstance(err, ModelLoading | ModelNotReady)
    assert "gpt-9" in err.message and "chat" in err.message  # says what does exist


@pytest.mark.parametrize(
    "fields",
    [
        {"endpoints": ADDRS[:2], "scaling": {"min": 0, "max": 0}},
        {"launch": {"command": "run {port}"}, "scaling": {"min": 0, "max": 0}},
        {"launch": {"command": "run {port}"}},
    ],
    ids=["static-max-0", "launched-max-0", "launched-no-scaling"],
)
def test_disabled_model_is_503_model_disabled_and_not_retriable(fields: dict[str, Any]) -> None:
    sched, _, _ = scheduler({"off": fields})
    err = expect(ModelDisabled, 503, "model_disabled", sched, req("off"))
    assert err.response_headers()["x-should-retry"] == "false"


def test_on_demand_model_without_replicas_is_not_ready_for_the_activator() -> None:
    sched, _, _ = scheduler(
        {"big": {"launch": {"command": "run {port}"}, "scaling": {"min": 0, "max": 1}}}
    )
    expect(ModelNotReady, 503, "model_not_ready", sched, req("big"))
    # with a gateway's subset hint too: it was a 503 no_healthy_endpoint, never started
    hinted = req("big", subset=frozenset({"10.0.0.9"}))
    expect(ModelNotReady, 503, "model_not_ready", sched, hinted)


def test_rationale_has_raw_and_weighted_scores_per_endpoint_and_filter_drops() -> None:
    sched, reg, _ = scheduler({"chat": static_model(5, strategy="chat")})
    trip(reg, "chat", ADDRS[0])
    scrape(reg, "chat", ADDRS[1], waiting=100)  # saturated
    for a in ADDRS[2:]:
        scrape(reg, "chat", a, waiting=2)
    d = sched.pick(req(prompt="p" * 600))
    r = d.rationale
    assert (r.strategy, r.picker, r.considered) == ("chat", "max-score", 5)
    assert dict(r.filter_drops) == {"healthy": 1, "model-serves": 0, "not-saturated": 1}
    assert set(r.endpoint_ids) == set(ADDRS[2:])
    weights = {n: s.weight for n, s in PRESETS["chat"].scorers.items()}
    for eid in r.endpoint_ids:
        scores = r.scores_for(eid)
        assert set(scores) == set(weights)
        for name, (raw, weighted) in scores.items():
            assert 0.0 <= raw <= 1.0
            assert weighted == pytest.approx(raw * weights[name])
        assert r.total_for(eid) == pytest.approx(sum(w for _, w in scores.values()))
    assert r.total_for(d.endpoint.id) == max(r.totals)
    as_dict = r.as_dict()
    assert as_dict["filter_drops"]["healthy"] == 1
    assert set(as_dict["scores"][d.endpoint.id]) == {"total", *weights}
    assert "strategy=chat" in d.describe() and "dropped=healthy:1,not-saturated:1" in d.describe()


def test_fallbacks_follow_the_totals_and_exclude_the_primary() -> None:
    sched, reg, _ = scheduler({"chat": static_model(5, strategy="least-load")})
    for i, a in enumerate(ADDRS):
        scrape(reg, "chat", a, waiting=[3, 0, 8, 1, 5][i])
    d = sched.pick(req())
    assert d.destinations == (ADDRS[1], ADDRS[3], ADDRS[0])  # 1 + num_fallback_replicas (2)
    totals = [d.rationale.total_for(a) for a in d.destinations]
    assert totals == sorted(totals, reverse=True)


def test_strict_affinity_has_no_fallbacks() -> None:
    sched, _, _ = scheduler({"chat": static_model(5, session={"num_fallback_replicas": 0})})
    assert sched.pick(req()).fallbacks == ()


def test_same_seed_same_decisions() -> None:
    def run(seed: int) -> list[tuple[str, ...]]:
        sched, reg, _ = scheduler({"chat": static_model(5, strategy="batch")}, seed=seed)
        for a in ADDRS:
            scrape(reg, "chat", a)  # all equal: every pick is a tie broken by the rng
        return [sched.pick(req(rid=f"r{i}")).destinations for i in range(40)]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_prefix_scorer_sends_a_repeated_prefix_to_the_same_endpoint() -> None:
    sched, reg, _ = scheduler({"chat": static_model(5, strategy="chat")})
    for a in ADDRS:
        scrape(reg, "chat", a)
    system = "You are a helpful assistant. " * 80  # ~2.3 KB shared prefix
    first = sched.pick(req(rid="first", prompt=system + "question one"))
    for i in range(30):  # no session: the ring's primary varies with the request id
        d = sched.pick(req(rid=f"again-{i}", prompt=system + f"question {i}"))
        assert d.endpoint == first.endpoint
        assert d.rationale.scores_for(first.endpoint.id)["prefix"][0] == 1.0


def test_default_strategy_sends_a_repeated_long_prefix_where_it_is_cached() -> None:
    """`latency` (the default): re-prefilling 2.3 KB elsewhere costs more than the queue."""
    sched, reg, _ = scheduler()
    assert sched.routers["chat"].strategy_name == "latency"
    for a in ADDRS:
        scrape(reg, "chat", a)
    system = "You are a helpful assistant. " * 80
    first = sched.pick(req(rid="first", prompt=system + "question one", prompt_tokens=580))
    sched.acquire(first).first_token()  # prefilled: nothing pending there any more
    for i in range(30):
        prompt = system + f"question {i}"
        d = sched.pick(req(rid=f"again-{i}", prompt=prompt, prompt_tokens=len(prompt) // 4))
        assert d.endpoint == first.endpoint
        sched.acquire(d).first_token()


def test_ring_strategy_keeps_a_session_on_its_ring_primary() -> None:
    sched, _, _ = scheduler({"chat": static_model(5, strategy="ring")})
    ring = HashRing(ADDRS, num_fallback_replicas=2)
    for session in ("alice", "bob", "carol"):
        picks = {
            sched.pick(req(rid=f"{session}-{i}", session_key=session)).endpoint.id
            for i in range(10)
        }
        assert picks == {ring.candidates(session)[0]}
        assert sched.pick(req(session_key=session)).destinations == tuple(ring.candidates(session))


def test_ring_strategy_moves_a_session_to_the_first_fallback_when_the_primary_trips() -> None:
    sched, reg, clock = scheduler({"chat": static_model(5, strategy="ring")})
    primary, first_fallback, second_fallback = HashRing(ADDRS).candidates("alice")
    trip(reg, "chat", primary)
    d = sched.pick(req(session_key="alice"))
    assert d.endpoint.id == first_fallback
    assert d.fallbacks[0].id == second_fallback
    clock.advance(1.0)  # cooldown over: the half-open primary takes the session back
    assert sched.pick(req(session_key="alice")).endpoint.id == primary


def test_ring_is_rebuilt_only_when_the_endpoint_set_changes() -> None:
    sched, reg, _ = scheduler()
    sched.pick(req())
    ring = sched.routers["chat"].ring
    for i in range(5):
        sched.pick(req(rid=f"x{i}"))
    trip(reg, "chat", ADDRS[0])  # health does not change the ring
    sched.pick(req())
    assert sched.routers["chat"].ring is ring
    reg.set_endpoints("chat", [s.endpoint for s in reg.states("chat")][:4])
    sched.pick(req())
    assert sched.routers["chat"].ring is not ring
    assert sched.routers["chat"].ring.replica_ids == frozenset(ADDRS[:4])


def test_lease_counts_inflight_and_finishes_once() -> None:
    sched, reg, _ = scheduler()
    d = sched.pick(req())
    lease = sched.acquire(d)
    state = reg.get("chat", d.endpoint.id)
    assert state is not None and state.inflight == 1 and lease.probe == 0
    lease.finish(Outcome.FAILURE)
    lease.finish(Outcome.FAILURE)  # idempotent: one request, one verdict
    assert state.inflight == 0
    fallback = sched.acquire(d, d.fallbacks[0])
    assert fallback.endpoint_id == d.fallbacks[0].id


def test_lease_first_token_calls_its_hook_once() -> None:
    sched, _, _ = scheduler()
    lease = sched.acquire(sched.pick(req()))
    lease.first_token()  # no hook: only marks it
    calls: list[str] = []
    lease = sched.acquire(sched.pick(req()))
    lease.on_first_token = lambda: calls.append(lease.endpoint_id)
    lease.first_token()
    lease.first_token()
    assert calls == [lease.endpoint_id] and lease.first_token_seen


def test_lease_on_a_half_open_endpoint_is_a_probe() -> None:
    sched, reg, clock = scheduler({"chat": static_model(1)})
    trip(reg, "chat", ADDRS[0])
    clock.advance(1.0)
    d = sched.pick(req())
    lease = sched.acquire(d)
    assert lease.probe
    # Its one slot is taken: a probe ends any time, so the retry comes soon.
    err = expect(NoHealthyEndpoint, 503, "no_healthy_endpoint", sched, req())
    assert err.headers["retry-after"] == "1"
    lease.finish(Outcome.CANCELLED)
    assert sched.pick(req()).endpoint.id == ADDRS[0]


def test_a_scorer_returning_the_wrong_number_of_scores_is_an_error() -> None:
    sched, _, _ = scheduler({"chat": static_model(3, strategy="batch")})
    router = sched.routers["chat"]

    class OneScore:  # a plugin's bug: one score whatever the candidates
        name = "one"

        def score(self, ctx: PickContext, candidates: list[EndpointState]) -> list[float]:
            return [1.0]

    router.scoring = [(OneScore(), 1.0, None)]
    with pytest.raises(ValueError, match="1 scores for 3"):
        sched.pick(req())
