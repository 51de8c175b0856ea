"""What every request and every runtime part reads: one immutable snapshot, swapped as one.

    gateway = Gateway(Scheduler(config))          # or Gateway(scheduler, activation=activator)
    gateway.config, gateway.scheduler             # the current snapshot's parts
    gateway.reload(new_config)                    # build a new snapshot, then one assignment

A reload never writes into a live object: it builds a new `Scheduler` over the same
`Registry` (per-model routers of unchanged models carried over, so rings and prefix
indexes survive), updates the registry's endpoint sets, and publishes the new `Snapshot`
with one assignment. A request keeps the snapshot it started with until it ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from llmgw.config import Config, ModelMode, ModelSpec, endpoints_of, model_mode
from llmgw.errors import ConfigError
from llmgw.registry import Registry
from llmgw.scheduling.scheduler import Scheduler

_LAUNCHED = (ModelMode.ON_DEMAND, ModelMode.ALWAYS_ON)


class Activation(Protocol):
    """The on-demand side a request's lifecycle talks to (`llmgw.runtime.activator.Activator`)."""

    def manages(self, model: str) -> bool: ...

    def use_begin(self, model: str) -> None: ...

    def use_end(self, model: str) -> None: ...

    async def ensure_ready(self, model: str) -> None: ...


class ConfigSource(Protocol):
    """Anything that hands out the current config (a Gateway, or a fixed config)."""

    @property
    def config(self) -> Config: ...


@dataclass(frozen=True, slots=True)
class FixedConfig:
    """A config that never changes, as a ConfigSource (tests, one-off tools)."""

    config: Config


def config_source(source: Config | ConfigSource) -> ConfigSource:
    return FixedConfig(source) if isinstance(source, Config) else source


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One config and the scheduler built for it."""

    config: Config
    scheduler: Scheduler


class Gateway:
    """The current Snapshot plus the on-demand activation (None: static models only)."""

    __slots__ = ("activation", "snapshot")

    def __init__(self, scheduler: Scheduler, *, activation: Activation | None = None) -> None:
        self.snapshot = Snapshot(scheduler.config, scheduler)
        self.activation = activation

    @property
    def config(self) -> Config:
        return self.snapshot.config

    @property
    def scheduler(self) -> Scheduler:
        return self.snapshot.scheduler

    def manages(self, model: str) -> bool:
        """Is `model` started on demand (its endpoints come from the control plane)?"""
        return self.activation is not None and self.activation.manages(model)

    def reload(self, config: Config) -> None:
        """Route requests that arrive from now on with `config`; raises ConfigError.

        Endpoints that stay keep inflight counts, breakers and metrics; requests already
        routed finish on the endpoint they were given. A changed `seed` re-seeds the random
        choices as a start would (an unchanged one keeps their state going). Launch and scaling of a launched
        model, discovery sources and the decision trace change only on restart: such a
        config is rejected and nothing changes.
        """
        old = self.snapshot
        problems = restart_only_changes(old.config, config)
        if problems:
            raise ConfigError(problems, "reloaded config")
        registry = old.scheduler.registry
        # Built over a scratch registry (its constructor would also set the endpoints of
        # models the control plane owns), then pointed at the live one before publishing;
        # built before the live registry changes, so a build that raises changes nothing.
        scheduler = Scheduler(config, Registry())
        registry.configure(breaker=config.breaker.settings(), staleness=config.scrape.staleness)
        scheduler.registry = registry
        if config.seed == old.config.seed:
            scheduler.rng = old.scheduler.rng  # else the new seed's, as at a start
        for name, router in old.scheduler.routers.items():
            spec = config.models.get(name)
            if spec is None:
                continue
            if router.spec != spec and _but_endpoints(router.spec) == _but_endpoints(spec):
                # Only the endpoint list changed (a replica added, a weight): the same
                # plugins carry on, as with discovery; their ring follows the registry's
                # endpoints, and an endpoint that leaves is forgotten there. Rebuilt, the
                # prefix index lost every endpoint's, and every session its cache home.
                router.spec = spec
            if router.spec == spec:
                scheduler.routers[name] = router  # keeps its ring and prefix index
        # Every model set before any engine's KV index is forgotten: a model renamed, or an
        # endpoint moved to another model, is listed again by the end (in set order, the
        # old name first, its cache was forgotten in some processes, not in others).
        listed = {s.id for s in registry.all_states()}
        for name in set(old.config.models) | set(config.models):
            if self.manages(name) or discovered(old.config, name):
                continue  # its endpoints are the control plane's or discovery's
            spec = config.models.get(name)
            if spec is not None and scheduler.routers[name].mode is not ModelMode.OFF:
                registry.set_endpoints(name, endpoints_of(name, spec), forget=False)
            elif registry.states(name):
                registry.set_endpoints(name, [], forget=False)
        registry.forget_unlisted(listed)
        self.snapshot = Snapshot(config, scheduler)


def _but_endpoints(spec: ModelSpec) -> ModelSpec:
    return spec.model_copy(update={"endpoints": ()})


def _launch_settings(spec: ModelSpec | None) -> object:
    if spec is None or model_mode(spec) not in _LAUNCHED:
        return None
    return (model_mode(spec), spec.launch, spec.scaling)


def discovered(config: Config, model: str) -> bool:
    """Are the model's endpoints followed on Kubernetes (`discovery:`)?"""
    spec = config.models.get(model)
    return spec is not None and spec.discovery is not None


def restart_only_changes(old: Config, new: Config) -> list[str]:
    names = sorted(set(old.models) | set(new.models))
    launch = [
        f"models.{name}: launch and scaling of an on-demand model change only on restart"
        for name in names
        if _launch_settings(old.models.get(name)) != _launch_settings(new.models.get(name))
    ]
    found = [
        f"models.{name}.discovery: where a model's endpoints are discovered changes only on restart"
        for name in names
        if (discovered(old, name) or discovered(new, name))
        and _discovery(old, name) != _discovery(new, name)
    ]
    # The edges open the decision trace once, at start (runtime/trace.py).
    trace = ["trace: the decision trace changes only on restart"] if old.trace != new.trace else []
    peers = ["peers: the peer replicas change only on restart"] if old.peers != new.peers else []
    return launch + found + trace + peers


def _discovery(config: Config, model: str) -> object:
    spec = config.models.get(model)
    return spec.discovery if spec is not None else None
