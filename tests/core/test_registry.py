"""Registry: inflight accounting, staleness, drain rate, scrape failures, endpoint-set changes."""

from __future__ import annotations

import pytest

from llmgw.breaker import BreakerSettings, BreakerState
from llmgw.kvevents import BlockStored, EventBatch
from llmgw.kvindex import KvState
from llmgw.registry import FULL_SCRAPES, PEAK_STEP, Registry
from llmgw.types import Endpoint, EngineMetrics, Outcome

from .helpers import FakeClock

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def registry(*addresses: str, clock: FakeClock | None = None, **kw: object) -> Registry:
    reg = Registry(clock=clock or FakeClock(), **kw)  # type: ignore[arg-type]
    reg.set_endpoints("m", [Endpoint(a, "m") for a in addresses])
    return reg


def metrics(waiting: float = 1, finished: float | None = None) -> EngineMetrics:
    return EngineMetrics(waiting=waiting, running=2, kv_usage=0.3, finished_total=finished)


def inflight(reg: Registry, address: str) -> int:
    s = reg.get("m", address)
    assert s is not None
    return s.inflight


def test_acquire_and_release_count_inflight() -> None:
    reg = registry(A, B)
    for _ in range(3):
        reg.acquire("m", A)
    reg.release("m", A, Outcome.SUCCESS)
    assert (inflight(reg, A), inflight(reg, B)) == (2, 0)


@pytest.mark.parametrize("outcome", list(Outcome))
def test_inflight_never_goes_negative(outcome: Outcome) -> None:
    reg = registry(A)
    reg.acquire("m", A)
    for _ in range(3):
        reg.release("m", A, outcome)
    assert inflight(reg, A) == 0


def test_unknown_endpoint_is_ignored_by_acquire_and_release() -> None:
    reg = registry(A)
    assert reg.acquire("m", "9.9.9.9:1") is None  # not counted: its lease charges nothing
    assert reg.acquire("other", A) is None
    reg.release("m", "9.9.9.9:1", Outcome.FAILURE)
    assert inflight(reg, A) == 0


def test_metrics_are_fresh_up_to_the_staleness_window_then_stale() -> None:
    clock = FakeClock(50.0)
    reg = registry(A, clock=clock, staleness=2.0)
    s = reg.get("m", A)
    assert s is not None
    assert s.fresh_metrics(clock(), reg.staleness) is None  # never scraped
    reg.record_scrape("m", A, metrics(waiting=4))
    clock.advance(2.0)
    fresh = s.fresh_metrics(clock(), reg.staleness)
    assert fresh is not None and fresh.waiting == 4
    clock.advance(0.01)
    assert s.fresh_metrics(clock(), reg.staleness) is None


def test_failed_scrape_marks_the_data_stale_at_once() -> None:
    clock = FakeClock()
    reg = registry(A, clock=clock)
    reg.record_scrape("m", A, metrics())
    clock.advance(0.1)
    reg.record_scrape_error("m", A, "metrics page lacks vllm:num_requests_waiting")
    s = reg.get("m", A)
    assert s is not None
    assert s.fresh_metrics(clock(), reg.staleness) is None
    assert s.scrape_error is not None and "vllm:num_requests_waiting" in s.scrape_error
    reg.record_scrape("m", A, metrics(waiting=7))  # the next good scrape is trusted again
    fresh = s.fresh_metrics(clock(), reg.staleness)
    assert fresh is not None and fresh.waiting == 7 and s.scrape_error is None


def test_failed_scrapes_never_touch_the_breaker() -> None:
    reg = registry(A, breaker=BreakerSettings(failure_threshold=2))
    for _ in range(50):
        reg.record_scrape_error("m", A, "timeout")
    s = reg.get("m", A)
    assert s is not None
    assert s.breaker.state is BreakerState.CLOSED
    reg.release("m", A, Outcome.FAILURE)  # one real failure: the count starts at 1, not 51
    assert s.breaker.state is BreakerState.CLOSED


def test_scrape_showing_the_model_absent_marks_it_not_served() -> None:
    reg = registry(A)
    reg.record_scrape_error("m", A, "no series for model", model_absent=True)
    s = reg.get("m", A)
    assert s is not None and s.serves_model is False
    reg.record_scrape("m", A, metrics())
    assert s.serves_model is True


