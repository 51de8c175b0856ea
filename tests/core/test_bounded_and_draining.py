"""Two scheduling-core defects a review found: bounded load's capacity one request over
its formula (float rounding), and a first token on a draining endpoint leaving its
prefill queued for good."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from llmgw.breaker import BreakerSettings
from llmgw.hashring import HashRing, bounded_capacity
from llmgw.registry import Registry
from llmgw.scheduling.filters import BoundedLoadFilter
from llmgw.scheduling.scheduler import Scheduler
from llmgw.types import Decision, Endpoint, Outcome, RequestInfo

from .helpers import FakeClock, config, context, model_spec, state, static_model


@given(
    st.sampled_from(["1.1", "1.25", "1.5", "2", "1.05", "1.3"]),
    st.integers(0, 10_000),
    st.integers(1, 64),
)
def test_capacity_is_the_formula_on_the_decimal_factor(c: str, total: int, n: int) -> None:
    assert bounded_capacity(float(c), total, n) == math.ceil(Fraction(c) * (total + 1) / n)


def test_a_replica_at_capacity_is_passed_over_by_the_ring_and_the_filter() -> None:
    """c = 1.1 (bounded-ring), 49 in flight over 5: capacity 11; floats said 12."""
    assert bounded_capacity(1.1, 49, 5) == 11
    ids = [f"r{i}" for i in range(5)]
    ring = HashRing(ids, num_fallback_replicas=0)
    primary = ring.candidates("hot")[0]
    load = dict(zip([primary, *(r for r in ids if r != primary)], [11, 10, 10, 9, 9], strict=True))
    assert load[ring.bounded_candidates("hot", load, 1.1)[0]] < 11
    states = [state(f"10.0.0.{i + 1}:8000", inflight=n) for i, n in enumerate([11, 10, 10, 9, 9])]
    kept = BoundedLoadFilter().filter(
        context(states, spec=model_spec(session={"bounded_load": 1.1})), states
    )
    assert [s.inflight for s in kept] == [10, 10, 9, 9]


def test_a_first_token_while_the_endpoint_drains_ends_its_prefill_there() -> None:
    """Its state comes back when the endpoint does (a readiness blip): the request's prefill
    stayed queued there for good, and the latency scorer priced the idle replica busy."""
    addresses = ["10.0.0.1:8000", "10.0.0.2:8000"]
    clock = FakeClock()
    registry = Registry(clock=clock)
    scheduler = Scheduler(config({"m": {"endpoints": addresses}}), registry, seed=1)
    home = addresses[0]

    def on_home(i: int) -> Decision:
        prompt = f"request {i} " + "lorem ipsum " * 400
        request = RequestInfo(
            model="m",
            request_id=f"r{i}",
            prompt=prompt,
            prompt_tokens=len(prompt) // 4,
            stream=True,
        )
        for _ in range(200):
            decision = scheduler.pick(request)
            if decision.endpoint.id == home:
                return decision
        raise AssertionError("never picked the home endpoint")

    first, second = scheduler.acquire(on_home(1)), scheduler.acquire(on_home(2))
    kept = registry.get("m", home)
    assert kept is not None and kept.pending_prefill > 0
    registry.set_endpoints("m", [Endpoint(addresses[1], "m")])  # leaves, two in flight
    clock.advance(0.05)
    first.first_token()
    first.end(Outcome.SUCCESS)
    registry.set_endpoints("m", [Endpoint(a, "m") for a in addresses])  # back
    assert registry.get("m", home) is kept and kept.inflight == 1
    second.first_token()
    second.end(Outcome.SUCCESS)
    assert (kept.inflight, kept.pending_prefill) == (0, 0.0)


def _scheduler(models: dict[str, Any], seed: int = 1) -> tuple[Scheduler, Registry, FakeClock]:
    clock = FakeClock()
    reg = Registry(breaker=BreakerSettings(failure_threshold=1), clock=clock)
    return Scheduler(config(models), reg, seed=seed), reg, clock


def _trip(reg: Registry, model: str, address: str) -> None:
    reg.acquire(model, address)
    reg.release(model, address, Outcome.FAILURE)


def _home_of(session: str, ids: list[str]) -> str:
    return HashRing(ids, num_fallback_replicas=0).candidates(session)[0]


def test_bounded_load_over_a_failed_replica_moves_sessions_a_smaller_fleet_keeps() -> None:
    """bounded-ring (c = 1.1), 4 replicas, one with its breaker open (0 in flight, takes
    nothing). Healthy loads home 3, others 3 and 2: the mean over the replicas that can take
    the session is 8/3, capacity ceil(1.1 x 9 / 3) = 4, so the session stays home, exactly
    as it does on a fleet of those 3 replicas alone (Ray Serve's ring rebuilt without the
    failed one). The scorer counts the failed replica as a bin: capacity ceil(1.1 x 9 / 4)
    = 3, the home is "full", and the session is moved off its cached home."""
    sched, reg, _ = _scheduler({"chat": static_model(4, strategy="bounded-ring")})
    ids = [s.id for s in reg.states("chat")]
    session = next(
        f"s{i}" for i in range(1000) if _home_of(f"s{i}", ids) != ids[0]
    )  # a session whose home is not the replica that fails
    down = ids[0]
    home = _home_of(session, ids)
    assert home == _home_of(session, ids[1:])  # same home on the 3-replica ring
    _trip(reg, "chat", down)
    others = [i for i in ids[1:] if i != home]
    for eid, n in ((home, 3), (others[0], 3), (others[1], 2)):
        for _ in range(n):
            reg.acquire("chat", eid)
    # The same loads on a fleet of just the 3 healthy replicas: the session stays home.
    sched3, reg3, _ = _scheduler({"chat": {"endpoints": ids[1:], "strategy": "bounded-ring"}})
    for eid, n in ((home, 3), (others[0], 3), (others[1], 2)):
        for _ in range(n):
            reg3.acquire("chat", eid)
    request = RequestInfo(model="chat", request_id="r1", session_key=session)
    assert sched3.pick(request).endpoint.id == home
    assert sched.pick(request).endpoint.id == home


def test_bounded_ring_fallbacks_follow_the_ring_when_few_replicas_have_room() -> None:
    """Two router replicas (active-active, different random seeds) with the same loads must
    name the same primary and fallbacks for a session: ARCHITECTURE's ring contract (primary,
    then distinct replicas clockwise; same inputs, same answer in every process). When fewer
    than 1 + num_fallback_replicas replicas are below the bounded-load capacity, the
    session scorer ranks only those; the other replicas all score 0 and the max-score
    picker fills the fallback slots from that tie at random, so each router (and each
    request of one router) lists different fallbacks, none of them the ring's."""
    addresses = [f"10.0.0.{i + 1}:8000" for i in range(6)]
    ring = HashRing(addresses, num_fallback_replicas=5)
    walk = ring.candidates("s1")
    # Loads: the session's home and everything but the last replica of its walk are busy;
    # 5 x 6 + 0 = 30 in flight: capacity ceil(1.1 x 31 / 6) = 6, only walk[-1] has room.
    loads = {eid: 6 for eid in walk[:-1]} | {walk[-1]: 0}
    seen = set()
    for seed in range(8):
        sched, reg, _ = _scheduler({"chat": static_model(6, strategy="bounded-ring")}, seed)
        for eid, n in loads.items():
            for _ in range(n):
                reg.acquire("chat", eid)
        d = sched.pick(RequestInfo(model="chat", request_id=f"r{seed}", session_key="s1"))
        seen.add((d.endpoint.id, *(e.id for e in d.fallbacks)))
    assert len(seen) == 1, f"{len(seen)} different destination lists for one session: {seen}"
    (got,) = seen
    assert got[0] == walk[-1]
    assert list(got[1:]) == walk[:2]  # the next replicas clockwise, as the ring orders them


def test_the_filter_bounds_over_the_endpoints_that_can_take_the_request() -> None:
    """Loads 3 / 3 / 2 on the healthy three, the fourth filtered out before (breaker open):
    capacity ceil(1.1 x 9 / 3) = 4 keeps all three; counted as a bin, 3 dropped two."""
    states = [state(f"10.0.0.{i + 1}:8000", inflight=n) for i, n in enumerate([3, 3, 2])]
    kept = BoundedLoadFilter().filter(
        context(states, spec=model_spec(session={"bounded_load": 1.1})), states
    )
    assert [s.inflight for s in kept] == [3, 3, 2]
    assert BoundedLoadFilter().filter(context(states), []) == []
