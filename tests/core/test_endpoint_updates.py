"""Live endpoint-set changes through `Registry.set_endpoints` (the one path of static reload,
on-demand starts and Kubernetes discovery): state kept, new ones warm up, leavers drain,
and only the sessions of moved endpoints move."""

from __future__ import annotations

from llmgw.breaker import BreakerSettings, BreakerState
from llmgw.config import load_dict
from llmgw.gateway import Gateway
from llmgw.registry import Registry
from llmgw.scheduling.scheduler import Scheduler
from llmgw.types import Endpoint, EngineMetrics, Outcome, RequestInfo

from .helpers import FakeClock

M = "m"
PODS = [f"10.0.0.{i}:8000" for i in range(1, 5)]


def eps(*addresses: str) -> list[Endpoint]:
    return [Endpoint(address=a, model=M, pool=M) for a in addresses]


def scheduler(*addresses: str, warmup: int | None = None) -> Scheduler:
    config = load_dict({"models": {M: {"endpoints": list(addresses), "strategy": "ring"}}})
    sched = Scheduler(config, Registry(clock=FakeClock()), seed=1)
    sched.registry.warmup_inflight = warmup
    return sched


def owners(sched: Scheduler, sessions: list[str]) -> dict[str, str]:
    return {
        s: sched.pick(RequestInfo(model=M, request_id=s, session_key=s)).endpoint.id
        for s in sessions
    }


def test_endpoints_that_stay_keep_breaker_inflight_and_metrics() -> None:
    sched = scheduler(PODS[0], PODS[1])
    reg = sched.registry
    reg.acquire(M, PODS[0])
    reg.record_scrape(M, PODS[0], EngineMetrics(waiting=3, running=1, kv_usage=0.5))
    reg.release(M, PODS[1], Outcome.FAILURE)  # nothing in flight: still a breaker record
    before = reg.get(M, PODS[0])
    reg.set_endpoints(M, eps(PODS[0], PODS[2]))
    after = reg.get(M, PODS[0])
    assert after is before
    assert after is not None and after.inflight == 1 and after.metrics is not None
    assert reg.get(M, PODS[1]) is None


def test_only_sessions_of_moved_endpoints_move_when_scaling_2_to_4_to_1() -> None:
    sessions = [f"session-{i}" for i in range(400)]
    sched = scheduler(*PODS[:2])
    two = owners(sched, sessions)
    sched.registry.set_endpoints(M, eps(*PODS))
    four = owners(sched, sessions)
    moved = {s for s in sessions if four[s] != two[s]}
    assert moved, "new pods take some sessions"
    assert all(four[s] in PODS[2:] for s in moved), "a session moved between staying pods"
    assert len(moved) < len(sessions) * 0.75  # about half move to the two new pods
    sched.registry.set_endpoints(M, eps(PODS[0]))
    one = owners(sched, sessions)
    assert all(one[s] == PODS[0] for s in sessions)


def test_a_new_endpoint_takes_a_bounded_share_until_its_first_scrape() -> None:
    sched = scheduler(PODS[0], warmup=2)
    reg = sched.registry
    reg.set_endpoints(M, eps(PODS[0], PODS[1]))
    new = reg.get(M, PODS[1])
    assert new is not None and new.warming and reg.warming(M) == 1
    sessions = owners(sched, [f"s{i}" for i in range(200)])
    to_new = [s for s, e in sessions.items() if e == PODS[1]]
    assert len(to_new) > 2
    for _ in range(2):
        reg.acquire(M, PODS[1])
    capped = owners(sched, to_new)
    assert set(capped.values()) == {PODS[0]}, "the warming endpoint got more than its cap"
    decision = sched.pick(RequestInfo(model=M, request_id="x", session_key=to_new[0]))
    assert ("warmup", 1) in decision.rationale.filter_drops
    reg.record_scrape(M, PODS[1], EngineMetrics(waiting=0, running=2, kv_usage=0.1))
    assert not new.warming and reg.warming(M) == 0
    assert owners(sched, to_new[:1]) == {to_new[0]: PODS[1]}


def test_no_warm_up_without_a_scraper_and_none_for_a_model_starting_from_zero() -> None:
    sched = scheduler(PODS[0])  # warmup None: nothing would ever end it
    reg = sched.registry
    reg.set_endpoints(M, eps(PODS[0], PODS[1]))
    for _ in range(5):
        reg.acquire(M, PODS[1])
    sessions = owners(sched, [f"s{i}" for i in range(50)])
    assert PODS[1] in sessions.values()
    fresh = Registry(clock=FakeClock())
    fresh.set_endpoints(M, eps(PODS[0]))  # an on-demand start: the first set
    state = fresh.get(M, PODS[0])
    assert state is not None and not state.warming


def test_an_endpoint_that_leaves_mid_request_charges_the_outcome_to_itself_only() -> None:
    sched = scheduler(PODS[0], PODS[1])
    reg = sched.registry
    reg.configure(breaker=BreakerSettings(failure_threshold=1), staleness=2.0)
    reg.acquire(M, PODS[1])
    reg.acquire(M, PODS[1])
    gone = reg.get(M, PODS[1])
    reg.set_endpoints(M, eps(PODS[0]))  # its pod turned NotReady / was deleted
    assert reg.draining(M) == [gone]
    assert set(owners(sched, [f"s{i}" for i in range(50)]).values()) == {PODS[0]}
    reg.release(M, PODS[1], Outcome.FAILURE)  # the connection to the dead pod reset
    staying = reg.get(M, PODS[0])
    assert gone is not None and staying is not None
    assert gone.inflight == 1 and gone.breaker.state is BreakerState.OPEN
    assert staying.breaker.state is BreakerState.CLOSED
    reg.release(M, PODS[1], Outcome.SUCCESS)
    assert reg.draining(M) == []


def test_an_endpoint_that_comes_back_while_draining_gets_its_state_back() -> None:
    reg = scheduler(PODS[0], PODS[1]).registry
    reg.acquire(M, PODS[1])
    before = reg.get(M, PODS[1])
    reg.set_endpoints(M, eps(PODS[0]))  # NotReady for a moment
    reg.set_endpoints(M, eps(PODS[0], PODS[1]))  # Ready again
    assert reg.get(M, PODS[1]) is before and before is not None and before.inflight == 1
    assert reg.draining(M) == []


def test_a_reload_keeps_the_endpoints_discovery_found() -> None:
    data = {
        "models": {M: {"discovery": {"service": {"name": "vllm"}}, "strategy": "ring"}},
    }
    gateway = Gateway(Scheduler(load_dict(data)))
    registry = gateway.scheduler.registry
    registry.set_endpoints(M, eps(PODS[0], PODS[1]))  # what discovery found
    gateway.reload(load_dict({**data, "breaker": {"failure_threshold": 5}}))
    assert sorted(s.id for s in registry.states(M)) == PODS[:2]
