"""Kubernetes: scale a model's Deployment from zero and find its pods in EndpointSlices.

    models:
      big:
        launch: {deployment: vllm-big, namespace: models, service: vllm-big, port: 8000}
        scaling: {min: 0, max: 1, start_timeout: 600}

`want()` reads the Deployment's scale subresource and raises it to `max(1, scaling.min)`
replicas (never above `scaling.max`, never lowering a higher count someone else set),
then waits until the EndpointSlices of the Service (`kubernetes.io/service-name=<service>`,
the service defaulting to the deployment name) list a ready endpoint. `stop()` scales to 0.

A follower per running model keeps its slices current: list, then watch from the list's
resourceVersion; when the watch ends or fails it lists again (so a refused watch degrades
to polling the list every `poll_interval`). A model that was ready and has no ready
endpoint left is reported to the `on_crash` callbacks.

The official client is synchronous: its calls run on a small thread pool of our own, so
long-lived watches never hold the loop's default executor (which DNS lookups need).
RBAC this needs: `deploy/k8s/activation-rbac.yaml`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from llmgw.config import Config, LaunchSpec
from llmgw.runtime.controlplanes import CrashCallback, StartError
from llmgw.types import Endpoint

log = logging.getLogger("llmgw.k8s")

T = TypeVar("T")
# Parts of the client without type hints, used through Any (mypy --strict).
_watch_module: Any = k8s_watch
_config_module: Any = k8s_config

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
    """`ip:port` of every ready endpoint in EndpointSlice objects (API JSON, camelCase).

    A nil `conditions.ready` counts as ready (the API says so); the port is the slice's
    port named `http`, else its first port, else `default_port`.
    """
    out: set[str] = set()
    for slice_ in slices:
        ports = [p for p in slice_.get("ports") or [] if p.get("port")]
        named = [p for p in ports if p.get("name") == "http"]
        port = int((named or ports)[0]["port"]) if ports else default_port
        for endpoint in slice_.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            for ip in endpoint.get("addresses") or []:
                out.add(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
    return sorted(out)


def api_error(exc: ApiException, verb: str, target: Target) -> StartError:
    """An API error as a StartError that says what to fix."""
    where = f"in namespace {target.namespace!r}"
    detail = _status_message(exc)
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


def _status_message(exc: ApiException) -> str:
    import json  # noqa: PLC0415 (error path only)

    try:
        body = json.loads(exc.body or "")
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("message"):
        return str(body["message"])
    return f"{exc.status} {exc.reason}".strip()


@dataclass
class _Model:
    """What the control plane knows about one model."""

    target: Target
    slices: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> EndpointSlice
    ready: list[str] = field(default_factory=list)
    serving: bool = False  # want() returned: losing every ready endpoint is a crash
    wanted: int = 0  # replicas we last asked for
    follower: asyncio.Task[None] | None = None
    stopped: threading.Event = field(default_factory=threading.Event)  # ends the follower
    watch: Any = None  # a kubernetes.watch.Watch while one runs
    watch_thread: Future[None] | None = None
    watch_retry_at: float = 0.0  # after a refused watch, list until then
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    follow_error: StartError | None = None  # the follower's last API error, if any
    last_error: str | None = None
    mode: str = "idle"  # idle | list | watch

    def set_slices(self, slices: dict[str, dict[str, Any]]) -> None:
        self.slices = slices
        self.ready = ready_addresses(slices.values(), self.target.port)
        self.changed.set()


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
    ) -> None:
        self.config = config
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

    def _apis(self) -> tuple[k8s.AppsV1Api, k8s.DiscoveryV1Api]:
        if self._apps is None or self._discovery is None:
            if self._api_client is None:
                self._api_client = _load_client()
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
        scaled = await self._scale_up(target, state)
        state.follow_error = None
        self._follow(model, state)
        try:
            await self._wait_ready(state, deadline, timeout)
        except StartError:
            await self._give_up(state, scaled)
            raise
        state.serving = True
        return [
            Endpoint(address=a, model=model, pool=model, engine=spec.engine) for a in state.ready
        ]

    async def _wait_ready(self, state: _Model, deadline: float, timeout: float) -> None:
        target = state.target
        while not state.ready:
            if state.follow_error is not None:
                raise state.follow_error
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
                async with asyncio.timeout(remaining):
                    await state.changed.wait()

    async def _scale_up(self, target: Target, state: _Model) -> bool:
        """Raise the replicas to the target; False when they were already there."""
        apps, _ = self._apis()
        verb = "get deployments/scale"
        try:
            scale = await self._call(
                apps.read_namespaced_deployment_scale,
                target.deployment,
                target.namespace,
                _request_timeout=self.request_timeout,
            )
            current = int(scale.spec.replicas or 0) if scale.spec is not None else 0
            if current >= target.replicas:  # never lower what someone (an HPA) set higher
                state.wanted = current
                return False
            verb = "patch deployments/scale"
            await self._call(
                apps.patch_namespaced_deployment_scale,
                target.deployment,
                target.namespace,
                {"spec": {"replicas": target.replicas}},
                _request_timeout=self.request_timeout,
            )
        except ApiException as exc:
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
        """Scale to 0; returns once the API accepted it (Kubernetes terminates the pods)."""
        lock = self._locks.setdefault(model, asyncio.Lock())
        async with lock:
            state = self._model(model)
            state.serving = False
            await self._unfollow(state)
            try:
                await self._scale_to_zero(state)
            except StartError as exc:
                state.last_error = str(exc)
                log.error("stop of model %s failed: %s", model, exc)

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
        state.set_slices({})
        log.info("scaled deployment %s/%s to 0", target.namespace, target.deployment)

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
            "discovery": state.mode,
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
        if state.follower is None or state.follower.done():
            state.stopped = threading.Event()
            state.follower = asyncio.create_task(self._follow_loop(state), name=f"k8s {model}")

    async def _unfollow(self, state: _Model) -> None:
        task, state.follower = state.follower, None
        if task is None:
            return
        state.stopped.set()
        # Watch.stop() shuts the stream's socket down, but only once the request is made:
        # repeat it until the watch thread has returned (bounded), so no thread lingers.
        deadline = time.monotonic() + self.request_timeout
        while state.watch_thread is not None and not state.watch_thread.done():
            if state.watch is not None:
                state.watch.stop()
            if time.monotonic() > deadline:
                log.warning(
                    "watch of %s did not stop within %gs", state.target.model, self.request_timeout
                )
                break
            await asyncio.sleep(0.02)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        state.mode = "idle"

    async def _follow_loop(self, state: _Model) -> None:
        stopped = state.stopped
        verb = "list/watch discovery.k8s.io endpointslices"
        while not stopped.is_set():
            try:
                version = await self._list(state)
            except ApiException as exc:
                self._follow_failed(state, api_error(exc, verb, state.target), exc.status)
                await asyncio.sleep(self.poll_interval)
                continue
            except Exception as exc:
                self._follow_failed(state, _unreachable(exc, self._api_client), None)
                await asyncio.sleep(self.poll_interval)
                continue
            if not self.use_watch or time.monotonic() < state.watch_retry_at:
                state.mode = "list"
                await asyncio.sleep(self.poll_interval)
                continue
            state.mode = "watch"
            try:
                await self._watch(state, version, stopped)  # until the server ends it
            except ApiException as exc:
                if exc.status == 410:  # our resourceVersion expired: list again
                    continue
                self._watch_refused(state, api_error(exc, verb, state.target), exc.status)
            except Exception as exc:
                if not stopped.is_set():
                    self._watch_refused(state, _unreachable(exc, self._api_client), None)

    def _follow_failed(self, state: _Model, error: StartError, status: int | None) -> None:
        """A failed list: retried every poll_interval; credentials problems fail a start."""
        log.warning("listing the endpoints of %s: %s", state.target.model, error)
        state.last_error = str(error)
        if status in (401, 403):
            state.follow_error = error
            state.changed.set()

    def _watch_refused(self, state: _Model, error: StartError, status: int | None) -> None:
        """A refused or broken watch: poll the list instead for a while, then watch again."""
        log.warning(
            "watching the endpoints of %s failed, listing every %gs for %gs: %s",
            state.target.model,
            self.poll_interval,
            self.watch_retry,
            error,
        )
        state.mode = "list"
        state.watch_retry_at = time.monotonic() + self.watch_retry
        if status in (401, 403):
            state.follow_error = error
            state.changed.set()

    async def _list(self, state: _Model) -> str | None:
        _, discovery = self._apis()
        target = state.target
        result = await self._call(
            discovery.list_namespaced_endpoint_slice,
            target.namespace,
            label_selector=target.selector,
            _request_timeout=self.request_timeout,
        )
        assert self._api_client is not None
        items = self._api_client.sanitize_for_serialization(result.items or [])
        state.follow_error = None
        if not state.stopped.is_set():
            self._apply(state, {s["metadata"]["name"]: s for s in items})
        return result.metadata.resource_version if result.metadata is not None else None

    async def _watch(self, state: _Model, version: str | None, stopped: threading.Event) -> None:
        _, discovery = self._apis()
        target = state.target
        loop = asyncio.get_running_loop()
        watch = state.watch = _watch_module.Watch()

        def on_event(kind: str, obj: dict[str, Any]) -> None:
            name = (obj.get("metadata") or {}).get("name")
            if stopped.is_set() or not name or kind not in ("ADDED", "MODIFIED", "DELETED"):
                return  # BOOKMARK: nothing changed
            slices = dict(state.slices)
            if kind == "DELETED":
                slices.pop(name, None)
            else:
                slices[name] = obj
            self._apply(state, slices)

        def run() -> None:
            stream = watch.stream(
                discovery.list_namespaced_endpoint_slice,
                target.namespace,
                label_selector=target.selector,
                resource_version=version,
                timeout_seconds=self.watch_timeout,
                allow_watch_bookmarks=True,
                _request_timeout=self.watch_timeout + self.request_timeout,
            )
            for event in stream:
                if stopped.is_set():
                    watch.stop()
                    break
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
                    loop.call_soon_threadsafe(on_event, event["type"], event["raw_object"])

        state.watch_thread = self._pool.submit(run)
        try:
            await asyncio.wrap_future(state.watch_thread)
        finally:
            state.watch = None

    def _apply(self, state: _Model, slices: dict[str, dict[str, Any]]) -> None:
        had_ready = bool(state.ready)
        state.set_slices(slices)
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


def _load_client() -> k8s.ApiClient:
    """In-cluster credentials, else the local kubeconfig."""
    try:
        _config_module.load_incluster_config()
    except ConfigException:
        try:
            # KUBECONFIG read now, not when the client was imported (its default).
            _config_module.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
        except (ConfigException, OSError) as exc:
            raise StartError(
                f"no Kubernetes credentials: not running in a cluster and no usable "
                f"kubeconfig ({exc})"
            ) from None
    return k8s.ApiClient()


def _unreachable(exc: Exception, api_client: k8s.ApiClient | None) -> StartError:
    host = api_client.configuration.host if api_client is not None else "?"
    return StartError(f"cannot reach the Kubernetes API at {host}: {type(exc).__name__}: {exc}")
