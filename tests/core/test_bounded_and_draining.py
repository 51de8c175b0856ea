"""Two scheduling-core defects a review found: bounded load's capacity one request over
its formula (float rounding), and a first token on a draining endpoint leaving its
prefill queued for good."""

from __future__ import annotations

import math
from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st

from llmgw.hashring import HashRing, bounded_capacity
from llmgw.registry import Registry
from llmgw.scheduling.filters import BoundedLoadFilter
from llmgw.scheduling.scheduler import Scheduler
from llmgw.types import Decision, Endpoint, Outcome, RequestInfo

from .helpers import FakeClock, config, context, model_spec, state


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
