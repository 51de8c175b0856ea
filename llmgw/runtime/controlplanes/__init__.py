"""Control planes start and stop model replicas: local processes or Kubernetes Deployments."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from llmgw.types import Endpoint


class StartError(Exception):
    """A start that did not become healthy; the message says why (kept as the model's last error)."""


CrashCallback = Callable[[str, str], None]  # (model, reason)
EndpointsCallback = Callable[[str, list[Endpoint]], None]  # (model, its ready endpoints)


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


@runtime_checkable
class FollowsEndpoints(Protocol):
    """A control plane whose running models' endpoints change without a start (replicas an
    autoscaler adds, moves or removes): it reports them, the activator feeds the registry."""

    def on_endpoints(self, callback: EndpointsCallback) -> None: ...


@runtime_checkable
class FindsRunning(Protocol):
    """A control plane whose replicas outlive the router (a Deployment): it says which
    models are up when the router starts, so that a model a previous router process left
    running is adopted (its idle timeout then applies) rather than kept up for good."""

    async def running_models(self) -> list[str]: ...
