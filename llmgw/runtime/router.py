"""The runtime facade both edges use: scheduler + scraper + activator behind one object.

router = Router(config)            # builds Scheduler, Registry, Scraper, Activator
await router.start()
decision = await router.decide(request)   # waits for on-demand models, bounded
lease = router.acquire(decision)          # inflight + keep-alive of on-demand models
...; lease.finish(Outcome.SUCCESS)
await router.stop()

router.reload(new_config)          # SIGHUP / file change: swap config, keep live state
watcher = ConfigWatcher(path, router.reload)   # `await watcher.run()`: mtime poll
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path

from llmgw.config import Config, ModelMode, ModelSpec, endpoints_of, load_file, model_mode
from llmgw.errors import ConfigError, ModelNotReady
from llmgw.runtime.activator import Activator
from llmgw.runtime.controlplanes import ControlPlane
from llmgw.runtime.controlplanes.composite import control_plane_for
from llmgw.runtime.scraper import Scraper
from llmgw.scheduling.scheduler import Lease, ModelRouter, Scheduler
from llmgw.types import Decision, Endpoint, Outcome, RequestInfo

log = logging.getLogger("llmgw.reload")
_LAUNCHED = (ModelMode.ON_DEMAND, ModelMode.ALWAYS_ON)


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

    def reload(self, config: Config) -> None:
        """Swap in `config` between two requests (everything here runs on the event loop).

        Per-model routers are rebuilt only for models whose spec changed (an unchanged
        model keeps its ring and prefix index); endpoint sets are replaced through
        `Registry.set_endpoints`, so endpoints that stay keep inflight counts, breakers and
        metrics; the scraper follows the new targets. Requests already routed finish on
        the endpoint they were given. Changing an on-demand model's launch or scaling needs
        a restart: such a config is rejected (ConfigError) and nothing changes.
        """
        problems = _restart_only_changes(self.config, config)
        if problems:
            raise ConfigError(problems, "reloaded config")
        scheduler, registry = self.scheduler, self.registry
        routers: dict[str, ModelRouter] = {}
        for name, spec in config.models.items():
            old = scheduler.routers.get(name)
            routers[name] = old if old is not None and old.spec == spec else ModelRouter(name, spec)
        registry.configure(breaker=config.breaker.settings(), staleness=config.scrape.staleness)
        for name in set(self.config.models) | set(config.models):
            if self.activator is not None and self.activator.manages(name):
                continue  # its endpoints are the control plane's
            new_spec = config.models.get(name)
            if new_spec is not None and routers[name].mode is not ModelMode.OFF:
                registry.set_endpoints(name, endpoints_of(name, new_spec))
            elif registry.states(name):
                registry.set_endpoints(name, [])
        scheduler.routers = routers
        scheduler.config = config
        if self.scraper is not None:
            self.scraper.reconfigure(config)
        if self.activator is not None:
            self.activator.config = config
        self.config = config


def _launch_settings(spec: ModelSpec | None) -> object:
    if spec is None or model_mode(spec) not in _LAUNCHED:
        return None
    return (model_mode(spec), spec.launch, spec.scaling)


def _restart_only_changes(old: Config, new: Config) -> list[str]:
    return [
        f"models.{name}: launch and scaling of an on-demand model change only on restart"
        for name in sorted(set(old.models) | set(new.models))
        if _launch_settings(old.models.get(name)) != _launch_settings(new.models.get(name))
    ]


class ConfigWatcher:
    """Reloads from a config file on request (`reload()`, e.g. on SIGHUP) or when its
    modification time or size changes (`run()` polls every `interval` seconds: one stat).

    An invalid file is logged with its path-indexed problems and the running config kept.
    """

    def __init__(
        self, path: str | Path, apply: Callable[[Config], None], *, interval: float = 1.0
    ) -> None:
        self.path = Path(path)
        self.apply = apply
        self.interval = interval
        self.reloads = 0
        self.rejected = 0
        self._seen = self._stamp()

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def reload(self) -> bool:
        """Load the file and apply it; False (old config kept) if it is invalid."""
        self._seen = self._stamp()
        try:
            self.apply(load_file(self.path))
        except ConfigError as exc:
            self.rejected += 1
            log.error(
                "config reload rejected, keeping the running config: %s",
                exc,
                extra={"path": str(self.path), "problems": exc.problems},
            )
            return False
        self.reloads += 1
        log.info("config reloaded from %s", self.path, extra={"path": str(self.path)})
        return True

    def check(self) -> bool | None:
        """Reload if the file changed since the last look; None when it did not."""
        if self._stamp() == self._seen:
            return None
        return self.reload()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.check()
