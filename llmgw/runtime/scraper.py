"""Polls every endpoint's /metrics and feeds the registry.

One loop per server address (several models on one server share one scrape), never two
scrapes to one address at once, a timeout per scrape, jitter between them. A failed or
malformed scrape is recorded as an error (the data goes stale); it never trips a breaker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import Counter
from dataclasses import dataclass

from llmgw.config import Config
from llmgw.errors import MetricsError
from llmgw.gateway import ConfigSource, config_source
from llmgw.promtext import CONTRACTS, MetricContract, Sample, extract_samples, select
from llmgw.registry import Registry
from llmgw.runtime.httpget import HttpGetError, KeepAliveGetter

log = logging.getLogger("llmgw.scraper")


@dataclass(frozen=True, slots=True)
class Target:
    model: str
    label: str  # the model_name label value on the page
    contract: MetricContract


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class Scraper:
    def __init__(
        self,
        config: Config | ConfigSource,
        registry: Registry,
        *,
        metrics_path: str | None = None,
    ) -> None:
        self._config = config_source(config)
        self.registry = registry
        self.metrics_path = metrics_path
        self.errors: Counter[str] = Counter()  # address -> failed scrapes
        self.scrapes: Counter[str] = Counter()  # address -> successful scrapes
        self._getters: dict[str, KeepAliveGetter] = {}
        self._loops: dict[str, asyncio.Task[None]] = {}
        self._supervisor: asyncio.Task[None] | None = None
        self._seen_version = -1
        self._rng = random.Random()
        self._targets: tuple[int, Config, dict[str, list[Target]]] | None = None

    @property
    def config(self) -> Config:
        """The current config snapshot: timings and contracts are read from it each time."""
        return self._config.config

    @property
    def interval(self) -> float:
        return self.config.scrape.interval

    @property
    def timeout(self) -> float:
        return self.config.scrape.timeout

    @property
    def jitter(self) -> float:
        return self.config.scrape.jitter

    def resync(self) -> None:
        """After a reload: loops follow the new targets."""
        if self._supervisor is not None:
            self._seen_version = self.registry.version
            self._sync()

    def targets(self) -> dict[str, list[Target]]:
        """Address -> the models it serves, from the registry's current endpoint sets.
        Built once per endpoint set and config (each address's loop asks before each
        scrape: rebuilt every time, a round of N scrapes walked N x N endpoints, and 256
        endpoints with `metrics:` overrides held the event loop 287 ms a timer, p50)."""
        version, config = self.registry.version, self.config
        cached = self._targets
        if cached is not None and cached[0] == version and cached[1] is config:
            return cached[2]
        out = self._build_targets()
        self._targets = (version, config, out)
        return out

    def _build_targets(self) -> dict[str, list[Target]]:
        out: dict[str, list[Target]] = {}
        for state in self.registry.all_states():
            ep = state.endpoint
            spec = self.config.models.get(ep.model)
            if spec is None:
                continue
            contract = CONTRACTS[spec.engine]
            if spec.metrics:
                contract = contract.with_overrides(spec.metrics)
            out.setdefault(ep.address, []).append(
                Target(ep.model, spec.served_name or ep.model, contract)
            )
        return out

    async def scrape_address(self, address: str, targets: list[Target]) -> None:
        getter = self._getters.get(address)
        if getter is None:
            host, port = split_address(address)
            getter = self._getters[address] = KeepAliveGetter(host, port)
        try:
            async with asyncio.timeout(self.timeout):
                path = self.metrics_path or targets[0].contract.path  # None: the engine's
                status, body = await getter.get(path)
            if status != 200:
                raise HttpGetError(f"{path} answered HTTP {status}")
            text = body.decode("utf-8", "replace")
        except (TimeoutError, HttpGetError) as exc:
            await getter.close()
            reason = str(exc) or f"timeout after {self.timeout}s"
            self._fail(address, targets, f"scrape failed: {reason}")
            return
        self.ingest(address, targets, text)

    def ingest(self, address: str, targets: list[Target], text: str) -> bool:
        """Feed one fetched /metrics page to the registry (pure: no I/O; the in-process
        fleet simulator `bench/fleetsim.py` calls it too). False if a target failed."""
        ok = True
        # The page is read once per contract, whatever the models it serves (a base model
        # and its adapters are targets of one page).
        selected: dict[int, list[Sample]] = {}
        for t in targets:
            samples: list[Sample] | None = None
            try:
                samples = selected.get(id(t.contract))
                if samples is None:
                    samples = selected[id(t.contract)] = select(text, t.contract)
                metrics = extract_samples(samples, t.contract, model=t.label)
            except MetricsError as exc:
                ok = False
                absent = samples is not None and _serves_other_models(samples, t)
                self.registry.record_scrape_error(t.model, address, str(exc), model_absent=absent)
                continue
            self.registry.record_scrape(t.model, address, metrics)
        if ok:
            self.scrapes[address] += 1
        else:
            self.errors[address] += 1
        return ok

    def _fail(self, address: str, targets: list[Target], message: str) -> None:
        self.errors[address] += 1
        log.debug("scrape %s: %s", address, message)
        for t in targets:
            self.registry.record_scrape_error(t.model, address, message)

    async def scrape_once(self) -> None:
        await asyncio.gather(*(self.scrape_address(a, t) for a, t in self.targets().items()))

    async def _loop(self, address: str) -> None:
        try:
            while True:
                targets = self.targets().get(address)
                if not targets:
                    return
                await self.scrape_address(address, targets)
                spread = self.interval * self.jitter
                await asyncio.sleep(self.interval + self._rng.uniform(-spread, spread))
        finally:
            # The address left (or the scraper stops): its kept-alive connection goes too;
            # with pods coming and going under new IPs they piled up, half-closed.
            getter = self._getters.pop(address, None)
            if getter is not None:
                await getter.close()
            if address not in self.targets():  # its counts go with it (series per address)
                self.errors.pop(address, None)
                self.scrapes.pop(address, None)

    def _sync(self) -> None:
        """Start loops for new addresses, stop loops of addresses that left."""
        wanted = set(self.targets())
        for address in list(self._loops):
            if address not in wanted or self._loops[address].done():
                self._loops.pop(address).cancel()
        for address in wanted - set(self._loops):
            self._loops[address] = asyncio.create_task(
                self._loop(address), name=f"scrape {address}"
            )

    async def _supervise(self) -> None:
        while True:
            if self.registry.version != self._seen_version or any(
                t.done() for t in self._loops.values()
            ):
                self._seen_version = self.registry.version
                self._sync()
            await asyncio.sleep(self.interval)

    @property
    def running(self) -> bool:
        return self._supervisor is not None

    async def start(self) -> None:
        if self._supervisor is None:
            self._seen_version = self.registry.version
            self._sync()
            self._supervisor = asyncio.create_task(self._supervise(), name="scrape supervisor")

    async def stop(self) -> None:
        tasks = [t for t in (self._supervisor, *self._loops.values()) if t is not None]
        self._supervisor = None
        self._loops.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for getter in self._getters.values():
            await getter.close()
        self._getters.clear()


def _serves_other_models(samples: list[Sample], target: Target) -> bool:
    """True when the page's samples have the contract's metrics, only for other models."""
    try:
        extract_samples(samples, target.contract)
    except MetricsError:
        return False
    return True
