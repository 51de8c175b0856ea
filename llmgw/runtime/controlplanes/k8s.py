"""Kubernetes: scale a model's Deployment from zero and find its pods in EndpointSlices.

    models:
      big:
        launch: {deployment: vllm-big, namespace: models, service: vllm-big, port: 8000}
        scaling: {min: 0, max: 1, start_timeout: 600}

`want()` reads the Deployment's scale subresource and raises it to `max(1, scaling.min)`
replicas (never above `scaling.max`, never lowering a higher count someone else set),
then waits until the EndpointSlices of the Service (`kubernetes.io/service-name=<service>`,
the service defaulting to the deployment name) list a ready endpoint. `stop()` scales to 0
and returns once the pods are gone from the slices (at most `stop_timeout`).

The follower of a running model is the one Kubernetes discovery uses (`runtime.kube.
reflector`: list + watch, bookmarks, 410 re-list, backoff; a refused watch degrades to
polling the list every `poll_interval`). Replicas an autoscaler adds, moves or removes
after the start reach the `on_endpoints` callbacks (the activator: the registry); a model
that was ready and has no ready endpoint left is reported to the `on_crash` callbacks.

The official client is synchronous: its calls run on a small thread pool of our own, so
long-lived watches never hold the loop's default executor (which DNS lookups need).
RBAC this needs: `deploy/k8s/activation-rbac.yaml`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from llmgw.config import Config, LaunchSpec
from llmgw.discovery import slice_addresses
from llmgw.runtime.controlplanes import CrashCallback, EndpointsCallback, StartError
from llmgw.runtime.kube import load_client, status_message
from llmgw.runtime.kube.reflector import Query, Reflector
from llmgw.types import Endpoint

SCALE_CONFLICT_TRIES = 5  # reads of the scale after a 409 before a start gives up
RECHECK_SCALE_S = 5.0  # a start waiting for pods looks at the replica count this often

log = logging.getLogger("llmgw.k8s")

T = TypeVar("T")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
RBAC_HINT = (
    "apply deploy/k8s/activation-rbac.yaml (or an equivalent Role) for llmgw's service account"
)


@dataclass(frozen=True, slots=True)
class Target:
    """Where one model lives in the cluster."""

    model: str
    namespace: str
    deployment: str
    service: str
    port: int
    replicas: int

    @property
    def selector(self) -> str:
        return f"{SERVICE_NAME_LABEL}={self.service}"


def target_of(model: str, launch: LaunchSpec, scaling_min: int, scaling_max: int | None) -> Target:
    if launch.deployment is None:
        raise StartError(f"model {model!r} has no launch.deployment")
    wanted = max(1, scaling_min)
    if scaling_max is not None:
        wanted = min(wanted, scaling_max)
    return Target(
        model=model,
        namespace=launch.namespace,
        deployment=launch.deployment,
        service=launch.service or launch.deployment,
        port=launch.port,
        replicas=wanted,
    )


def ready_addresses(slices: Iterable[Mapping[str, Any]], default_port: int) -> list[str]:
    """`ip:port` of every ready endpoint in EndpointSlice objects (API JSON, camelCase):
    the discovery rule (`llmgw.discovery.slice_addresses`) at `launch.port` where the
    slices list it, else the port named `http`, else the slice's first port, else
    `default_port` (a Service listing a metrics port first was routed there)."""
    slices = list(slices)
    listed = any(
        int(p.get("port") or 0) == default_port for s in slices for p in s.get("ports") or []
    )
    return slice_addresses(slices, default_port if listed else None, default_port)


def api_error(exc: ApiException, verb: str, target: Target) -> StartError:
    """An API error as a StartError that says what to fix."""
    where = f"in namespace {target.namespace!r}"
    detail = status_message(exc)
    if exc.status == 403:
        return StartError(
            f"RBAC: the service account cannot {verb} {where}; {RBAC_HINT} ({detail})"
        )
    if exc.status == 401:
        return StartError(
            f"Kubernetes API rejected the credentials ({verb} {where}): check the service "
            f"account token or kubeconfig ({detail})"
        )
    if exc.status == 404 and "deployments" in verb:
        return StartError(
            f"deployment {target.namespace}/{target.deployment} not found: check "
            f"launch.deployment and launch.namespace ({detail})"
        )
    return StartError(f"Kubernetes API error {exc.status} on {verb} {where}: {detail}")


@dataclass
class _Model:
    """What the control plane knows about one model."""

    target: Target
    slices: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> EndpointSlice
    ready: list[str] = field(default_factory=list)
    serving: bool = False  # want() returned: losing every ready endpoint is a crash
    wanted: int = 0  # replicas we last asked for
    reflector: Reflector | None = None  # follows the Service's slices while running
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    last_error: str | None = None

    def set_slices(self, slices: dict[str, dict[str, Any]]) -> None:
        self.slices = slices
        self.ready = ready_addresses(slices.values(), self.target.port)
        self.changed.set()

    @property
    def follow_error(self) -> StartError | None:
        """RBAC refused the follower's list or watch: a start cannot succeed."""
        return self.reflector.forbidden if self.reflector is not None else None

    @property
    def pods_listed(self) -> bool:
        """Does any slice still list an endpoint (a pod, ready or terminating)?"""
        return any(s.get("endpoints") for s in self.slices.values())


