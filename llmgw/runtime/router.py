"""The runtime facade both edges use: gateway + scraper + activator behind one object.

router = Router(config)            # builds Scheduler, Registry, Scraper, Activator
router = Router.bare(scheduler)    # a given Scheduler as is: no scraping, no activation
await router.start()
lifecycle = Lifecycle(router.gateway, hooks)   # what the edges drive per request
await router.stop()

router.reload(new_config)          # SIGHUP / file change: one snapshot swap, live state kept
watcher = ConfigWatcher(path, router.reload)   # `await watcher.run()`: mtime poll

`decide` / `acquire` serve code that drives the scheduler itself (tools, tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from llmgw.config import Config, ModelMode, load_file, model_mode
from llmgw.errors import ConfigError, ModelNotReady
from llmgw.gateway import Gateway
from llmgw.registry import Registry
from llmgw.runtime.activator import Activator
from llmgw.runtime.controlplanes import ControlPlane
from llmgw.runtime.controlplanes.composite import control_plane_for
from llmgw.runtime.scraper import Scraper
from llmgw.runtime.trace import trace_problem
from llmgw.scheduling.scheduler import Lease, Scheduler
from llmgw.types import Decision, Endpoint, Outcome, RequestInfo

if TYPE_CHECKING:
    from llmgw.runtime.kube.discovery import Discovery
    from llmgw.runtime.kvevents import KvEventSubscribers
    from llmgw.runtime.peers import Peers, PeerStats

log = logging.getLogger("llmgw.reload")

_OFF = "configured but off (scaling max is 0, or launch without a scaling stanza)"


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
        scheduler: Scheduler | None = None,
        discovery: Discovery | None = None,
    ) -> None:
        self.gateway = Gateway(scheduler or Scheduler(config, seed=seed))
        self.registry: Registry = self.gateway.scheduler.registry
        self.scraper = Scraper(self.gateway, self.registry) if scrape else None
        self._warmup()
        if discovery is None and scheduler is None:
            discovery = discovery_for(config)
        self.discovery = discovery
        if control_plane is None and scheduler is None:
            control_plane = control_plane_for(config)  # local processes and/or Kubernetes
        self.activator = (
            Activator(self.gateway, self.registry, control_plane)
            if control_plane is not None
            else None
        )
        self.gateway.activation = self.activator
        self._scrape = scrape
        self._started = False
        self.kv_events: KvEventSubscribers | None = None
        self.peers: Peers | None = None

    @classmethod
    def bare(cls, scheduler: Scheduler) -> Router:
        """`scheduler` used as is (its registry, breakers, ring, seed): nothing scraped or
        started (tests, parity, an app that scrapes itself)."""
        return cls(scheduler.config, scrape=False, scheduler=scheduler)

    @property
    def config(self) -> Config:
        return self.gateway.config

    @property
    def scheduler(self) -> Scheduler:
        return self.gateway.scheduler

    def _warmup(self) -> None:
        # Only a scrape ends a new endpoint's warm-up: without a scraper there is none.
        self.registry.warmup_inflight = (
            self.config.scrape.warmup_inflight if self.scraper is not None else None
        )

    def set_endpoints(self, model: str, endpoints: list[Endpoint]) -> None:
        """A model's endpoints changed (discovery): registry state of those that stay is
        kept; new ones are scraped at once."""
        self.registry.set_endpoints(model, endpoints)
        if self.scraper is not None:
            self.scraper.resync()

    async def start(self) -> None:
        """Raises StartError when Kubernetes discovery is refused (RBAC), or the peers' port
        cannot be bound or their secret is missing (before anything else starts)."""
        # Taken out of the environment: engines this process launches, and any router it
        # starts later, are not workers of the group.
        group, group_key = os.environ.pop(WORKER_GROUP, None), os.environ.pop(WORKER_KEY, None)
        if self.config.peers is not None or group:
            from llmgw.runtime.peers import Peers, workers_spec  # noqa: PLC0415

            if self.config.peers is not None:
                peers = Peers(self.config.peers, lambda: self.scheduler)
            else:  # a worker of `--workers N`: its siblings are its peers
                peers = Peers(
                    workers_spec(),
                    lambda: self.scheduler,
                    siblings=Path(str(group)),
                    key=group_key.encode() if group_key else None,
                )
            await peers.start()
            self.peers = peers
        if self.scraper is not None:
            await self.scraper.start()
        if self.discovery is not None:
            try:
                await self.discovery.start(self.set_endpoints)
            except BaseException:  # refused: leave nothing running behind the error
                if self.scraper is not None:
                    await self.scraper.stop()
                if self.peers is not None:
                    await self.peers.stop()
                    self.peers = None
                raise
        if self.activator is not None:
            await self.activator.start()
        self._started = True
        self._follow_kv_events()

    def _follow_kv_events(self) -> None:
        if not self._scrape:
            return
        if not any(m.kv_events for m in self.config.models.values()):
            if self.kv_events is not None:  # a reload removed the last stanza: follow none
                self.kv_events.config = self.config
                self.kv_events.sync()
            return
        if self.kv_events is None:
            # Imported here: pyzmq and msgpack are an optional extra (the config checked them).
            from llmgw.runtime.kvevents import KvEventSubscribers  # noqa: PLC0415

            self.kv_events = KvEventSubscribers(self.config, self.registry)
        self.kv_events.config = self.config
        self.kv_events.start()

    async def stop(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        self._started = False
        if self.peers is not None:
            await self.peers.stop()
            self.peers = None
        if self.kv_events is not None:
            await self.kv_events.stop()
        if self.scraper is not None:
            await self.scraper.stop()
        if self.activator is not None:
            await self.activator.stop()

    def peer_stats(self) -> PeerStats | None:
        """What `peers:` sent and applied (None: no peers configured, or not started)."""
        return self.peers.stats if self.peers is not None else None

    async def decide(self, request: RequestInfo) -> Decision:
        scheduler = self.scheduler
        try:
            return scheduler.pick(request)
        except ModelNotReady:
            if self.activator is None or not self.activator.manages(request.model):
                raise
        await self.activator.ensure_ready(request.model)
        return scheduler.pick(request)

    def acquire(self, decision: Decision, endpoint: Endpoint | None = None) -> RouterLease:
        activator = self.activator if self.gateway.manages(decision.model) else None
        return RouterLease(self.scheduler.acquire(decision, endpoint), activator)

    def models_status(self) -> dict[str, dict[str, object]]:
        """On-demand models' activation, configured-but-off models, and where discovered
        models' endpoints come from (`/models/status` on the health port)."""
        status = self.activator.status() if self.activator is not None else {}
        for model, spec in self.config.models.items():
            if model_mode(spec) is ModelMode.OFF:  # configured, never started: say so
                status[model] = {"model": model, "state": "off", "reason": _OFF}
        if self.discovery is not None:
            for model in self.discovery.followers:
                status[model] = {"discovery": self.discovery.status(model)}
        return status

    def reload(self, config: Config) -> None:
        """Swap in `config` between two requests (see `Gateway.reload`; raises ConfigError);
        the scraper follows the new targets."""
        self.gateway.reload(config)
        self._warmup()
        if self.scraper is not None:
            self.scraper.resync()
        if self._started:
            self._follow_kv_events()
        if self.peers is not None:
            self.peers.attach()  # the reload may have built new routers (new indexes)


