"""Where a model's endpoints come from on Kubernetes, and the pure rules that turn API
objects (JSON, camelCase) into the addresses that get new requests.

    models:
      chat:
        discovery: {service: {namespace: models, name: vllm-chat, port: http}}
      code:
        discovery: {inference_pool: {namespace: models, name: code-pool}}
      batch:
        discovery: {pods: {namespace: models, selector: {app: vllm-batch}, port: 8000}}

Only Ready endpoints that are not terminating get new requests: a pod failing its
readiness probe or being deleted leaves the set (its in-flight requests finish there).
The runtime follower (`llmgw.runtime.kube`) lists and watches; this module decides.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

# RFC 1123 label (namespaces) and subdomain (object names), as the API server checks them.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_KEY = re.compile(r"^([a-z0-9.-]{1,253}/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
INFERENCE_POOL_GROUP = "inference.networking.k8s.io"
INFERENCE_POOL_VERSION = "v1"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def namespace_name(value: str) -> str:
    """`value` if the API server takes it as a namespace (a pydantic validator's check)."""
    if not _DNS_LABEL.match(value) or len(value) > 63:
        raise ValueError(f"must be a Kubernetes namespace name (RFC 1123 label), got {value!r}")
    return value


def object_name(value: str) -> str:
    """`value` if the API server takes it as an object's name (a pydantic validator's check)."""
    if not _DNS_SUBDOMAIN.match(value) or len(value) > 253:
        raise ValueError(f"must be a Kubernetes object name (RFC 1123 subdomain), got {value!r}")
    return value


class _Namespaced(_Strict):
    namespace: str = "default"

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        return namespace_name(value)


class _Named(_Namespaced):
    name: str

    @field_validator("name")
    @classmethod
    def _object_name(cls, value: str) -> str:
        return object_name(value)


class ServiceSource(_Named):
    """A Service's EndpointSlices. `port`: the Service port's name, or the endpoint (pod)
    port number; omitted: the port named `http`, else the slice's first port."""

    port: str | int | None = None

    @field_validator("port", mode="before")
    @classmethod
    def _port(cls, value: Any) -> Any:
        # Before pydantic's union, which read `port: true` as port 1.
        if isinstance(value, bool) or not isinstance(value, int | str | None):
            raise ValueError(f"must be a port name or a number in 1..65535, got {value!r}")
        if isinstance(value, int) and not 0 < value < 65536:
            raise ValueError(f"must be a port name or a number in 1..65535, got {value}")
        if isinstance(value, str) and not _DNS_LABEL.match(value):
            raise ValueError(f"must be a port name (as in the Service) or a number, got {value!r}")
        return value


class InferencePoolSource(_Named):
    """A Gateway API Inference Extension InferencePool (`inference.networking.k8s.io/v1`):
    the Ready pods its `selector.matchLabels` selects, at each of its `targetPorts`."""


class PodSource(_Namespaced):
    """Pods by label selector (clusters without a Service or an InferencePool)."""

    selector: dict[str, str] = Field(min_length=1)
    port: StrictInt = Field(ge=1, le=65535)

    @field_validator("selector")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        for key, label in value.items():
            if not _LABEL_KEY.match(key):
                raise ValueError(f"{key}: not a valid label key")
            if not _LABEL_VALUE.match(label):
                raise ValueError(f"{key}: not a valid label value: {label!r}")
        return value


class DiscoverySpec(_Strict):
    """Exactly one source per model."""

    service: ServiceSource | None = None
    inference_pool: InferencePoolSource | None = None
    pods: PodSource | None = None

    @model_validator(mode="after")
    def _one(self) -> DiscoverySpec:
        given = [k for k in ("service", "inference_pool", "pods") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "service: give exactly one of `service`, `inference_pool` or `pods`"
                + (f" (got {', '.join(given)})" if given else "")
            )
        return self

    @property
    def namespace(self) -> str:
        source = self.service or self.inference_pool or self.pods
        assert source is not None
        return source.namespace

    def describe(self) -> str:
        if self.service is not None:
            return f"service {self.service.namespace}/{self.service.name}"
        if self.inference_pool is not None:
            return f"inferencepool {self.inference_pool.namespace}/{self.inference_pool.name}"
        assert self.pods is not None
        return f"pods {self.pods.namespace}/{selector_text(self.pods.selector)}"


def selector_text(labels: Mapping[str, str]) -> str:
    """An equality label selector as the API's `labelSelector` query takes it."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def join(ip: str, port: int) -> str:
    return f"{bracketed(ip)}:{port}"


def bracketed(host: str) -> str:
    """A host as an address writes it before `:port`: an IPv6 literal in brackets."""
    return f"[{host}]" if ":" in host else host


def slice_port(slice_: Mapping[str, Any], wanted: str | int | None, default: int) -> int | None:
    """The port of one EndpointSlice to route to (None: the slice lacks the wanted one)."""
    ports = [p for p in slice_.get("ports") or [] if p.get("port")]
    if isinstance(wanted, int):
        # A headless Service may define no ports (KubeRay's, JobSet's): its slices list
        # none, and the pod port number given is the only word on where the engine listens.
        if not ports:
            return wanted
        return wanted if any(int(p["port"]) == wanted for p in ports) else None
    if isinstance(wanted, str):
        named = [p for p in ports if p.get("name") == wanted]
        return int(named[0]["port"]) if named else None
    named = [p for p in ports if p.get("name") == "http"]
    return int((named or ports)[0]["port"]) if ports else default


def slice_addresses(
    slices: Iterable[Mapping[str, Any]], port: str | int | None = None, default_port: int = 8000
) -> list[str]:
    """`ip:port` of every endpoint that takes new requests: Ready (a nil `ready` counts as
    ready, as the API says), serving and not terminating. A Service that publishes not-ready
    addresses (a StatefulSet's headless one, LWS) has every endpoint `ready`: its pod's
    readiness is in `serving` alone. A dual-stack Service lists each pod in an
    IPv4 and an IPv6 slice: a pod is one endpoint, at its IPv4 address (as two it was
    scraped twice and its load split between them)."""
    out: set[str] = set()
    seen: set[tuple[str, str, int]] = set()  # (pod namespace, pod name, port) taken
    ordered = sorted(slices, key=lambda s: s.get("addressType") != "IPv4")
    for slice_ in ordered:
        number = slice_port(slice_, port, default_port)
        if number is None:
            continue
        for endpoint in slice_.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            if (
                conditions.get("ready") is False
                or conditions.get("serving") is False
                or conditions.get("terminating") is True
            ):
                continue
            ref = endpoint.get("targetRef") or {}
            if ref.get("name"):
                pod = (str(ref.get("namespace", "")), str(ref["name"]), number)
                if pod in seen:
                    continue
                seen.add(pod)
            for ip in endpoint.get("addresses") or []:
                out.add(join(ip, number))
    return sorted(out)


def missing_port(slices: Iterable[Mapping[str, Any]], port: str | int | None) -> str | None:
    """When slices list endpoints but none has the wanted port: the ports they have (a
    Service's own port given instead of the pods' is the usual slip), else None."""
    have: set[str] = set()
    portless = False
    for slice_ in slices:
        if not slice_.get("endpoints"):
            continue
        if slice_port(slice_, port, 0) is not None:
            return None
        listed = [p for p in slice_.get("ports") or [] if p.get("port")]
        portless = portless or not listed
        for p in listed:
            have.add(f"{p['name']}:{p['port']}" if p.get("name") else str(p["port"]))
    if have:
        return ", ".join(sorted(have))
    if portless:
        return "none: a headless Service without ports, whose pods' port must be given by number"
    return None


def pod_is_routable(pod: Mapping[str, Any]) -> bool:
    """Running, condition Ready True, an IP, and not being deleted."""
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if metadata.get("deletionTimestamp") or not status.get("podIP"):
        return False
    if status.get("phase") not in (None, "Running"):
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


def pod_addresses(pods: Iterable[Mapping[str, Any]], ports: Iterable[int]) -> list[str]:
    """`ip:port` for every routable pod and port (an InferencePool lists up to 8 ports;
    each pod-port pair is an endpoint, as GIE's endpoint picker counts them)."""
    numbers = list(ports)
    return sorted(
        join(str(pod["status"]["podIP"]), n)
        for pod in pods
        if pod_is_routable(pod)
        for n in numbers
    )


def pool_selection(pool: Mapping[str, Any]) -> tuple[dict[str, str], list[int]]:
    """An InferencePool's `spec.selector.matchLabels` and `spec.targetPorts[].number`;
    raises ValueError naming the field that is missing."""
    spec = pool.get("spec") or {}
    labels = (spec.get("selector") or {}).get("matchLabels") or {}
    ports = [int(p["number"]) for p in spec.get("targetPorts") or [] if p.get("number")]
    if not labels:
        raise ValueError("spec.selector.matchLabels is empty")
    if not ports:
        raise ValueError("spec.targetPorts has no port number")
    return {str(k): str(v) for k, v in labels.items()}, ports
