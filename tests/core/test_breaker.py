"""Breaker: the transition table, exponential cooldown, half-open probes. Time is injected."""

from __future__ import annotations

import pytest

from llmgw.breaker import TRANSITIONS, Breaker, BreakerEvent, BreakerSettings, BreakerState

C, OP, H = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN
E = BreakerEvent

# From the issue: failure_threshold consecutive failures open; the cooldown elapsing
# half-opens; success_threshold probe successes close; any probe failure re-opens;
# late answers while open change nothing.
EXPECTED = {
    (C, E.SUCCESS): C,
    (C, E.SUCCESS_LIMIT): C,
    (C, E.FAILURE): C,
    (C, E.FAILURE_LIMIT): OP,
    (OP, E.SUCCESS): OP,
    (OP, E.SUCCESS_LIMIT): OP,
    (OP, E.FAILURE): OP,
    (OP, E.FAILURE_LIMIT): OP,
    (OP, E.COOLDOWN_ELAPSED): H,
    (H, E.SUCCESS): H,
    (H, E.SUCCESS_LIMIT): C,
    (H, E.FAILURE): OP,
    (H, E.FAILURE_LIMIT): OP,
}


def test_transition_table_is_exactly_the_documented_state_machine() -> None:
    assert TRANSITIONS == EXPECTED


def opened(settings: BreakerSettings, now: float = 0.0) -> Breaker:
    b = Breaker(settings)
    for _ in range(settings.failure_threshold):
        b.record(False, now)
    assert b.state is OP
    return b


def half_opened(settings: BreakerSettings, now: float = 100.0) -> Breaker:
    b = opened(settings)
    assert b.available(now)
    assert b.state is H
    return b


# Each row drives one transition through the public API: (id, settings, steps, final state).
# A step is ("ok"|"fail"|"probe-ok"|"probe-fail", now) or ("tick", now) for available(now).
Step = tuple[str, float]
SCENARIOS: list[tuple[str, BreakerSettings, list[Step], BreakerState]] = [
    ("closed-success-stays-closed", BreakerSettings(), [("ok", 0)], C),
    (
        "closed-failures-below-threshold-stay-closed",
        BreakerSettings(failure_threshold=3),
        [("fail", 0), ("fail", 0)],
        C,
    ),
    (
        "closed-threshold-failures-open",
        BreakerSettings(failure_threshold=3),
        [("fail", 0.0)] * 3,
        OP,
    ),
    (
        "threshold-one-opens-on-first-failure",
        BreakerSettings(failure_threshold=1),
        [("fail", 0)],
        OP,
    ),
    (
        "success-resets-the-consecutive-count",
        BreakerSettings(failure_threshold=3),
        [("fail", 0), ("fail", 0), ("ok", 0), ("fail", 0), ("fail", 0)],
        C,
    ),
    (
        "open-late-success-stays-open",
        BreakerSettings(failure_threshold=1),
        [("fail", 0), ("ok", 0.1), ("ok", 0.2)],
        OP,
    ),
    (
        "open-before-cooldown-stays-open",
        BreakerSettings(failure_threshold=1, base_cooldown=5),
        [("fail", 0), ("tick", 4.99)],
        OP,
    ),
    (
        "open-cooldown-elapsed-half-opens",
        BreakerSettings(failure_threshold=1, base_cooldown=5),
        [("fail", 0), ("tick", 5.0)],
        H,
    ),
    (
        "half-open-probe-success-below-threshold-stays",
        BreakerSettings(failure_threshold=1, success_threshold=2),
        [("fail", 0), ("tick", 1), ("probe-ok", 1)],
        H,
    ),
    (
        "half-open-threshold-probe-successes-close",
        BreakerSettings(failure_threshold=1, success_threshold=2),
        [("fail", 0), ("tick", 1), ("probe-ok", 1), ("probe-ok", 1)],
        C,
    ),
    (
        "half-open-probe-failure-reopens",
        BreakerSettings(failure_threshold=3, success_threshold=2),
        [("fail", 0.0)] * 3 + [("tick", 1), ("probe-ok", 1), ("probe-fail", 1)],
        OP,
    ),
    (
        "half-open-ignores-non-probe-answers",
        BreakerSettings(failure_threshold=1, success_threshold=1),
        [("fail", 0), ("tick", 1), ("fail", 1), ("ok", 1)],
        H,
    ),
]


@pytest.mark.parametrize(
    ("settings", "steps", "final"), [s[1:] for s in SCENARIOS], ids=[s[0] for s in SCENARIOS]
)
def test_breaker_transition(
    settings: BreakerSettings, steps: list[Step], final: BreakerState
) -> None:
    b = Breaker(settings)
    for action, now in steps:
        if action == "tick":
            b.available(now)
        elif action.startswith("probe"):
            assert b.available(now)
            probe = b.on_dispatch()
            assert probe
            b.record(action == "probe-ok", now, probe=probe)
        else:
            b.record(action == "ok", now)
    assert b.state is final


def test_open_rejects_and_closed_admits() -> None:
    b = Breaker(BreakerSettings(failure_threshold=1, base_cooldown=2))
    assert b.available(0.0)
    assert b.on_dispatch() == 0  # a closed breaker's requests are not probes
    b.record(False, 0.0)
    assert not b.available(1.999)


def test_cooldown_doubles_on_each_reopening_and_is_capped() -> None:
    s = BreakerSettings(
        failure_threshold=1, success_threshold=1, base_cooldown=1.0, max_cooldown=10.0
    )
    b = opened(s, now=0.0)
    now = 0.0
    cooldowns = []
    for _ in range(7):
        until = b.opened_until
        cooldowns.append(until - now)
        assert not b.available(until - 1e-6)
        assert b.available(until)
        now = until
        probe = b.on_dispatch()
        b.record(False, now, probe=probe)
    expected = [min(1.0 * 2**k, 10.0) for k in range(7)]
    assert cooldowns == pytest.approx(expected)