# Set by an edge started with `--workers N` (N > 1) for its worker processes: a directory
# where each registers its peers port, so the workers share what they route.
WORKER_GROUP = "_LLMGW_WORKER_GROUP"
WORKER_KEY = "_LLMGW_WORKER_KEY"  # their shared secret: other local users cannot join
_GROUP_PREFIX = "llmgw-workers-"


@contextlib.contextmanager
def worker_group(workers: int) -> Iterator[None]:
    """Around the serving of `workers` processes: their rendezvous directory and secret, in
    the environment they inherit (nothing for one process). Directories that parents
    killed outright left behind (their pid is in the name) are removed first."""
    if workers < 2:
        yield
        return
    _sweep_groups()
    directory = tempfile.mkdtemp(prefix=f"{_GROUP_PREFIX}{os.getpid()}-")
    os.environ[WORKER_GROUP] = directory
    os.environ[WORKER_KEY] = secrets.token_hex(32)
    try:
        yield
    finally:
        os.environ.pop(WORKER_GROUP, None)
        os.environ.pop(WORKER_KEY, None)
        shutil.rmtree(directory, ignore_errors=True)


def _sweep_groups() -> None:
    for stale in Path(tempfile.gettempdir()).glob(f"{_GROUP_PREFIX}*-*"):
        pid = stale.name.removeprefix(_GROUP_PREFIX).split("-", 1)[0]
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(stale, ignore_errors=True)
        except (ValueError, OSError):  # not ours to judge (another user's, a bad name)
            continue


