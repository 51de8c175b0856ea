"""Follow the endpoints of models with `discovery:` (a Service, an InferencePool, pods) and
hand every change to one update function (the Router's: registry + scraper).

    discovery = Discovery(config)                  # or Discovery(config, api_client=...)
    await discovery.start(router.set_endpoints)    # raises StartError on RBAC Forbidden
    discovery.staleness()                          # model -> seconds without the API
    await discovery.stop()

A Service is followed through its EndpointSlices (`kubernetes.io/service-name`), an
InferencePool through the object itself (its selector and target ports may change) and
the pods it selects, a pod selector through the pods. Which endpoints take new requests
is decided by `llmgw.discovery` (pure).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kubernetes import client as k8s

from llmgw.config import Config
from llmgw.discovery import (
    INFERENCE_POOL_GROUP,
    INFERENCE_POOL_VERSION,
    SERVICE_NAME_LABEL,
    DiscoverySpec,
    missing_port,
    pod_addresses,
    pool_selection,
    selector_text,
    slice_addresses,
)
from llmgw.runtime.kube import load_client
from llmgw.runtime.kube.reflector import Query, Reflector
from llmgw.types import Endpoint

log = logging.getLogger("llmgw.k8s")

Update = Callable[[str, list[Endpoint]], None]
Publish = Callable[[list[str]], None]


class _Kube:
    """What every follower shares: the client, its API groups and the thread pool."""

    def __init__(self, api_client: Any, pool: ThreadPoolExecutor, options: dict[str, Any]):
        self.api_client = api_client
        self.pool = pool
        self.options = options
        self.core = k8s.CoreV1Api(api_client)
        self.discovery = k8s.DiscoveryV1Api(api_client)
        self.custom = k8s.CustomObjectsApi(api_client)

    def reflector(self, query: Query, on_change: Any, what: str) -> Reflector:
        return Reflector(
            query, on_change, pool=self.pool, api_client=self.api_client, what=what, **self.options
        )


class ModelFollower:
    """One model's source, turned into the list of addresses that take new requests."""

    def __init__(self, model: str, spec: DiscoverySpec, kube: _Kube, publish: Publish) -> None:
        self.model = model
        self.spec = spec
        self.kube = kube
        self.publish = publish
        self.what = f"model {model} ({spec.describe()})"
        self.reflectors: list[Reflector] = []
        self.source_error: str | None = None
        self._pods: Reflector | None = None  # an InferencePool's pods, per selection
        self._selection: tuple[dict[str, str], list[int]] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        if spec.service is not None:
            service = spec.service
            query = Query(
                kube.discovery.list_namespaced_endpoint_slice,
                (service.namespace,),
                "endpointslices.discovery.k8s.io",
                service.namespace,
                label_selector=f"{SERVICE_NAME_LABEL}={service.name}",
            )
            self.reflectors.append(kube.reflector(query, self._slices_changed, self.what))
        elif spec.pods is not None:
            pods = spec.pods
            self.reflectors.append(self._pod_reflector(pods.namespace, pods.selector, [pods.port]))
        else:
            assert spec.inference_pool is not None
            pool = spec.inference_pool
            query = Query(
                kube.custom.list_namespaced_custom_object,
                (INFERENCE_POOL_GROUP, INFERENCE_POOL_VERSION, pool.namespace, "inferencepools"),
                f"inferencepools.{INFERENCE_POOL_GROUP}",
                pool.namespace,
                field_selector=f"metadata.name={pool.name}",
            )
            self.reflectors.append(kube.reflector(query, self._pool_changed, self.what))

    def _slices_changed(self, items: Mapping[str, dict[str, Any]]) -> None:
        service = self.spec.service
        assert service is not None
        others = missing_port(items.values(), service.port)
        error = None
        if others is not None:
            error = (
                f"no endpoint of service {service.namespace}/{service.name} has port "
                f"{service.port!r} (they have {others}): give the pods' port, by name or "
                "number, as discovery.service.port"
            )
            if error != self.source_error:
                log.warning("%s: %s", self.what, error)
        self.source_error = error
        self.publish(slice_addresses(items.values(), service.port))

    def _pod_reflector(self, namespace: str, labels: dict[str, str], ports: list[int]) -> Reflector:
        query = Query(
            self.kube.core.list_namespaced_pod,
            (namespace,),
            "pods",
            namespace,
            label_selector=selector_text(labels),
        )
        return self.kube.reflector(
            query, lambda items: self.publish(pod_addresses(items.values(), ports)), self.what
        )

    def _pool_changed(self, items: Mapping[str, dict[str, Any]]) -> None:
        pool = self.spec.inference_pool
        assert pool is not None
        obj = items.get(pool.name)
        selection: tuple[dict[str, str], list[int]] | None = None
        if obj is None:
            self.source_error = f"inferencepool {pool.namespace}/{pool.name} not found"
        else:
            try:
                selection = pool_selection(obj)
                self.source_error = None
            except ValueError as exc:
                self.source_error = f"inferencepool {pool.namespace}/{pool.name}: {exc}"
        if self.source_error is not None:
            log.error("%s: %s: no endpoints", self.what, self.source_error)
        if selection == self._selection:
            return
        self._selection = selection
        old, self._pods = self._pods, None
        if selection is None:
            self.publish([])
        else:
            self._pods = self._pod_reflector(pool.namespace, *selection)
            self._pods.start()
        if old is not None:
            task = asyncio.create_task(old.stop(), name=f"stop pods of {self.model}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def all_reflectors(self) -> list[Reflector]:
        return self.reflectors + ([self._pods] if self._pods is not None else [])

    def start(self) -> None:
        for reflector in self.reflectors:
            reflector.start()

    async def stop(self) -> None:
        for reflector in self.all_reflectors():
            await reflector.stop()
        for task in list(self._tasks):
            await task

    def stale_seconds(self) -> float:
        return max((r.stale_seconds() for r in self.all_reflectors()), default=0.0)


class Discovery:
    def __init__(
        self,
        config: Config,
        *,
        api_client: Any = None,
        request_timeout: float = 10.0,
        watch_timeout: int = 60,
        backoff: tuple[float, float] = (0.2, 30.0),
        startup_timeout: float = 10.0,
        poll_interval: float = 1.0,
    ) -> None:
        self.config = config
        self.specs = {m: s.discovery for m, s in config.models.items() if s.discovery is not None}
        self.startup_timeout = startup_timeout
        self._api_client = api_client
        self._owns_client = api_client is None
        self._options = {
            "request_timeout": request_timeout,
            "watch_timeout": watch_timeout,
            "backoff": backoff,
            "poll_interval": poll_interval,  # listing, where a watch is refused
        }
        # Two threads per model (a watch, plus a list or the pool's pod watch), two spare.
        self._threads = ThreadPoolExecutor(
            max_workers=2 + 3 * len(self.specs), thread_name_prefix="llmgw-discovery"
        )
        self.followers: dict[str, ModelFollower] = {}
        self.addresses: dict[str, list[str]] = {}
        self._update: Update | None = None

    async def start(self, update: Update) -> None:
        """Follow every discovered model; returns once each has answered its first list (or
        `startup_timeout` passed: an unreachable API is retried, not fatal). Raises
        StartError when RBAC forbids a list."""
        self._update = update
        if not self.specs:
            return
        if self._api_client is None:
            self._api_client = load_client()
        kube = _Kube(self._api_client, self._threads, self._options)
        for model, spec in self.specs.items():
            follower = ModelFollower(model, spec, kube, self._publisher(model))
            self.followers[model] = follower
            follower.start()
        try:
            async with asyncio.timeout(self.startup_timeout):
                listed = [r.listed.wait() for f in self.followers.values() for r in f.reflectors]
                await asyncio.gather(*listed)
                # An InferencePool's pods are listed once the pool was: wait for them too,
                # or a Role that forbids pods let the router start with no endpoints.
                pods = [f.all_reflectors() for f in self.followers.values()]
                await asyncio.gather(*(r.listed.wait() for group in pods for r in group))
        except TimeoutError:
            log.warning("Kubernetes API did not answer within %gs: retrying", self.startup_timeout)
        refused = [
            r.forbidden for f in self.followers.values() for r in f.all_reflectors() if r.forbidden
        ]
        if refused:
            await self.stop()
            raise refused[0]

    def _publisher(self, model: str) -> Publish:
        spec = self.config.models[model]

        def publish(addresses: list[str]) -> None:
            before = self.addresses.get(model)
            if addresses == before:
                return
            self.addresses[model] = addresses
            added = sorted(set(addresses) - set(before or ()))
            removed = sorted(set(before or ()) - set(addresses))
            log.info(
                "model %s endpoints: %d (+%s -%s)",
                model,
                len(addresses),
                ",".join(added) or "none",
                ",".join(removed) or "none",
                extra={"model": model, "added": added, "removed": removed},
            )
            if self._update is not None:
                self._update(
                    model,
                    [
                        Endpoint(address=a, model=model, pool=model, engine=spec.engine)
                        for a in addresses
                    ],
                )

        return publish

    async def stop(self) -> None:
        for follower in self.followers.values():
            await follower.stop()
        self.followers.clear()
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self._owns_client and self._api_client is not None:
            self._api_client.close()
            self._api_client = None

    def staleness(self) -> dict[str, float]:
        """Seconds each model's endpoints have gone without the API (0: current)."""
        return {m: f.stale_seconds() for m, f in self.followers.items()}

    def status(self, model: str) -> dict[str, object]:
        follower = self.followers.get(model)
        if follower is None:
            return {}
        reflectors = follower.all_reflectors()
        errors = [r.last_error for r in reflectors if r.last_error]
        return {
            "source": follower.spec.describe(),
            "endpoints": list(self.addresses.get(model, [])),
            "stale_seconds": follower.stale_seconds(),
            "error": follower.source_error or (errors[0] if errors else None),
        }
