"""grpc.health.v1 for the ext_proc server (the `grpcio-health-checking` servicer).

Two instances, two meanings:

- the health port (GIE's 9003): `liveness` means `/healthz` (always SERVING while the
  process answers); `readiness`, `inference-extension`, `""` and the ext_proc service name
  mean `/readyz` (started, not draining; not the model servers' health) — the names GIE's
  charts and gateways probe.
- the ext_proc port: `""` and the ext_proc service name are SERVING until SIGTERM (a gateway
  health-checking its ext_proc cluster must keep sending requests while llmgw answers them,
  503s included).

Check is answered from the live state; Watch streams follow `refresh()`, which the server
calls before the health port opens, once the router has started, on drain and once a second.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

PROCESS_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS = "liveness"
READINESS = "readiness"
INFERENCE_EXTENSION = "inference-extension"
READINESS_NAMES = ("", READINESS, INFERENCE_EXTENSION, PROCESS_SERVICE)

Probe = Callable[[str], bool | None]  # service name -> serving? (None: unknown service)


class LiveHealth(health_aio.HealthServicer):  # type: ignore[misc]  # untyped library
    """The library's servicer, with Check computed at call time from `probe`."""

    def __init__(self, probe: Probe, services: tuple[str, ...]) -> None:
        super().__init__()
        self._probe = probe
        self.services = services

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> Any:
        serving = self._probe(request.service)
        if serving is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"unknown service {request.service!r}; known: {', '.join(map(repr, self.services))}",
            )
        return health_pb2.HealthCheckResponse(status=_status(serving))

    async def List(self, request: health_pb2.HealthListRequest, context: Any) -> Any:
        """Every known service's current status (the library leaves List unimplemented)."""
        return health_pb2.HealthListResponse(
            statuses={
                service: health_pb2.HealthCheckResponse(status=_status(self._probe(service)))
                for service in self.services
            }
        )

    async def refresh(self) -> None:
        """Push the current status of every known service to Watch streams."""
        for service in self.services:
            await self.set(service, _status(self._probe(service)))


def _status(serving: bool | None) -> int:
    if serving:
        return int(health_pb2.HealthCheckResponse.SERVING)
    return int(health_pb2.HealthCheckResponse.NOT_SERVING)


def probe_port_health(*, alive: Callable[[], bool], ready: Callable[[], bool]) -> LiveHealth:
    """The health port's servicer (GIE's names)."""

    def probe(service: str) -> bool | None:
        if service == LIVENESS:
            return alive()
        if service in READINESS_NAMES:
            return ready()
        return None

    return LiveHealth(probe, (LIVENESS, *READINESS_NAMES))


def extproc_port_health(*, draining: Callable[[], bool]) -> LiveHealth:
    """The ext_proc port's servicer: serving until drain."""

    def probe(service: str) -> bool | None:
        return not draining() if service in ("", PROCESS_SERVICE) else None

    return LiveHealth(probe, ("", PROCESS_SERVICE))


def add_to_server(servicer: LiveHealth, server: grpc.aio.Server) -> None:
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