def workers_problem(config: Config, workers: int) -> str | None:
    """Why `workers` processes of one edge cannot serve this config together (or one
    cannot write its trace), or None."""
    problem = trace_problem(config.trace, workers)
    if problem is None and workers > 1 and config.peers is not None:
        problem = (
            f"peers: with --workers {workers} every process would bind {config.peers.listen}; "
            "run one process per replica (its own pod, or its own listen port) and list "
            "them all in peers.addresses (without peers:, the workers of one process share "
            "what they route by themselves)"
        )
    launched = [
        m
        for m, s in config.models.items()
        if s.launch is not None
        and s.launch.command is not None
        and model_mode(s) is not ModelMode.OFF
    ]
    if problem is None and workers > 1 and launched:
        problem = (
            f"--workers {workers} with a local on-demand model ({', '.join(launched)}: "
            "launch.command): every worker process would start its own engine for it; run "
            "one process (no --workers), or launch the engine yourself and list its endpoint"
        )
    return problem


def discovery_for(config: Config) -> Discovery | None:
    """Kubernetes discovery for the models that ask for it (None: no such model)."""
    discovered = [m for m, s in config.models.items() if s.discovery is not None]
    if not discovered:
        return None
    try:
        from llmgw.runtime.kube.discovery import Discovery  # noqa: PLC0415
    except ImportError as exc:
        raise ImportError(
            f"models {', '.join(discovered)} use Kubernetes discovery: install the "
            f"`kubernetes` client (pip install 'llmgw[k8s]'): {exc}"
        ) from exc
    return Discovery(config)


def router_for(
    config: Config,
    *,
    scheduler: Scheduler | None = None,
    router: Router | None = None,
    scrape: bool = True,
) -> Router:
    """The one rule both edges follow: a given Router; else a given Scheduler used bare
    (no scraping, no activation); else a Router of its own built from `config`."""
    if scheduler is not None and router is not None:
        raise ValueError("pass a scheduler or a router, not both")
    if router is not None:
        return router
    if scheduler is not None:
        return Router.bare(scheduler)
    return Router(config, scrape=scrape)


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

    def _stamp(self) -> tuple[int, ...] | None:
        """What tells a changed file: a file replaced by rename has a new inode, and its
        ctime moves whatever mtime a deployer keeps (`cp -p`, rsync -a, a Nix store
        symlink swap: same size and mtime, and the change went unseen)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev, st.st_ctime_ns

    def reload(self) -> bool:
        """Load the file and apply it; False (old config kept) if it is invalid or loading or
        applying it raised anything else (from a SIGHUP handler it escaped the callback)."""
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
        except Exception as exc:  # a bug building or applying it: kept, counted, logged, not raised
            self.rejected += 1
            log.exception(
                "config reload failed, keeping the running config: %s: %s",
                type(exc).__name__,
                exc,
                extra={"path": str(self.path)},
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
            try:
                self.check()
            except Exception:  # a bug in applying one file must not stop every later reload
                self.rejected += 1
                log.exception("config reload failed, keeping the running config")
