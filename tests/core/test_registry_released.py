"""`released_since_scrape` takes off only the requests the last scrape counted."""

from __future__ import annotations

from llmgw.registry import Registry
from llmgw.scheduling.scorers import LoadScorer
from llmgw.types import Endpoint, EngineMetrics, Outcome

from .helpers import FakeClock, context, model_spec

M = "m"
A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def test_requests_sent_and_ended_after_the_scrape_do_not_erase_the_engines_load() -> None:
    """A scrape shows A running 4 requests (another router's, a direct client's); this
    router then sends A 4 short requests that come and go before the next scrape. They
    were never in that scrape's count, so A still runs those 4 others: it must not look
    idler than B (running 2). Every release since the scrape was taken off the reading:
    A read 4 - 4 = 0 and the load scorer preferred it (found by a review helper)."""
    clock = FakeClock()
    reg = Registry(clock=clock)
    reg.set_endpoints(M, [Endpoint(A, M, pool=M), Endpoint(B, M, pool=M)])
    reg.record_scrape(M, A, EngineMetrics(waiting=0, running=4, kv_usage=0.2))
    reg.record_scrape(M, B, EngineMetrics(waiting=0, running=2, kv_usage=0.1))
    clock.advance(0.01)
    for _ in range(4):  # sent after the scrape, answered before the next one
        sent = clock.now
        reg.acquire(M, A)
        clock.advance(0.005)
        reg.release(M, A, Outcome.SUCCESS, started=sent)
    states = reg.states(M)
    ctx = context(states, now=clock.now, spec=model_spec(endpoints=[A, B]))
    a, b = LoadScorer().score(ctx, states)
    assert a < b, f"A (4 running) scored {a:.2f}, B (2 running) {b:.2f}"
    # One the scrape did count (sent before it) is taken off: the engine's count drops.
    before = clock.now
    reg.acquire(M, B)
    clock.advance(0.01)
    reg.record_scrape(M, B, EngineMetrics(waiting=0, running=3, kv_usage=0.1))
    reg.release(M, B, Outcome.SUCCESS, started=before)
    assert reg.states(M)[1].released_since_scrape == 1