def test_peak_running_is_the_most_requests_seen_running_at_once() -> None:
    reg = registry(A)
    s = reg.get("m", A)
    assert s is not None and s.peak_running == 0
    for running in (3, 8, 8, 5):  # (a far higher one on two in a row: the next test)
        reg.record_scrape("m", A, EngineMetrics(waiting=0, running=running, kv_usage=0.1))
    assert s.peak_running == 8


def test_a_peak_running_seen_on_one_scrape_only_is_not_the_peak() -> None:
    """One glitched reading (65535: a 16-bit underflow) was the endpoint's peak batch until
    it restarted, so its batch-slot waits were never priced again (found by a review
    helper). A peak past twice the last and PEAK_STEP more counts once two scrapes in a
    row show it; a smaller rise counts at once (two in a row for every rise kept the peak
    under a batch a busy engine fills only now and then)."""
    reg = registry(A)
    s = reg.get("m", A)
    assert s is not None

    def scrape(running: float) -> float:
        reg.record_scrape("m", A, EngineMetrics(waiting=1, running=running, kv_usage=0.1))
        return s.peak_running

    assert PEAK_STEP == 16
    assert [scrape(r) for r in (8, 7, 65535, 8, 8)] == [8, 8, 8, 8, 8]
    assert [scrape(r) for r in (12, 10, 32)] == [12, 12, 32]  # within 2 x 12 + 16 = 40
    assert [scrape(r) for r in (200, 180, 500, 90)] == [32, 180, 180, 180]  # past it: 2 in a row


def test_a_restarted_engines_first_reading_is_not_paired_with_the_old_process() -> None:
    """The peak is confirmed by two scrapes in a row; a restart resets it, but the new
    process's first reading was paired with the old process's last one, so one reading set
    the new peak (found by a review helper)."""
    reg = registry(A)
    s = reg.get("m", A)
    assert s is not None

    def scrape(running: float, finished: float) -> float:
        metrics = EngineMetrics(waiting=1, running=running, kv_usage=0.1, finished_total=finished)
        reg.record_scrape("m", A, metrics)
        return s.peak_running

    assert [scrape(40, 50), scrape(40, 60)] == [0, 40]
    assert scrape(20, 0) == 0  # restarted (its counters back to 0): no peak from its first
    assert s.restarts == 1  # reading past PEAK_STEP, nor the old process's 40 with it
    assert scrape(20, 5) == 20


def test_the_peak_counts_as_the_batch_once_seen_full_with_requests_waiting() -> None:
    """A request waits until the engine's next step even with slots free, so one scrape at
    the peak with some waiting proves nothing: it takes FULL_SCRAPES of them since the peak
    last rose, and a higher peak starts over (one past twice the last and PEAK_STEP more
    once two scrapes in a row show it)."""
    reg = registry(A)
    s = reg.get("m", A)
    assert s is not None

    def scrape(waiting: int, running: int) -> bool:
        reg.record_scrape("m", A, EngineMetrics(waiting=waiting, running=running, kv_usage=0.1))
        return s.peak_is_batch

    assert not scrape(1, 2)  # peak 2: a new arrival, not yet admitted
    assert not scrape(0, 2)
    assert not scrape(2, 1)  # below the peak: memory or a prefill budget, not slots
    assert not scrape(1, 2)
    assert scrape(1, 2)  # the third time at peak 2 with requests waiting
    assert scrape(0, 2)  # once known, it stays
    assert scrape(3, 40)  # one reading far above it proves nothing yet (a glitch?)
    assert not scrape(3, 40)  # the second: it ran more at once, 2 was not the batch
    assert not any(scrape(3, 40) for _ in range(FULL_SCRAPES - 2))
    assert scrape(3, 40) and s.peak_running == 40
    assert not scrape(3, 41)  # a small rise counts at once, and starts over


def test_release_feeds_the_breaker_but_cancellation_does_not() -> None:
    reg = registry(A, breaker=BreakerSettings(failure_threshold=2))
    for _ in range(5):
        reg.acquire("m", A)
        reg.release("m", A, Outcome.CANCELLED)
    assert reg.breaker_states()[("m", A)] is BreakerState.CLOSED
    for _ in range(2):
        reg.acquire("m", A)
        reg.release("m", A, Outcome.FAILURE)
    assert reg.breaker_states()[("m", A)] is BreakerState.OPEN


