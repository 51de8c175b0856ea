"""One control plane per launch kind, behind the one `ControlPlane` interface.

A model with `launch.command` runs as a local process, one with `launch.deployment` as a
Kubernetes Deployment; `control_plane_for(config)` builds what the config needs (the
`kubernetes` client is imported only when some model names a deployment).
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.config import Config
from llmgw.runtime.controlplanes import (
    ControlPlane,
    CrashCallback,
    EndpointsCallback,
    FindsRunning,
    FollowsEndpoints,
    StartError,
)
from llmgw.types import Endpoint


class CompositeControlPlane:
    """Sends each model's calls to the control plane that runs it."""

    def __init__(self, planes: Mapping[str, ControlPlane]) -> None:
        self.planes = dict(planes)  # model -> plane
        self._distinct: list[ControlPlane] = []
        for plane in self.planes.values():
            if all(plane is not p for p in self._distinct):
                self._distinct.append(plane)

    def _plane(self, model: str) -> ControlPlane:
        plane = self.planes.get(model)
        if plane is None:
            raise StartError(f"model {model!r} has no launch spec")
        return plane

    async def want(self, model: str) -> list[Endpoint]:
        return await self._plane(model).want(model)

    async def stop(self, model: str) -> None:
        await self._plane(model).stop(model)

    def status(self, model: str) -> dict[str, object]:
        plane = self.planes.get(model)
        return plane.status(model) if plane is not None else {}

    def on_crash(self, callback: CrashCallback) -> None:
        for plane in self._distinct:
            plane.on_crash(callback)

    def on_endpoints(self, callback: EndpointsCallback) -> None:
        for plane in self._distinct:
            if isinstance(plane, FollowsEndpoints):
                plane.on_endpoints(callback)

    async def running_models(self) -> list[str]:
        out: list[str] = []
        for plane in self._distinct:
            if isinstance(plane, FindsRunning):
                out += await plane.running_models()
        return out

    async def close(self) -> None:
        for plane in self._distinct:
            await plane.close()


def control_plane_for(config: Config) -> ControlPlane | None:
    """The control plane(s) the launched models need: None, one kind, or a composite."""
    local = [m for m, s in config.models.items() if s.launch and s.launch.command is not None]
    kube = [m for m, s in config.models.items() if s.launch and s.launch.deployment is not None]
    planes: dict[str, ControlPlane] = {}
    if local:
        from llmgw.runtime.controlplanes.local import LocalProcessControlPlane  # noqa: PLC0415

        planes.update(dict.fromkeys(local, LocalProcessControlPlane(config)))
    if kube:
        try:
            from llmgw.runtime.controlplanes.k8s import KubernetesControlPlane  # noqa: PLC0415
        except ImportError as exc:
            raise ImportError(
                f"models {', '.join(kube)} name a Kubernetes deployment: install the "
                f"`kubernetes` client (pip install 'llmgw[k8s]'): {exc}"
            ) from exc
        planes.update(dict.fromkeys(kube, KubernetesControlPlane(config)))
    if not planes:
        return None
    if not (local and kube):
        return next(iter(planes.values()))
    return CompositeControlPlane(planes)
