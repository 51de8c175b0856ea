"""On-demand model activation as a pure state machine per model (clock passed in).

    off ──request──► starting ──started──► ready ◄──use──► idle ──idle_timeout──► off
                        │                                     (stop)
                        └──start_failed──► failed ──request after backoff──► starting

The runtime (`llmgw.runtime.activator`) performs the actions this machine asks for
(START, STOP) and does the waiting; nothing here sleeps or does I/O.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from llmgw.errors import LlmgwError, ModelFailed, ModelLoading, NoCapacity


class ActivationState(enum.StrEnum):
    OFF = "off"
    STARTING = "starting"
    READY = "ready"  # running, with requests in flight
    IDLE = "idle"  # running, nothing in flight: the idle timer runs
    FAILED = "failed"


class ActivationEvent(enum.Enum):
    REQUEST = "request"  # a request needs the model
    REQUEST_IN_BACKOFF = "request_in_backoff"  # ... while a failed start's backoff runs
    STARTED = "started"
    START_FAILED = "start_failed"
    USE_BEGIN = "use_begin"
    LAST_USE_END = "last_use_end"
    IDLE_EXPIRED = "idle_expired"
    CRASHED = "crashed"  # the running replica went away on its own


class Action(enum.Enum):
    NONE = "none"
    START = "start"
    STOP = "stop"


A, E, X = ActivationState, ActivationEvent, Action
# (state, event) -> (next state, action). A pair not listed leaves the state alone.
TRANSITIONS: dict[tuple[ActivationState, ActivationEvent], tuple[ActivationState, Action]] = {
    (A.OFF, E.REQUEST): (A.STARTING, X.START),
    (A.FAILED, E.REQUEST): (A.STARTING, X.START),
    (A.IDLE, E.REQUEST): (A.IDLE, X.NONE),
    (A.STARTING, E.STARTED): (A.IDLE, X.NONE),
    (A.STARTING, E.START_FAILED): (A.FAILED, X.NONE),
    (A.IDLE, E.USE_BEGIN): (A.READY, X.NONE),
    (A.READY, E.LAST_USE_END): (A.IDLE, X.NONE),
    (A.IDLE, E.IDLE_EXPIRED): (A.OFF, X.STOP),
    (A.READY, E.CRASHED): (A.FAILED, X.NONE),
    (A.IDLE, E.CRASHED): (A.FAILED, X.NONE),
}


# Retry-After bounds (s) while a model loads; past the expected start, a quarter of the
# time spent so far (a start 2 min in is told 30 s, not 1 s).
RETRY_AFTER_FLOOR = 5
RETRY_AFTER_CAP = 60
OVERDUE_BACKOFF = 0.25


@dataclass(frozen=True, slots=True)
class ActivationSettings:
    idle_timeout: float = 600.0
    expected_start_seconds: float = 30.0
    max_waiting_requests: int = 256
    failure_backoff: float = 10.0
    always_on: bool = False  # min > 0: never idle-stopped, restarted after a failure's backoff


class ModelActivation:
    """One model's activation state; every method takes `now` (seconds, monotonic)."""

    def __init__(self, model: str, settings: ActivationSettings) -> None:
        self.model = model
        self.settings = settings
        self.state = ActivationState.OFF
        self.in_use = 0
        self.waiters = 0
        self.last_error: str | None = None
        self.starting_since: float | None = None
        self.idle_since: float | None = None
        self.failed_at: float | None = None
        self.last_start_seconds: float | None = None
        self.starts = 0
        self.stops = 0

    def _fire(self, event: ActivationEvent, now: float) -> Action:
        step = TRANSITIONS.get((self.state, event))
        if step is None:
            return Action.NONE
        self.state, action = step
        if action is Action.START:
            self.starts += 1
            self.starting_since = now
            self.last_error = None
        elif action is Action.STOP:
            self.stops += 1
            self.idle_since = None
        if self.state is ActivationState.IDLE and self.idle_since is None:
            self.idle_since = now
        elif self.state is not ActivationState.IDLE:
            self.idle_since = None
        return action

    # -- requests ------------------------------------------------------------------------
    def request(self, now: float) -> Action:
        """A request arrives; START once per activation however many requests ask."""
        if self.state is ActivationState.FAILED and not self.backoff_over(now):
            return self._fire(ActivationEvent.REQUEST_IN_BACKOFF, now)
        return self._fire(ActivationEvent.REQUEST, now)

    def backoff_over(self, now: float) -> bool:
        return self.failed_at is None or now - self.failed_at >= self.settings.failure_backoff

    def backoff_left(self, now: float) -> int:
        """Whole seconds until a failed start's backoff is over (a request then starts it)."""
        if self.failed_at is None:
            return 1
        return math.ceil(self.failed_at + self.settings.failure_backoff - now)

    def begin_wait(self, now: float) -> None:
        if self.waiters >= self.settings.max_waiting_requests:
            raise NoCapacity(
                f"{self.waiters} requests already wait for model {self.model!r} to load "
                f"(scaling.max_waiting_requests); retry after the Retry-After delay",
                retry_after=self.retry_after(now),
            )
        self.waiters += 1

    def end_wait(self) -> None:
        self.waiters = max(0, self.waiters - 1)

    def use_begin(self, now: float) -> None:
        self.in_use += 1
        self._fire(ActivationEvent.USE_BEGIN, now)

    def use_end(self, now: float) -> None:
        self.in_use = max(0, self.in_use - 1)
        if self.in_use == 0:
            self._fire(ActivationEvent.LAST_USE_END, now)

    # -- control plane reports -----------------------------------------------------------
    def started(self, now: float) -> None:
        if self.starting_since is not None:
            self.last_start_seconds = now - self.starting_since
        self._fire(ActivationEvent.STARTED, now)
        if self.in_use > 0:
            self._fire(ActivationEvent.USE_BEGIN, now)

    def start_failed(self, error: str, now: float) -> None:
        self.last_error = error
        self.failed_at = now
        self._fire(ActivationEvent.START_FAILED, now)

    def crashed(self, error: str, now: float) -> None:
        self.last_error = error
        self.failed_at = now
        self._fire(ActivationEvent.CRASHED, now)

    def tick(self, now: float, in_use_elsewhere: bool = False) -> Action:
        """Called periodically: STOP once idle for idle_timeout (never with a request in
        flight, this router's or, `in_use_elsewhere`, another router replica's: the idle
        timer restarts); an always-on model is never stopped, and is STARTed again when it
        is off or failed and the backoff is over."""
        if self.settings.always_on:
            if self.state in (ActivationState.OFF, ActivationState.FAILED):
                return self.request(now)
            return Action.NONE
        if in_use_elsewhere and self.state is ActivationState.IDLE:
            self.idle_since = now
            return Action.NONE
        if (
            self.state is ActivationState.IDLE
            and self.in_use == 0
            and self.idle_since is not None
            and now - self.idle_since >= self.settings.idle_timeout
        ):
            return self._fire(ActivationEvent.IDLE_EXPIRED, now)
        return Action.NONE

    # -- answers for waiters -------------------------------------------------------------
    @property
    def failed(self) -> bool:
        return self.state is ActivationState.FAILED

    @property
    def running(self) -> bool:
        return self.state in (ActivationState.READY, ActivationState.IDLE)

    def retry_after(self, now: float) -> int:
        """Seconds until the start is expected to be done, never below RETRY_AFTER_FLOOR
        (each retry itself waits, so a 1 s poll only multiplies waiters); once the start is
        overdue the estimate was wrong: back off by a quarter of the time spent so far."""
        elapsed = now - self.starting_since if self.starting_since is not None else 0.0
        remaining = self.settings.expected_start_seconds - elapsed
        if remaining <= 0:
            remaining = elapsed * OVERDUE_BACKOFF
        return max(RETRY_AFTER_FLOOR, min(RETRY_AFTER_CAP, math.ceil(remaining)))

    def not_ready_error(self, now: float) -> LlmgwError:
        if self.state is ActivationState.FAILED:
            return ModelFailed(
                f"model {self.model!r} failed to start: {self.last_error}; "
                f"the next request after {self.settings.failure_backoff:g}s tries again",
                retry_after=self.backoff_left(now),
            )
        return ModelLoading(
            f"model {self.model!r} is loading; retry after the Retry-After delay",
            retry_after=self.retry_after(now),
        )

    def status(self, now: float) -> dict[str, object]:
        return {
            "model": self.model,
            "state": self.state.value,
            "in_use": self.in_use,
            "waiters": self.waiters,
            "last_error": self.last_error,
            "starts": self.starts,
            "stops": self.stops,
            "last_start_seconds": self.last_start_seconds,
            "idle_for": None if self.idle_since is None else now - self.idle_since,
        }