def test_half_open_acquire_is_a_probe_and_a_cancelled_probe_frees_its_slot() -> None:
    clock = FakeClock()
    reg = registry(A, clock=clock, breaker=BreakerSettings(failure_threshold=1, base_cooldown=1))
    s = reg.get("m", A)
    assert s is not None
    reg.acquire("m", A)
    reg.release("m", A, Outcome.FAILURE)
    clock.advance(1.0)
    assert reg.breaker_states()[("m", A)] is BreakerState.HALF_OPEN
    probe = reg.acquire("m", A)
    assert probe
    assert not s.breaker.available(clock())
    reg.release("m", A, Outcome.CANCELLED, probe=probe)
    assert s.breaker.available(clock())


def test_set_endpoints_keeps_live_state_of_endpoints_that_stay() -> None:
    clock = FakeClock()
    reg = registry(A, B, clock=clock, breaker=BreakerSettings(failure_threshold=1))
    reg.acquire("m", A)
    reg.record_scrape("m", A, metrics(waiting=9))
    reg.acquire("m", B)
    reg.release("m", B, Outcome.FAILURE)  # B's breaker opens
    version = reg.version
    reg.set_endpoints("m", [Endpoint(B, "m", weight=3.0), Endpoint(A, "m"), Endpoint(C, "m")])
    a, b, c = (reg.get("m", x) for x in (A, B, C))
    assert a is not None and b is not None and c is not None
    assert a.inflight == 1
    fresh = a.fresh_metrics(clock(), reg.staleness)
    assert fresh is not None and fresh.waiting == 9
    # A weight change is the same server: its open breaker stays open, the weight updates.
    assert b.breaker.state is BreakerState.OPEN
    assert b.endpoint.weight == 3.0
    assert c.inflight == 0 and c.metrics is None
    assert [s.id for s in reg.states("m")] == [B, A, C]
    assert reg.version == version + 1


def test_removed_endpoint_is_forgotten_and_its_late_release_ignored() -> None:
    reg = registry(A, B)
    reg.acquire("m", B)
    reg.set_endpoints("m", [Endpoint(A, "m")])
    assert reg.get("m", B) is None
    reg.release("m", B, Outcome.SUCCESS)  # the request outlived its endpoint: no error
    reg.set_endpoints("m", [Endpoint(A, "m"), Endpoint(B, "m")])
    assert inflight(reg, B) == 0  # came back fresh


def test_same_endpoint_set_does_not_bump_the_version() -> None:
    reg = registry(A, B)
    version = reg.version
    reg.set_endpoints("m", [Endpoint(A, "m"), Endpoint(B, "m")])
    assert reg.version == version


def test_one_server_address_can_serve_several_models() -> None:
    reg = registry(A)
    reg.set_endpoints("other", [Endpoint(A, "other")])
    assert [s.endpoint.model for s in reg.all_states() if s.id == A] == ["m", "other"]
    assert sorted(reg.models()) == ["m", "other"]


def test_a_server_leaving_one_model_keeps_its_kv_index_for_another_that_lists_it() -> None:
    """A base model and its adapter on one vLLM: a change to the adapter's set emptied the
    server's exact index (unknown until a resync) though the base still routes there."""
    registry = Registry()
    address = "10.0.0.1:8000"
    registry.set_endpoints("base", [Endpoint(address, "base")])
    registry.set_endpoints("adapter", [Endpoint(address, "adapter")])
    index = registry.kv_index
    stored = BlockStored((b"h0",), None, (1, 2, 3, 4), 4, medium="GPU")
    index.apply_batch(address, EventBatch(0, 0.0, (stored,)), now=0.0)
    registry.set_endpoints("adapter", [])
    index.apply_batch(address, EventBatch(1, 0.0, ()), now=1.0)  # the stream goes on
    assert (index.state(address), index.size(address)) == (KvState.LIVE, 1)
    registry.set_endpoints("base", [])  # nobody lists it now: forgotten
    assert index.size(address) == 0