def _fail_probes(b: Breaker, n: int) -> float:
    """n failed probes in a row; returns the time of the last."""
    now = 0.0
    for _ in range(n):
        now = b.opened_until
        assert b.available(now)
        b.record(False, now, probe=b.on_dispatch())
    return now


def _close(b: Breaker) -> float:
    now = b.opened_until
    assert b.available(now)
    b.record(True, now, probe=b.on_dispatch())
    assert b.state is C
    return now


def test_a_flapping_engine_keeps_backing_off_after_it_closes() -> None:
    # Closing used to reset k: an engine that answered one probe and failed again a
    # second later was retried after 1 s every time, however often it flapped.
    s = BreakerSettings(
        failure_threshold=1, success_threshold=1, base_cooldown=1.0, max_cooldown=60.0
    )
    b = opened(s, now=0.0)
    now = _fail_probes(b, 3)
    assert b.opened_until - now == pytest.approx(8.0)
    cooldowns = []
    for _ in range(5):  # answers a probe, fails a second later, five times
        now = _close(b) + 1.0
        b.record(False, now)
        cooldowns.append(b.opened_until - now)
    assert cooldowns == pytest.approx([16.0, 32.0, 60.0, 60.0, 60.0])


def test_the_backoff_is_forgotten_one_step_per_max_cooldown_closed() -> None:
    s = BreakerSettings(
        failure_threshold=1, success_threshold=1, base_cooldown=1.0, max_cooldown=10.0
    )
    b = opened(s, now=0.0)
    _fail_probes(b, 3)  # k = 3: 8 s
    closed = _close(b)
    b.record(False, closed + 25.0)  # two steps forgotten: 3 + 1 - 2
    assert b.opened_until - (closed + 25.0) == pytest.approx(4.0)
    closed = _close(b)
    b.record(False, closed + 1000.0)  # all forgotten: like a first trip
    assert b.opened_until - (closed + 1000.0) == pytest.approx(1.0)
    assert b.trips == 0


def test_long_outage_keeps_the_cooldown_at_the_cap_without_overflow() -> None:
    # 2000 failed probes at 60 s is ~33 hours down: 2**2000 must not overflow a float.
    s = BreakerSettings(failure_threshold=1, base_cooldown=0.5, max_cooldown=60.0)
    b = opened(s)
    cooldowns = []
    for _ in range(2000):
        now = b.opened_until
        assert b.available(now)
        probe = b.on_dispatch()
        b.record(False, now, probe=probe)
        cooldowns.append(b.opened_until - now)
    assert max(cooldowns) == pytest.approx(60.0)
    assert cooldowns[-1] == pytest.approx(60.0)


def test_half_open_admits_at_most_the_configured_probes_concurrently() -> None:
    s = BreakerSettings(failure_threshold=1, success_threshold=3, half_open_probes=2)
    b = half_opened(s)
    admitted = 0
    probes = []
    while b.available(100.0) and admitted < 10:
        probes.append(b.on_dispatch())
        assert probes[-1]
        admitted += 1
    assert admitted == 2
    b.record(True, 100.0, probe=probes[0])  # one probe answers: one slot frees
    assert b.available(100.0)
    b.on_dispatch()
    assert not b.available(100.0)


def test_cancelled_probe_frees_its_slot_without_a_verdict() -> None:
    s = BreakerSettings(failure_threshold=1, success_threshold=1, half_open_probes=1)
    b = half_opened(s)
    probe = b.on_dispatch()
    assert not b.available(100.0)
    b.release_probe(probe)
    assert b.state is H
    assert b.available(100.0)


def test_release_probe_never_goes_negative() -> None:
    b = half_opened(BreakerSettings(failure_threshold=1, half_open_probes=1))
    b.release_probe(b.period)
    b.release_probe(b.period)
    assert b.probes_inflight == 0
    b.on_dispatch()
    assert not b.available(100.0)  # the slot count was not pushed below zero


def test_reopening_clears_the_probe_slots_for_the_next_half_open() -> None:
    s = BreakerSettings(failure_threshold=1, half_open_probes=2, base_cooldown=1)
    b = half_opened(s)
    b.on_dispatch()
    probe = b.on_dispatch()
    b.record(False, 100.0, probe=probe)  # re-opens while the other probe is in flight
    assert b.state is OP
    assert b.available(b.opened_until)
    assert b.on_dispatch() and b.available(b.opened_until)  # both slots are free again


def test_a_probe_of_an_earlier_half_open_period_neither_frees_a_slot_nor_closes_it() -> None:
    """Streams outlive cooldowns: a probe sent before the breaker re-opened, ending in the
    next half-open period, is not one of that period's probes."""
    b = half_opened(BreakerSettings(failure_threshold=1, success_threshold=1, half_open_probes=2))
    old = b.on_dispatch()  # a long stream
    fail = b.on_dispatch()
    b.record(False, 100.0, probe=fail)  # re-opens while `old` is still streaming
    assert b.state is OP and b.available(b.opened_until)
    new = b.on_dispatch()
    assert new and new != old
    b.record(True, b.opened_until, probe=old)  # the old probe ends well, late
    assert b.state is H  # not closed by a probe of the earlier period
    assert b.probes_inflight == 1  # nor did it free the slot `new` holds
    b.record(True, b.opened_until, probe=new)
    assert b.state is C
