"""Control planes start and stop model replicas: local processes or Kubernetes Deployments."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from llmgw.types import Endpoint


class StartError(Exception):
    """A start that did not become healthy; the message says why (kept as the model's last error)."""


CrashCallback = Callable[[str, str], None]  # (model, reason)


class ControlPlane(Protocol):
    async def want(self, model: str) -> list[Endpoint]:
        """Start the model (if not running) and return its ready endpoints; raise StartError."""
        ...

    async def stop(self, model: str) -> None:
        """Stop every replica of the model; returns when they are gone."""
        ...

    def status(self, model: str) -> dict[str, object]: ...

    def on_crash(self, callback: CrashCallback) -> None:
        """Register a callback for replicas that exit without being asked to."""
        ...

    async def close(self) -> None: ...