class KubernetesControlPlane:
    def __init__(
        self,
        config: Config,
        *,
        api_client: k8s.ApiClient | None = None,
        poll_interval: float = 1.0,
        watch: bool = True,
        watch_timeout: int = 60,
        watch_retry: float = 60.0,
        request_timeout: float = 10.0,
        stop_timeout: float = 120.0,
        blind_after: float = 5.0,
    ) -> None:
        self.config = config
        self.stop_timeout = stop_timeout
        # Seconds the pods' API may stay lost before a stop stops waiting to see them go.
        self.blind_after = blind_after
        self.poll_interval = poll_interval
        self.use_watch = watch
        self.watch_timeout = watch_timeout
        self.watch_retry = watch_retry
        self.request_timeout = request_timeout
        self._api_client: Any = api_client
        self._owns_client = api_client is None
        self._apps: k8s.AppsV1Api | None = None
        self._discovery: k8s.DiscoveryV1Api | None = None
        self._models: dict[str, _Model] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._callbacks: list[CrashCallback] = []
        self._endpoint_callbacks: list[EndpointsCallback] = []
        workers = 2 + 2 * sum(1 for s in config.models.values() if s.launch and s.launch.deployment)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="llmgw-k8s")
        # The client imports its (large) API modules on first use: pay that now, not
        # on the first cold request.
        self._api_classes = (
            k8s.AppsV1Api,
            k8s.DiscoveryV1Api,
            k8s.V1Scale,
            k8s.V1EndpointSliceList,
        )

    # -- plumbing ------------------------------------------------------------------------
    def on_crash(self, callback: CrashCallback) -> None:
        self._callbacks.append(callback)

    def on_endpoints(self, callback: EndpointsCallback) -> None:
        """Called with a running model's ready endpoints whenever they change."""
        self._endpoint_callbacks.append(callback)

    def _endpoints(self, model: str) -> list[Endpoint]:
        spec = self.config.models[model]
        state = self._models[model]
        return [
            Endpoint(address=a, model=model, pool=model, engine=spec.engine) for a in state.ready
        ]

    def _apis(self) -> tuple[k8s.AppsV1Api, k8s.DiscoveryV1Api]:
        if self._apps is None or self._discovery is None:
            if self._api_client is None:
                self._api_client = load_client()
            self._apps = k8s.AppsV1Api(self._api_client)
            self._discovery = k8s.DiscoveryV1Api(self._api_client)
        return self._apps, self._discovery

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def _model(self, model: str) -> _Model:
        state = self._models.get(model)
        if state is None:
            spec = self.config.models.get(model)
            if spec is None or spec.launch is None:
                raise StartError(f"model {model!r} has no launch spec")
            scaling = spec.scaling
            target = target_of(
                model, spec.launch, scaling.min if scaling else 0, scaling.max if scaling else 1
            )
            state = self._models[model] = _Model(target)
        return state

    # -- the ControlPlane interface ------------------------------------------------------
    async def want(self, model: str) -> list[Endpoint]:
        lock = self._locks.setdefault(model, asyncio.Lock())
        async with lock:
            state = self._model(model)
            try:
                return await self._want(model, state)
            except StartError as exc:
                state.last_error = str(exc)
                raise

    async def _want(self, model: str, state: _Model) -> list[Endpoint]:
        target = state.target
        if target.replicas < 1:
            raise StartError(f"model {model!r} has scaling.max 0: it is off")
        spec = self.config.models[model]
        timeout = spec.scaling.start_timeout if spec.scaling else 300.0
        deadline = time.monotonic() + timeout
        scaled = await self._ensure_replicas(target, state)
        self._follow(model, state)
        try:
            await self._wait_ready(state, deadline, timeout)
        except StartError:
            await self._give_up(state, scaled)
            raise
        state.serving = True
        return self._endpoints(model)

    async def _wait_ready(self, state: _Model, deadline: float, timeout: float) -> None:
        target = state.target
        # Someone may scale the Deployment to 0 meanwhile (another llmgw replica's idle
        # stop that had not heard of this request, a kubectl scale): looked at again every
        # so often, raised back (it waited its whole start_timeout on 0 replicas).
        recheck = min(RECHECK_SCALE_S, timeout / 4)
        checked = time.monotonic()
        while not state.ready:
            if state.follow_error is not None:
                raise state.follow_error
            if time.monotonic() - checked >= recheck:
                checked = time.monotonic()
                await self._ensure_replicas(target, state)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StartError(
                    f"no ready endpoint in the EndpointSlices of service "
                    f"{target.namespace}/{target.service} within {timeout:g}s after scaling "
                    f"deployment {target.deployment} to {state.wanted}: check the pods' events, "
                    f"image pull and readiness probe, or raise scaling.start_timeout"
                )
            state.changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(remaining, recheck)):
                    await state.changed.wait()

    async def _read_scale(self, target: Target) -> Any:
        apps, _ = self._apis()
        return await self._call(
            apps.read_namespaced_deployment_scale,
            target.deployment,
            target.namespace,
            _request_timeout=self.request_timeout,
        )

    async def _ensure_replicas(self, target: Target, state: _Model) -> bool:
        """Raise the replicas to the target; False when they were already there."""
        apps, _ = self._apis()
        for attempt in range(SCALE_CONFLICT_TRIES):
            verb = "get deployments/scale"
            try:
                scale = await self._read_scale(target)
                current = int(scale.spec.replicas or 0) if scale.spec is not None else 0
                if current >= target.replicas:  # never lower what someone (an HPA) set higher
                    state.wanted = current
                    return False
                verb = "patch deployments/scale"
                # On the version read: a count someone set since (an autoscaler scaling
                # from 0, kubectl) is a 409, read again, not overwritten with a lower one.
                seen = scale.metadata.resource_version if scale.metadata is not None else None
                patch: dict[str, Any] = {"spec": {"replicas": target.replicas}}
                if seen:
                    patch["metadata"] = {"resourceVersion": seen}
                await self._call(
                    apps.patch_namespaced_deployment_scale,
                    target.deployment,
                    target.namespace,
                    patch,
                    _request_timeout=self.request_timeout,
                )
                break
            except ApiException as exc:
                if exc.status == 409 and attempt + 1 < SCALE_CONFLICT_TRIES:
                    continue
                raise api_error(exc, verb, target) from None
            except Exception as exc:  # urllib3 connection errors and the like
                raise _unreachable(exc, self._api_client) from None
        state.wanted = target.replicas
        log.info(
            "scaled deployment %s/%s to %d for model %s",
            target.namespace,
            target.deployment,
            target.replicas,
            target.model,
        )
        return True

    async def _give_up(self, state: _Model, scaled: bool) -> None:
        """A failed start scales back to 0 (like a local process that is killed), unless
        the replicas were not ours to begin with."""
        await self._unfollow(state)
        if scaled:
            with contextlib.suppress(StartError):
                await self._scale_to_zero(state)

    async def stop(self, model: str) -> None:
        """Scale to 0; returns once the pods are gone from the Service's EndpointSlices
        (they may take their grace period to drain), at most `stop_timeout`."""
        lock = self._locks.setdefault(model, asyncio.Lock())
        async with lock:
            state = self._model(model)
            state.serving = False
            try:
                await self._scale_to_zero(state)
                self._follow(model, state)
                await self._wait_gone(state)
            except StartError as exc:
                state.last_error = str(exc)
                raise  # the activator tries again (the replicas would keep their GPUs)
            finally:
                await self._unfollow(state)

    async def _wait_gone(self, state: _Model) -> None:
        """Until the deployment's pods are gone (`stop_timeout` at most), unless the API is
        refused or lost for `blind_after` seconds."""
        reflector = state.reflector
        assert reflector is not None
        try:
            async with asyncio.timeout(self.stop_timeout):
                while not (reflector.listed.is_set() and not state.pods_listed):
                    if reflector.forbidden is not None:
                        break
                    # One failed watch or list (a 500, a throttled 429) is followed by a list
                    # a moment later: wait through it; lost for longer, do not wait blind.
                    lost = reflector.stale_seconds() if reflector.stale_since is not None else 0.0
                    if lost >= self.blind_after:
                        break
                    state.changed.clear()  # set by a list and by a failure (on_error)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self.blind_after - lost if lost else None):
                            await state.changed.wait()
            if reflector.stale_since is not None:  # cannot see the pods go: do not wait blind
                log.warning(
                    "scaled %s to 0 but cannot follow its pods: %s",
                    state.target.deployment,
                    reflector.last_error,
                )
        except TimeoutError:
            target = state.target
            log.warning(
                "pods of deployment %s/%s still listed %gs after scaling to 0",
                target.namespace,
                target.deployment,
                self.stop_timeout,
            )

    async def _scale_to_zero(self, state: _Model) -> None:
        apps, _ = self._apis()
        target = state.target
        try:
            await self._call(
                apps.patch_namespaced_deployment_scale,
                target.deployment,
                target.namespace,
                {"spec": {"replicas": 0}},
                _request_timeout=self.request_timeout,
            )
        except ApiException as exc:
            raise api_error(exc, "patch deployments/scale", target) from None
        except Exception as exc:
            raise _unreachable(exc, self._api_client) from None
        state.wanted = 0
        log.info("scaled deployment %s/%s to 0", target.namespace, target.deployment)

    async def running_models(self) -> list[str]:
        """The models whose Deployment has replicas now (a previous llmgw process may have
        left them up: `close` does not scale to 0, another router may be using them). A
        model whose scale cannot be read is left out."""
        up = []
        for model, spec in self.config.models.items():
            if spec.launch is None or spec.launch.deployment is None:
                continue
            target = self._model(model).target
            try:
                scale = await self._read_scale(target)
            except Exception as exc:  # the API away, RBAC: nothing adopted, said why
                log.warning("cannot read the scale of deployment %s: %s", target.deployment, exc)
                continue
            if scale.spec is not None and int(scale.spec.replicas or 0) > 0:
                up.append(model)
        return up

    def status(self, model: str) -> dict[str, object]:
        state = self._models.get(model)
        if state is None:
            return {"running": False}
        target = state.target
        return {
            "running": bool(state.ready),
            "deployment": f"{target.namespace}/{target.deployment}",
            "service": target.service,
            "replicas_wanted": state.wanted,
            "ready_endpoints": list(state.ready),
            "discovery": state.reflector.mode if state.reflector is not None else "idle",
            "last_error": state.last_error,
        }

    async def close(self) -> None:
        for state in self._models.values():
            await self._unfollow(state)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._owns_client and self._api_client is not None:
            self._api_client.close()

    # -- following the EndpointSlices ----------------------------------------------------
    def _follow(self, model: str, state: _Model) -> None:
        if state.reflector is not None:
            return
        _, discovery = self._apis()
        target = state.target
        query = Query(
            discovery.list_namespaced_endpoint_slice,
            (target.namespace,),
            "endpointslices.discovery.k8s.io",
            target.namespace,
            label_selector=target.selector,
        )
        state.reflector = Reflector(
            query,
            lambda items: self._apply(state, dict(items)),
            pool=self._pool,
            api_client=self._api_client,
            what=f"model {model} (service {target.namespace}/{target.service})",
            request_timeout=self.request_timeout,
            watch_timeout=self.watch_timeout,
            backoff=(self.poll_interval, max(self.poll_interval, 10.0)),
            watch=self.use_watch,
            poll_interval=self.poll_interval,
            watch_retry=self.watch_retry,
            on_forbidden=lambda verb, exc: api_error(
                exc, "list/watch discovery.k8s.io endpointslices", target
            ),
            on_error=state.changed.set,
        )
        state.reflector.start()

    async def _unfollow(self, state: _Model) -> None:
        reflector, state.reflector = state.reflector, None
        if reflector is not None:
            await reflector.stop()
        # Unfollowed, its pods are unknown: a start must not take the last ones seen as
        # ready (a stop whose pods could not be seen going left them there).
        state.set_slices({})

    def _apply(self, state: _Model, slices: dict[str, dict[str, Any]]) -> None:
        before = state.ready
        had_ready = bool(before)
        state.set_slices(slices)
        if state.serving and state.ready and state.ready != before:
            # An autoscaler (or a person) scaled, a pod moved or turned (not) ready.
            endpoints = self._endpoints(state.target.model)
            for on_endpoints in self._endpoint_callbacks:
                on_endpoints(state.target.model, endpoints)
        if state.serving and had_ready and not state.ready:
            state.serving = False
            target = state.target
            reason = (
                f"no ready endpoint left in the EndpointSlices of service "
                f"{target.namespace}/{target.service} (pods crashed, evicted or failing "
                f"their readiness probe)"
            )
            state.last_error = reason
            for callback in self._callbacks:
                callback(target.model, reason)


def _unreachable(exc: Exception, api_client: k8s.ApiClient | None) -> StartError:
    host = api_client.configuration.host if api_client is not None else "?"
    return StartError(f"cannot reach the Kubernetes API at {host}: {type(exc).__name__}: {exc}")
