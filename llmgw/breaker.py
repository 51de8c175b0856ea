"""Cooldown + circuit breaker as one state machine; the transitions are a table.

closed --(failure_threshold consecutive failures)--> open
open   --(cooldown elapsed: base * 2**k, capped)----> half_open
half_open admits at most `half_open_probes` requests at a time;
half_open --(success_threshold successes)--> closed (k kept)
half_open --(any failure)--> open (k += 1)

k forgets one step for every `max_cooldown` the breaker stays closed (Envoy's outlier
detection decays its ejection multiplier the same way). An engine that reopens sooner is
flapping: it reopens with k + 1, less the steps forgotten. So one that answers a probe or
two and fails again backs off 1, 2, 4 ... s like one that never answered, while an
isolated trip an hour later starts again at `base_cooldown`.

Each half-open period has a number; a probe carries its period's (`on_dispatch`), and only
the current period's probes hold its slots and decide it. A stream outlives a cooldown:
a probe from an earlier period, ending late, neither frees a slot of this one nor counts
toward closing it.

Time is passed in (`now`), so tests drive it without sleeping.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class BreakerEvent(enum.Enum):
    SUCCESS = "success"
    FAILURE = "failure"
    FAILURE_LIMIT = "failure_limit"  # a failure that reaches failure_threshold
    SUCCESS_LIMIT = "success_limit"  # a success that reaches success_threshold
    COOLDOWN_ELAPSED = "cooldown_elapsed"


S, E = BreakerState, BreakerEvent
TRANSITIONS: dict[tuple[BreakerState, BreakerEvent], BreakerState] = {
    (S.CLOSED, E.SUCCESS): S.CLOSED,
    (S.CLOSED, E.SUCCESS_LIMIT): S.CLOSED,
    (S.CLOSED, E.FAILURE): S.CLOSED,
    (S.CLOSED, E.FAILURE_LIMIT): S.OPEN,
    # Late answers to requests sent before the breaker opened do not move it.
    (S.OPEN, E.SUCCESS): S.OPEN,
    (S.OPEN, E.SUCCESS_LIMIT): S.OPEN,
    (S.OPEN, E.FAILURE): S.OPEN,
    (S.OPEN, E.FAILURE_LIMIT): S.OPEN,
    (S.OPEN, E.COOLDOWN_ELAPSED): S.HALF_OPEN,
    (S.HALF_OPEN, E.SUCCESS): S.HALF_OPEN,
    (S.HALF_OPEN, E.SUCCESS_LIMIT): S.CLOSED,
    (S.HALF_OPEN, E.FAILURE): S.OPEN,
    (S.HALF_OPEN, E.FAILURE_LIMIT): S.OPEN,
}


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    failure_threshold: int = 3
    success_threshold: int = 2
    base_cooldown: float = 1.0
    max_cooldown: float = 60.0
    half_open_probes: int = 1


class Breaker:
    __slots__ = (
        "_closed_at",
        "_failures",
        "_successes",
        "opened_until",
        "period",
        "probes_inflight",
        "settings",
        "state",
        "trips",
    )

    def __init__(self, settings: BreakerSettings) -> None:
        self.settings = settings
        self.state = BreakerState.CLOSED
        self.trips = 0  # k in base_cooldown * 2**k: re-openings not yet forgotten
        self._closed_at = -1.0  # when it last closed after a trip; < 0: it never tripped
        self.opened_until = 0.0
        self.probes_inflight = 0
        self.period = 0  # the half-open period's number (counts every half-opening)
        self._failures = 0
        self._successes = 0

    def reconfigure(self, settings: BreakerSettings, now: float) -> None:
        """New settings (a config reload); an open breaker's cooldown ends at the latest
        `max_cooldown` from now (shortened to 5 s, a 300 s cooldown ran on to its end)."""
        self.settings = settings
        if self.state is BreakerState.OPEN and self.opened_until > now + settings.max_cooldown:
            self.opened_until = now + settings.max_cooldown

    def _apply(self, event: BreakerEvent, now: float) -> None:
        before = self.state
        after = TRANSITIONS[(before, event)]
        if after is before:
            return
        self.state = after
        if after is BreakerState.OPEN:
            base, cap = self.settings.base_cooldown, self.settings.max_cooldown
            if before is BreakerState.CLOSED:
                self.trips = self._reopening_trips(now)
            # Stop growing k at the cap: base * 2**k overflows a float after ~1000 trips.
            elif base * 2**self.trips < cap:
                self.trips += 1
            self.opened_until = now + min(base * 2**self.trips, cap)
            self.probes_inflight = 0
        elif after is BreakerState.CLOSED:
            self._closed_at = now
            self.probes_inflight = 0
        else:  # half-open: a new period of probes
            self.period += 1
            self.probes_inflight = 0
        self._failures = 0
        self._successes = 0

    def _reopening_trips(self, now: float) -> int:
        """k for an opening from closed: 0 the first time; after an earlier trip, k + 1
        less one for every `max_cooldown` closed since, at least 0 and no higher than the
        cap needs."""
        if self._closed_at < 0:
            return 0
        base, cap = self.settings.base_cooldown, self.settings.max_cooldown
        forgotten = (now - self._closed_at) / cap if cap > 0 else float("inf")
        if forgotten >= self.trips + 1:
            return 0
        k = self.trips + 1 - int(forgotten)
        while k > 0 and base * 2 ** (k - 1) >= cap:
            k -= 1
        return k

    def available(self, now: float) -> bool:
        """May a request be sent now? Moves open -> half_open once the cooldown is over."""
        if self.state is BreakerState.OPEN and now >= self.opened_until:
            self._apply(BreakerEvent.COOLDOWN_ELAPSED, now)
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.HALF_OPEN:
            return self.probes_inflight < self.settings.half_open_probes
        return False

    def on_dispatch(self) -> int:
        """Note a request sent; returns its half-open period's number if it is a probe
        (give it back to `record` / `release_probe`), else 0."""
        if self.state is BreakerState.HALF_OPEN:
            self.probes_inflight += 1
            return self.period
        return 0

    def _current(self, probe: int) -> bool:
        """A probe of the half-open period in progress (0: not a probe)."""
        return probe != 0 and probe == self.period and self.state is BreakerState.HALF_OPEN

    def record(self, success: bool, now: float, *, probe: int = 0) -> None:
        current = self._current(probe)
        if current and self.probes_inflight > 0:
            self.probes_inflight -= 1
        if self.state is BreakerState.HALF_OPEN and not current:
            # Only this period's probes' outcomes decide a half-open breaker.
            return
        if success:
            self._failures = 0
            self._successes += 1
            limit = self._successes >= self.settings.success_threshold
            self._apply(BreakerEvent.SUCCESS_LIMIT if limit else BreakerEvent.SUCCESS, now)
        else:
            self._successes = 0
            self._failures += 1
            limit = self._failures >= self.settings.failure_threshold
            self._apply(BreakerEvent.FAILURE_LIMIT if limit else BreakerEvent.FAILURE, now)

    def release_probe(self, probe: int) -> None:
        """A probe ended without a verdict (client cancelled): free its slot."""
        if self._current(probe) and self.probes_inflight > 0:
            self.probes_inflight -= 1
