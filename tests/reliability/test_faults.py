"""The fault matrix (`bench/fault_matrix.py`), asserted: each fault x each edge.

One of four simulated replicas gets one fault at a time; requests through real Envoy +
ext_proc (override-host: retries walk the fallbacks) and through the embedded ASGI proxy
must each end (succeeded or clearly failed, none hanging past the configured timeouts),
the breaker must open and close again through half-open probes (or stay closed for the
faults that must not trip it), a /metrics fault must leave the replica stale but served,
and the inflight count must come back to 0.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from bench.fault_matrix import (
    CASES,
    Edge,
    EnvoyEdge,
    FaultCase,
    ProxyThread,
    Row,
    matrix_config,
    problems,
    run_case,
    start_fleet,
)
from llmgw.sim import ThreadedFleet
from llmgw.testing.extproc import envoy_binary

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def fleet() -> Iterator[ThreadedFleet]:
    fleet = start_fleet()
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(scope="module", params=["envoy", "asgi"])
def edge(request: pytest.FixtureRequest, fleet: ThreadedFleet) -> Iterator[Edge]:
    config = matrix_config(fleet)
    if request.param == "envoy":
        try:
            envoy_binary()
        except FileNotFoundError as exc:
            pytest.skip(str(exc))
        started: Edge = EnvoyEdge(config)
    else:
        started = ProxyThread(config)
    try:
        yield started
    finally:
        started.stop()


@pytest.mark.parametrize("case", CASES, ids=[c.name.replace(" ", "-") for c in CASES])
def test_fault(edge: Edge, fleet: ThreadedFleet, case: FaultCase) -> None:
    row = asyncio.run(run_case(edge, fleet, case, requests=24))
    assert problems(row, case) == [], row
    assert row.hung == 0 and row.ok + row.failed == row.sent
    assert row.inflight_after == 0


@pytest.mark.parametrize(
    ("edge_name", "ok", "short"), [("envoy", 9, False), ("envoy", 8, True), ("asgi", 11, True)]
)
def test_only_an_edge_blind_to_the_fault_may_lose_some_healthy_sessions_to_it(
    edge_name: str, ok: int, short: bool
) -> None:
    """Half the sessions hash to the victim. Through Envoy, blind to cut streams, the
    victim looks idle and may get a few of the others' too; the proxy sees the cuts."""
    case = next(c for c in CASES if c.name == "crash mid-stream")
    assert case.blind == ("envoy",)
    row = Row(edge_name, case.name, sent=24, ok=ok, failed=24 - ok, breaker_opened=True,
              breaker_closed_after_s=1.0, inflight_after=0)  # fmt: skip
    assert (f"only {ok}/24 ok" in problems(row, case)) is short
