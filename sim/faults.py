"""Fault injection settings of one replica, set from flags or `POST /admin/faults`.

Fields (all optional in a POST, which updates only the fields given):
- `error_rate` (0..1): that share of inference requests answers 500.
- `status` (e.g. 503 or 429, null = off): every inference request answers it (a storm).
- `hang` (bool): inference requests are accepted and never answered.
- `slowdown` (>= 1 typically): every engine step takes this many times longer.
- `metrics` ("ok" | "error" | "garbage"): /metrics answers 500 or unparsable text.
- `health_status` (null or e.g. 503): /health answers it instead of 200.
- `crash` (bool): the replica dies now: the process exits (CLI) or, in an in-process
  fleet, the replica closes its listening socket and drops every connection.
- `crash_after_chunks` (int, null = off): streamed answers are cut (connection closed
  without the last chunk) after that many SSE chunks.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

METRICS_MODES = ("ok", "error", "garbage")


class FaultSpecError(ValueError):
    """A fault update that does not validate; the message names the field."""


@dataclass(frozen=True)
class Faults:
    error_rate: float = 0.0
    status: int | None = None
    hang: bool = False
    slowdown: float = 1.0
    metrics: str = "ok"
    health_status: int | None = None
    crash: bool = False
    crash_after_chunks: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def updated(self, changes: object) -> Faults:
        """A copy with `changes` (a JSON object) applied; raises FaultSpecError."""
        if not isinstance(changes, dict):
            raise FaultSpecError("body must be a JSON object")
        known = {f.name for f in fields(self)}
        for key in changes:
            if key not in known:
                raise FaultSpecError(f"{key}: unknown fault (known: {', '.join(sorted(known))})")
        result = replace(self, **changes)
        result.validate()
        return result

    def validate(self) -> None:
        if isinstance(self.error_rate, bool) or not isinstance(self.error_rate, int | float):
            raise FaultSpecError("error_rate: must be a number")
        if not 0.0 <= self.error_rate <= 1.0:
            raise FaultSpecError("error_rate: must be between 0 and 1")
        for name in ("status", "health_status"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 100 <= value <= 599
            ):
                raise FaultSpecError(f"{name}: must be null or an HTTP status code")
        for name in ("hang", "crash"):
            if not isinstance(getattr(self, name), bool):
                raise FaultSpecError(f"{name}: must be true or false")
        if isinstance(self.slowdown, bool) or not isinstance(self.slowdown, int | float):
            raise FaultSpecError("slowdown: must be a number")
        if self.slowdown <= 0:
            raise FaultSpecError("slowdown: must be > 0")
        if self.metrics not in METRICS_MODES:
            raise FaultSpecError(f"metrics: must be one of {', '.join(METRICS_MODES)}")
        chunks = self.crash_after_chunks
        if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int)):
            raise FaultSpecError("crash_after_chunks: must be null or an integer")
        if chunks is not None and chunks < 0:
            raise FaultSpecError("crash_after_chunks: must be >= 0")


class FaultState:
    """Current faults plus the seeded coin used for `error_rate`."""

    def __init__(self, faults: Faults, seed: int) -> None:
        faults.validate()
        self.faults = faults
        self._rng = random.Random(seed)

    def inference_failure(self) -> int | None:
        """The status an inference request must fail with right now, if any."""
        faults = self.faults
        if faults.status is not None:
            return faults.status
        if faults.error_rate > 0 and self._rng.random() < faults.error_rate:
            return 500
        return None
