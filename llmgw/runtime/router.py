"""The runtime facade both edges use: scheduler + scraper + activator behind one object.

router = Router(config)            # builds Scheduler, Registry, Scraper, Activator
await router.start()
decision = await router.decide(request)   # waits for on-demand models, bounded
lease = router.acquire(decision)          # inflight + keep-alive of on-demand models
...; lease.finish(Outcome.SUCCESS)
await router.stop()
"""

from __future__ import annotations

from llmgw.config import Config
from llmgw.errors import ModelNotReady
from llmgw.runtime.activator import Activator
from llmgw.runtime.controlplanes import ControlPlane
from llmgw.runtime.controlplanes.composite import control_plane_for
from llmgw.runtime.scraper import Scraper
from llmgw.scheduling.scheduler import Lease, Scheduler
from llmgw.types import Decision, Endpoint, Outcome, RequestInfo


class RouterLease:
    """A scheduler Lease that also keeps an on-demand model alive until the request ends."""

    __slots__ = ("_activator", "_lease")

    def __init__(self, lease: Lease, activator: Activator | None) -> None:
        self._lease = lease
        self._activator = activator
        if activator is not None:
            activator.use_begin(lease.model)

    @property
    def endpoint_id(self) -> str:
        return self._lease.endpoint_id

    @property
    def model(self) -> str:
        return self._lease.model

    @property
    def done(self) -> bool:
        return self._lease.done

    def finish(self, outcome: Outcome) -> None:
        if self._lease.done:
            return
        self._lease.finish(outcome)
        if self._activator is not None:
            self._activator.use_end(self._lease.model)


class Router:
    def __init__(
        self,
        config: Config,
        *,
        control_plane: ControlPlane | None = None,
        scrape: bool = True,
        seed: int | None = None,
    ) -> None:
        self.config = config
        self.scheduler = Scheduler(config, seed=seed)
        self.registry = self.scheduler.registry
        self.scraper = Scraper(config, self.registry) if scrape else None
        if control_plane is None:
            control_plane = control_plane_for(config)  # local processes and/or Kubernetes
        self.activator = (
            Activator(config, self.registry, control_plane) if control_plane is not None else None
        )

    async def start(self) -> None:
        if self.scraper is not None:
            await self.scraper.start()
        if self.activator is not None:
            await self.activator.start()

    async def stop(self) -> None:
        if self.scraper is not None:
            await self.scraper.stop()
        if self.activator is not None:
            await self.activator.stop()

    async def decide(self, request: RequestInfo) -> Decision:
        try:
            return self.scheduler.pick(request)
        except ModelNotReady:
            if self.activator is None or not self.activator.manages(request.model):
                raise
        await self.activator.ensure_ready(request.model)
        return self.scheduler.pick(request)

    def acquire(self, decision: Decision, endpoint: Endpoint | None = None) -> RouterLease:
        activator = (
            self.activator if self.activator and self.activator.manages(decision.model) else None
        )
        return RouterLease(self.scheduler.acquire(decision, endpoint), activator)

    def models_status(self) -> dict[str, dict[str, object]]:
        return self.activator.status() if self.activator is not None else {}
