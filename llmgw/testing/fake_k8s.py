"""A fake Kubernetes API server (aiohttp) for the tests and benchmarks of Kubernetes discovery
and the Kubernetes control plane.

It speaks the real paths and JSON of the two APIs llmgw uses, so the official client
talks to it unchanged (`Configuration(host="http://127.0.0.1:PORT")`):

- `GET|PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale` -> `autoscaling/v1`
  `Scale`; PATCH takes merge-patch, strategic-merge-patch or JSON-patch bodies.
- `GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector=...` ->
  `EndpointSliceList`; with `watch=true`, newline-delimited watch events
  (`{"type": "ADDED|MODIFIED|DELETED|BOOKMARK|ERROR", "object": ...}`) after
  `resourceVersion`, until `timeoutSeconds`.
- `GET /api/v1/namespaces/{ns}/pods` and
  `GET /apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools` (label and
  `metadata.name` field selectors), list and watch, over objects put by the test.
- Watches that allow bookmarks get a BOOKMARK before the server ends them.
- Errors are `v1` `Status` objects (403 Forbidden, 404 NotFound, 410 Expired; 429 or 500
  on the lists `list_errors` names; ERROR events of the codes `watch_errors` names).
- `empty_watches`: watches ended at once with no event (a proxy cutting long requests).
- `go_down()` / `come_back()`: the API server unreachable, then back on the same port.

Each Deployment simulates its pods: scaling up adds a not-ready endpoint per pod (one
EndpointSlice per pod, so each pod can point at its own loopback port), which turns
ready `ready_after` seconds later; scaling down marks them terminating, then deletes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


@dataclass
class FakePod:
    name: str
    ip: str
    port: int
    slice_name: str
    ready: bool = False
    terminating: bool = False
    version: int = 0  # resourceVersion of its EndpointSlice


@dataclass
class FakeDeployment:
    namespace: str
    name: str
    service: str
    pod_ports: list[int]  # the loopback port of pod i (an engine listening there, or not)
    ready_after: float = 0.05
    replicas: int = 0
    never_ready: bool = False
    grace: float = 0.02  # a terminating pod is deleted this long after (its grace period)
    pods: list[FakePod] = field(default_factory=list)
    resource_version: int = 0  # its own, as its Scale reports it (a patch may require it)


@dataclass
class RecordedRequest:
    method: str
    path: str
    query: dict[str, str]
    content_type: str
    body: Any


class FakeKubernetes:
    """`async with FakeKubernetes() as kube: kube.add_deployment(...); kube.host`."""

    def __init__(self) -> None:
        self.deployments: dict[tuple[str, str], FakeDeployment] = {}
        self.requests: list[RecordedRequest] = []
        # "patch-scale", "get-scale", "list-slices", "watch-slices" (a Role granting list only)
        self.forbidden: set[str] = set()
        self.unserved: set[str] = set()  # resources answered 404: their CRD not installed
        self.watch_supported = True
        self.watches_served = 0
        self.expire_watches = 0  # answer this many watches with a 410 Expired ERROR event
        self.list_errors: list[int] = []  # answer the next lists with these codes (429, 500)
        self.watch_errors: list[int] = []  # answer the next watches with an ERROR event of each
        self.empty_watches = 0  # end this many watches at once, no event (a proxy cutting them)
        self.bookmarks_sent = 0
        self._watch_generation = 0  # end_watches() bumps it: open streams end
        self._version = 100
        # (rv, resource, ns, type, object); resource: endpointslices | pods | inferencepools
        self._events: list[tuple[int, str, str, str, dict[str, Any]]] = []
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (resource, ns, name)
        self.down = False  # go_down(): nothing listens on the port
        self._changed = asyncio.Event()  # replaced by a fresh one on every change
        self._closing = asyncio.Event()
        self._timers: set[asyncio.TimerHandle] = set()
        self._runner: web.AppRunner | None = None
        self.port = 0

    # -- lifecycle ---------------------------------------------------------------------
    @property
    def host(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        await self._listen(0)

    async def _listen(self, port: int) -> None:
        app = web.Application()
        app.router.add_route(
            "GET", "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale", self._get_scale
        )
        app.router.add_route(
            "PATCH", "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale", self._patch_scale
        )
        app.router.add_route(
            "GET", "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", self._slices
        )
        app.router.add_route("GET", "/api/v1/namespaces/{ns}/pods", self._pods)
        app.router.add_route(
            "GET",
            "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools",
            self._pools,
        )
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port, reuse_address=True)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def go_down(self) -> None:
        """The API server goes away: open watches end, the port refuses connections."""
        self.down = True
        self.end_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def come_back(self) -> None:
        """The API server returns on the same port, with whatever changed meanwhile."""
        self.down = False
        await self._listen(self.port)

    async def stop(self) -> None:
        self._closing.set()
        self._changed.set()
        for timer in self._timers:
            timer.cancel()
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> FakeKubernetes:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- the simulated cluster -----------------------------------------------------------
    def add_deployment(
        self,
        name: str,
        *,
        namespace: str = "default",
        service: str | None = None,
        pod_ports: list[int] | None = None,
        ready_after: float = 0.05,
        replicas: int = 0,
    ) -> FakeDeployment:
        deployment = FakeDeployment(
            namespace=namespace,
            name=name,
            service=service or name,
            pod_ports=pod_ports or [9],
            ready_after=ready_after,
        )
        self.deployments[(namespace, name)] = deployment
        self._scale(deployment, replicas)
        return deployment

    def set_ready(self, name: str, ready: bool, *, namespace: str = "default") -> None:
        """Every pod of the deployment passes (or fails) its readiness probe."""
        deployment = self.deployments[(namespace, name)]
        for pod in deployment.pods:
            if not pod.terminating and pod.ready != ready:
                pod.ready = ready
                self._emit(deployment, "MODIFIED", pod)

    def scale(self, name: str, replicas: int, *, namespace: str = "default") -> None:
        """Someone else (an HPA, a person with kubectl) sets the replicas."""
        self._scale(self.deployments[(namespace, name)], replicas)

    def mark(
        self,
        name: str,
        port: int,
        *,
        ready: bool,
        terminating: bool = False,
        namespace: str = "default",
    ) -> None:
        """The pod of the deployment at loopback `port` fails (or passes) its readiness
        probe, or starts terminating."""
        deployment = self.deployments[(namespace, name)]
        pod = next(p for p in deployment.pods if p.port == port)
        pod.ready, pod.terminating = ready, terminating
        self._emit(deployment, "MODIFIED", pod)

    def rollout(self, name: str, pod_ports: list[int], *, namespace: str = "default") -> None:
        """A rolling update: a new pod per old one (new address), each old pod terminated
        once its replacement has had time to turn ready (maxSurge 100 %)."""
        deployment = self.deployments[(namespace, name)]
        old = [p for p in deployment.pods if not p.terminating]
        deployment.pod_ports = pod_ports
        deployment.pods = [p for p in deployment.pods if p not in old]
        self._scale(deployment, deployment.replicas)
        deployment.pods[:0] = old
        for pod in old:
            self._later(deployment.ready_after * 2, self._terminate, deployment, pod)

    def _terminate(self, deployment: FakeDeployment, pod: FakePod) -> None:
        if pod in deployment.pods and not pod.terminating:
            pod.ready, pod.terminating = False, True
            self._emit(deployment, "MODIFIED", pod)
            self._later(0.02, self._delete, deployment, pod)

    def end_watches(self) -> None:
        """End every open watch stream, as an API server does at timeoutSeconds or restart."""
        self._watch_generation += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # -- pods and InferencePools (objects stored as the API returns them) ----------------
    def put_pod(
        self,
        name: str,
        *,
        port_ip: str = "127.0.0.1",
        labels: dict[str, str],
        ready: bool = True,
        namespace: str = "default",
    ) -> None:
        """Create or replace a pod (Running; Ready as given) with IP `port_ip`."""
        key = ("pods", namespace, name)
        kind = "MODIFIED" if key in self.objects else "ADDED"
        pod = {
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"containers": [{"name": "engine", "image": "vllm"}]},
            "status": {
                "phase": "Running",
                "podIP": port_ip,
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        }
        self._put("pods", namespace, name, pod, kind)

    def set_pod_ready(self, name: str, ready: bool, *, namespace: str = "default") -> None:
        pod = self.objects[("pods", namespace, name)]
        pod["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
        self._put("pods", namespace, name, pod, "MODIFIED")

    def terminate_pod(self, name: str, *, namespace: str = "default") -> None:
        """The pod is being deleted: deletionTimestamp set, still listed until gone."""
        pod = self.objects[("pods", namespace, name)]
        pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        self._put("pods", namespace, name, pod, "MODIFIED")

    def delete_object(self, resource: str, name: str, *, namespace: str = "default") -> None:
        obj = self.objects.pop((resource, namespace, name))
        self._put(resource, namespace, name, obj, "DELETED", store=False)

    def put_pool(
        self,
        name: str,
        *,
        selector: dict[str, str],
        ports: list[int],
        namespace: str = "default",
    ) -> None:
        """Create or replace an InferencePool (inference.networking.k8s.io/v1)."""
        key = ("inferencepools", namespace, name)
        kind = "MODIFIED" if key in self.objects else "ADDED"
        pool = {
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "selector": {"matchLabels": selector},
                "targetPorts": [{"number": p} for p in ports],
                "endpointPickerRef": {"name": "llmgw", "port": {"number": 9002}},
            },
        }
        self._put("inferencepools", namespace, name, pool, kind)

    def _put(
        self,
        resource: str,
        namespace: str,
        name: str,
        obj: dict[str, Any],
        kind: str,
        *,
        store: bool = True,
    ) -> None:
        version = self._next_version()
        obj = {"kind": _KINDS[resource], "apiVersion": _API_VERSIONS[resource], **obj}
        obj["metadata"] = {**obj["metadata"], "resourceVersion": str(version)}
        if store:
            self.objects[(resource, namespace, name)] = obj
        self._events.append((version, resource, namespace, kind, json.loads(json.dumps(obj))))
        self._wake()

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        return await self._objects(request, "pods", "", "list-pods")

    async def _pools(self, request: web.Request) -> web.StreamResponse:
        return await self._objects(
            request, "inferencepools", "inference.networking.k8s.io", "list-pools"
        )

    async def _objects(
        self, request: web.Request, resource: str, group: str, forbid_key: str
    ) -> web.StreamResponse:
        await self._record(request)
        watching = request.query.get("watch") in ("true", "1")
        if not watching and self.list_errors:
            return failed_list(self.list_errors.pop(0))
        if resource in self.unserved:  # the API server has no such resource (no CRD)
            return web.Response(status=404, text="404 page not found\n")
        if forbid_key in self.forbidden:
            return forbidden(request, "watch" if watching else "list", resource, group)
        ns = request.match_info["ns"]
        selector = parse_selector(request.query.get("labelSelector", ""))
        fields = parse_selector(request.query.get("fieldSelector", ""))
        if "metadata.name" in fields:
            selector = {**selector, _NAME_FIELD: fields["metadata.name"]}
        if watching:
            return await self._watch(request, ns, selector, resource)
        items = [
            {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}
            for (r, n, _), obj in sorted(self.objects.items())
            if r == resource and n == ns and _matches(obj, selector)
        ]
        return web.json_response(
            {
                "kind": _KINDS[resource] + "List",
                "apiVersion": _API_VERSIONS[resource],
                "metadata": {"resourceVersion": str(self._version)},
                "items": items,
            }
        )

    def patches(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.method == "PATCH"]

    def _scale(self, deployment: FakeDeployment, replicas: int) -> None:
        deployment.replicas = replicas
        deployment.resource_version = self._next_version()
        live = [p for p in deployment.pods if not p.terminating]
        for i in range(len(live), replicas):
            port = deployment.pod_ports[i % len(deployment.pod_ports)]
            suffix = f"{self._next_version():x}"
            pod = FakePod(
                name=f"{deployment.name}-{suffix}",
                ip="127.0.0.1",
                port=port,
                slice_name=f"{deployment.service}-{suffix}",
            )
            deployment.pods.append(pod)
            self._emit(deployment, "ADDED", pod)
            if not deployment.never_ready:
                self._later(deployment.ready_after, self._become_ready, deployment, pod)
        for pod in live[replicas:]:
            pod.ready, pod.terminating = False, True
            self._emit(deployment, "MODIFIED", pod)
            self._later(deployment.grace, self._delete, deployment, pod)

    def _become_ready(self, deployment: FakeDeployment, pod: FakePod) -> None:
        if pod in deployment.pods and not pod.terminating:
            pod.ready = True
            self._emit(deployment, "MODIFIED", pod)

    def _delete(self, deployment: FakeDeployment, pod: FakePod) -> None:
        if pod in deployment.pods:
            deployment.pods.remove(pod)
            self._emit(deployment, "DELETED", pod)

    def _later(self, delay: float, fn: Any, *args: Any) -> None:
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle

        def run() -> None:
            self._timers.discard(handle)
            fn(*args)

        handle = loop.call_later(delay, run)
        self._timers.add(handle)

    def _next_version(self) -> int:
        self._version += 1
        return self._version

    def _emit(self, deployment: FakeDeployment, kind: str, pod: FakePod) -> None:
        pod.version = self._next_version()
        slice_ = self._slice(deployment, pod)
        self._events.append((pod.version, "endpointslices", deployment.namespace, kind, slice_))
        self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _slice(self, deployment: FakeDeployment, pod: FakePod) -> dict[str, Any]:
        """One EndpointSlice per pod, as the endpointslice controller would write it."""
        return {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": pod.slice_name,
                "generateName": f"{deployment.service}-",
                "namespace": deployment.namespace,
                "resourceVersion": str(pod.version),
                "labels": {
                    SERVICE_NAME_LABEL: deployment.service,
                    "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                },
            },
            "addressType": "IPv4",
            "endpoints": [
                {
                    "addresses": [pod.ip],
                    "conditions": {
                        "ready": pod.ready,
                        "serving": pod.ready or pod.terminating,
                        "terminating": pod.terminating,
                    },
                    "nodeName": "fake-node",
                    "targetRef": {
                        "kind": "Pod",
                        "namespace": deployment.namespace,
                        "name": pod.name,
                    },
                }
            ],
            "ports": [{"name": "http", "port": pod.port, "protocol": "TCP"}],
        }

    def _current_slices(self, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        out = []
        for deployment in self.deployments.values():
            if deployment.namespace != namespace:
                continue
            for pod in deployment.pods:
                pod_slice = self._slice(deployment, pod)
                if _matches(pod_slice, selector):
                    out.append(pod_slice)
        return out

    # -- HTTP handlers -------------------------------------------------------------------
    async def _record(self, request: web.Request) -> RecordedRequest:
        raw = await request.read()
        body: Any = json.loads(raw) if raw else None
        recorded = RecordedRequest(
            request.method, request.path, dict(request.query), request.content_type, body
        )
        self.requests.append(recorded)
        return recorded

    def _deployment(self, request: web.Request) -> FakeDeployment | web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        deployment = self.deployments.get((ns, name))
        if deployment is None:
            return status_response(
                404, "NotFound", f'deployments.apps "{name}" not found', name, "deployments"
            )
        return deployment

    async def _get_scale(self, request: web.Request) -> web.Response:
        await self._record(request)
        if "get-scale" in self.forbidden:
            return forbidden(request, "get", "deployments/scale", "apps")
        found = self._deployment(request)
        if isinstance(found, web.Response):
            return found
        return web.json_response(self._scale_object(found))

    async def _patch_scale(self, request: web.Request) -> web.Response:
        recorded = await self._record(request)
        if "patch-scale" in self.forbidden:
            return forbidden(request, "patch", "deployments/scale", "apps")
        found = self._deployment(request)
        if isinstance(found, web.Response):
            return found
        body = recorded.body
        if recorded.content_type == "application/json-patch+json" and isinstance(body, list):
            replicas = next(op["value"] for op in body if op.get("path") == "/spec/replicas")
        elif recorded.content_type in (
            "application/merge-patch+json",
            "application/strategic-merge-patch+json",
        ) and isinstance(body, dict):
            replicas = body.get("spec", {}).get("replicas", found.replicas)
        else:
            return status_response(
                415, "UnsupportedMediaType", f"unsupported patch {recorded.content_type}"
            )
        if not isinstance(replicas, int) or replicas < 0:
            return status_response(422, "Invalid", f"spec.replicas: Invalid value: {replicas!r}")
        required = (
            body.get("metadata", {}).get("resourceVersion") if isinstance(body, dict) else None
        )
        if required is not None and required != str(found.resource_version):
            # A precondition, as the API server checks it: someone changed it since.
            return status_response(
                409,
                "Conflict",
                f"Operation cannot be fulfilled on deployments.apps {found.name!r}: the object "
                "has been modified; please apply your changes to the latest version and try again",
            )
        self._scale(found, replicas)
        return web.json_response(self._scale_object(found))

    def _scale_object(self, deployment: FakeDeployment) -> dict[str, Any]:
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                "name": deployment.name,
                "namespace": deployment.namespace,
                "uid": f"uid-{deployment.namespace}-{deployment.name}",
                "resourceVersion": str(deployment.resource_version),
                "creationTimestamp": "2025-01-01T00:00:00Z",
            },
            "spec": {"replicas": deployment.replicas},
            "status": {
                "replicas": len([p for p in deployment.pods if not p.terminating]),
                "selector": f"app={deployment.name}",
            },
        }

    async def _slices(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        watching = request.query.get("watch") in ("true", "1")
        if not watching and self.list_errors:
            return failed_list(self.list_errors.pop(0))
        if "list-slices" in self.forbidden or (watching and "watch-slices" in self.forbidden):
            verb = "watch" if watching else "list"
            return forbidden(request, verb, "endpointslices", "discovery.k8s.io")
        ns = request.match_info["ns"]
        selector = parse_selector(request.query.get("labelSelector", ""))
        if request.query.get("watch") not in ("true", "1"):
            return web.json_response(
                {
                    "kind": "EndpointSliceList",
                    "apiVersion": "discovery.k8s.io/v1",
                    "metadata": {"resourceVersion": str(self._version)},
                    "items": [
                        {k: v for k, v in s.items() if k not in ("kind", "apiVersion")}
                        for s in self._current_slices(ns, selector)
                    ],
                }
            )
        if not self.watch_supported:
            return status_response(405, "MethodNotAllowed", "watch is not supported here")
        return await self._watch(request, ns, selector, "endpointslices")

    async def _watch(
        self, request: web.Request, ns: str, selector: dict[str, str], resource: str
    ) -> web.StreamResponse:
        self.watches_served += 1
        generation = self._watch_generation  # before any await: end_watches() ends this one
        since = int(request.query.get("resourceVersion") or self._version)
        timeout = float(request.query.get("timeoutSeconds") or 1800)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        sent = since
        error: tuple[int, str, str] | None = None
        if self.expire_watches > 0:
            self.expire_watches -= 1
            error = 410, "Expired", f"too old resource version: {since} ({self._version})"
        elif self.watch_errors:
            code = self.watch_errors.pop(0)
            reason = "TooManyRequests" if code == 429 else "InternalError"
            error = code, reason, "the watch failed on the server"
        if error is not None:
            code, reason, message = error
            status = {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": message,
                "reason": reason,
                "code": code,
            }
            await response.write((json.dumps({"type": "ERROR", "object": status}) + "\n").encode())
            await response.write_eof()
            return response
        if self.empty_watches > 0:
            self.empty_watches -= 1
            await response.write_eof()
            return response
        with contextlib.suppress(ConnectionResetError):
            while (
                not self._closing.is_set()
                and generation == self._watch_generation
                and loop.time() < deadline
            ):
                changed = self._changed
                for version, kind_of, event_ns, kind, obj in self._events:
                    if version <= sent:
                        continue
                    sent = version
                    if kind_of == resource and event_ns == ns and _matches(obj, selector):
                        line = json.dumps({"type": kind, "object": obj}) + "\n"
                        await response.write(line.encode())
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, deadline - loop.time())):
                        await changed.wait()
            if request.query.get("allowWatchBookmarks") in ("true", "1") and not self.down:
                # As the API server does before it ends a watch: where to resume from.
                self.bookmarks_sent += 1
                bookmark = {
                    "kind": _KINDS[resource],
                    "apiVersion": _API_VERSIONS[resource],
                    "metadata": {"resourceVersion": str(max(sent, self._version))},
                }
                line = json.dumps({"type": "BOOKMARK", "object": bookmark}) + "\n"
                await response.write(line.encode())
            await response.write_eof()
        return response


def parse_selector(text: str) -> dict[str, str]:
    """Equality-based label selectors (`a=b,c==d`), which is what llmgw sends."""
    out: dict[str, str] = {}
    for term in filter(None, (t.strip() for t in text.split(","))):
        key, _, value = term.replace("==", "=").partition("=")
        out[key] = value
    return out


_NAME_FIELD = "\0metadata.name"  # a field selector on the name, kept beside the labels
_KINDS = {"endpointslices": "EndpointSlice", "pods": "Pod", "inferencepools": "InferencePool"}
_API_VERSIONS = {
    "endpointslices": "discovery.k8s.io/v1",
    "pods": "v1",
    "inferencepools": "inference.networking.k8s.io/v1",
}


def _matches(obj: dict[str, Any], selector: dict[str, str]) -> bool:
    labels = {**(obj["metadata"].get("labels") or {}), _NAME_FIELD: obj["metadata"].get("name")}
    return all(labels.get(k) == v for k, v in selector.items())


def status_response(
    code: int, reason: str, message: str, name: str | None = None, kind: str | None = None
) -> web.Response:
    details: dict[str, Any] = {}
    if name is not None:
        details = {"name": name, "group": "apps", "kind": kind}
    return web.json_response(
        {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "details": details,
            "code": code,
        },
        status=code,
    )


def failed_list(code: int) -> web.Response:
    """A list the API server fails: 429 (API Priority and Fairness throttling), else 500."""
    if code == 429:
        return status_response(429, "TooManyRequests", "too many requests, please try again")
    return status_response(code, "InternalError", "an error on the server has prevented it")


def forbidden(request: web.Request, verb: str, resource: str, group: str) -> web.Response:
    ns = request.match_info["ns"]
    name = request.match_info.get("name")
    subject = "system:serviceaccount:llmgw:llmgw"
    what = f'{resource}.{group} "{name}"' if name else f"{resource}.{group}"
    return status_response(
        403,
        "Forbidden",
        f'{what} is forbidden: User "{subject}" cannot {verb} resource "{resource}" '
        f'in API group "{group}" in the namespace "{ns}"',
        name,
        resource,
    )
