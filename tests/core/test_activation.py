from __future__ import annotations

import pytest

from llmgw.activation import (
    RETRY_AFTER_FLOOR,
    TRANSITIONS,
    Action,
    ActivationEvent,
    ActivationSettings,
    ActivationState,
    ModelActivation,
)
from llmgw.errors import ModelFailed, ModelLoading, NoCapacity

S = ActivationState


def machine(**kw: float) -> ModelActivation:
    return ModelActivation("m", ActivationSettings(**kw))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("state", "event", "expected"),
    [
        (S.OFF, ActivationEvent.REQUEST, (S.STARTING, Action.START)),
        (S.STARTING, ActivationEvent.REQUEST, None),
        (S.STARTING, ActivationEvent.STARTED, (S.IDLE, Action.NONE)),
        (S.STARTING, ActivationEvent.START_FAILED, (S.FAILED, Action.NONE)),
        (S.FAILED, ActivationEvent.REQUEST, (S.STARTING, Action.START)),
        (S.FAILED, ActivationEvent.REQUEST_IN_BACKOFF, None),
        (S.IDLE, ActivationEvent.USE_BEGIN, (S.READY, Action.NONE)),
        (S.READY, ActivationEvent.LAST_USE_END, (S.IDLE, Action.NONE)),
        (S.IDLE, ActivationEvent.IDLE_EXPIRED, (S.OFF, Action.STOP)),
        (S.READY, ActivationEvent.IDLE_EXPIRED, None),
        (S.READY, ActivationEvent.CRASHED, (S.FAILED, Action.NONE)),
        (S.IDLE, ActivationEvent.CRASHED, (S.FAILED, Action.NONE)),
        (S.READY, ActivationEvent.REQUEST, None),
    ],
)
def test_transition_table(
    state: ActivationState,
    event: ActivationEvent,
    expected: tuple[ActivationState, Action] | None,
) -> None:
    assert TRANSITIONS.get((state, event)) == expected


def test_many_requests_cause_one_start() -> None:
    m = machine()
    actions = [m.request(now=float(i) / 10) for i in range(20)]
    assert actions.count(Action.START) == 1
    assert m.state is S.STARTING and m.starts == 1


def test_idle_timer_starts_at_end_of_last_request_and_never_stops_with_work_in_flight() -> None:
    m = machine(idle_timeout=10)
    m.request(0)
    m.started(5)
    m.use_begin(5)
    m.use_begin(6)
    assert m.tick(100) is Action.NONE  # two requests in flight: never stop
    m.use_end(50)
    assert m.tick(100) is Action.NONE  # one still in flight (a long stream)
    m.use_end(100)
    assert m.state is S.IDLE
    assert m.tick(109.9) is Action.NONE
    assert m.tick(110) is Action.STOP
    assert m.status(110)["state"] == "off" and m.stops == 1


def test_started_with_users_waiting_counts_as_ready() -> None:
    m = machine()
    m.request(0)
    m.use_begin(1)  # a request leased before the start was reported (not typical)
    m.started(2)
    assert m.state is S.READY


def test_failed_start_keeps_error_and_retries_only_after_backoff() -> None:
    m = machine(failure_backoff=10)
    m.request(0)
    m.start_failed("exit code 1: no such model", 3)
    assert m.state is S.FAILED and m.last_error == "exit code 1: no such model"
    assert m.request(5) is Action.NONE
    err = m.not_ready_error(5)
    assert isinstance(err, ModelFailed) and "no such model" in err.message and err.status == 503
    assert err.headers["retry-after"] == "8"  # the backoff ends at 13 s: a retry then starts it
    assert m.not_ready_error(12.5).headers["retry-after"] == "1"
    assert m.request(13) is Action.START
    assert m.last_error is None


def test_loading_error_has_retry_after_from_expected_remaining_start_time() -> None:
    m = machine(expected_start_seconds=30)
    m.request(100)
    err = m.not_ready_error(110)
    assert isinstance(err, ModelLoading)
    assert err.status == 503 and err.headers["retry-after"] == "20"
    assert machine(expected_start_seconds=600).retry_after(0) == 60  # capped at 60


def test_retry_after_never_drops_below_the_floor_while_loading() -> None:
    """Was 1 s once the expected start time had passed: clients re-polled every second."""
    m = machine(expected_start_seconds=30)
    m.request(0)
    assert m.retry_after(28) == RETRY_AFTER_FLOOR  # 2 s left: still the floor
    assert m.retry_after(31) == 8  # just overdue: a quarter of 31 s
    assert m.retry_after(120) == 30  # 2 min in: a quarter of the time spent so far
    assert m.retry_after(10_000) == 60  # capped
    err = m.not_ready_error(31)
    assert isinstance(err, ModelLoading) and int(err.headers["retry-after"]) >= RETRY_AFTER_FLOOR


def test_waiters_are_capped_and_told_when_the_start_should_be_done() -> None:
    m = machine(max_waiting_requests=2, expected_start_seconds=30)
    m.request(0)
    m.begin_wait(1)
    m.begin_wait(1)
    with pytest.raises(NoCapacity) as info:
        m.begin_wait(10)
    assert info.value.status == 429
    assert info.value.headers["retry-after"] == "20"  # the start's expected remaining time
    m.end_wait()
    m.begin_wait(10)


def test_always_on_model_is_never_idle_stopped_and_restarts_after_backoff() -> None:
    m = ModelActivation("m", ActivationSettings(idle_timeout=1, failure_backoff=5, always_on=True))
    assert m.tick(0.0) is Action.START  # off: started by the tick, not by a request
    m.started(1.0)
    assert m.tick(1000.0) is Action.NONE  # idle far past idle_timeout: kept
    m.crashed("oom", 1000.0)
    assert m.failed
    assert m.tick(1002.0) is Action.NONE  # backoff still running
    assert m.tick(1005.0) is Action.START and m.state is ActivationState.STARTING
