"""Every request that ended since a scrape is what Little's law divides by (engines without a
finished counter), though the load reading takes off only those the scrape counted."""

from __future__ import annotations

import pytest

from llmgw.registry import Registry
from llmgw.types import Endpoint, EngineMetrics, Outcome

from .helpers import FakeClock

M = "m"
A = "10.0.0.1:8000"


def test_little_law_service_counts_every_request_that_ended_between_scrapes() -> None:
    """A gauges-only engine (no finished counter, no service histogram) always runs 4
    requests of 0.1 s each, all this router's, scraped every second: 40 end per window,
    so each holds its batch slot 4 x 1 s / 40 = 0.1 s. Only the 4 requests straddling a
    scrape were handed to the calibration as `released`: it read 1.0 s (10x; found by a
    review helper)."""
    clock = FakeClock(0.0)
    reg = Registry(clock=clock)
    reg.set_endpoints(M, [Endpoint(A, M, pool=M)])
    page = EngineMetrics(waiting=0, running=4, kv_usage=0.1)
    duration, lanes = 0.1, 4
    # Each lane runs back to back requests of 0.1 s starting at 0.05 + 0.1 k: events in time
    # order (start, end) over three 1 s windows with a scrape at each whole second.
    events: list[tuple[float, int, int]] = []  # (time, 0 start / 1 end, id)
    starts: dict[int, float] = {}
    rid = 0
    for _lane in range(lanes):
        t = 0.05
        while t < 3.0:
            starts[rid] = t
            events.append((round(t, 6), 0, rid))
            events.append((round(t + duration, 6), 1, rid))
            rid += 1
            t += duration
    # Ends before starts at the same instant (a lane's next request follows its last).
    events.sort(key=lambda e: (e[0], -e[1]))
    scrapes = [0.0, 1.0, 2.0, 3.0]
    i = 0
    for at in scrapes:
        while i < len(events) and events[i][0] <= at:
            when, kind, r = events[i]
            clock.now = when
            if kind == 0:
                reg.acquire(M, A)
            else:
                reg.release(M, A, Outcome.SUCCESS, started=starts[r])
            i += 1
        clock.now = at
        reg.record_scrape(M, A, page)
    service = reg.states(M)[0].calibration.service.value
    assert service is not None
    assert service == pytest.approx(duration, rel=0.25), (
        f"time in batch read {service:.2f} s, each request held its slot {duration} s"
    )
