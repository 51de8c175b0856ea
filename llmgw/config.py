"""The config file model: validation with path-indexed messages, then `normalize()`.

    models:
      chat:
        engine: vllm
        endpoints: ["10.0.0.1:8000", {address: "10.0.0.2:8000", weight: 2}]
        session: {headers: [x-session-id], num_fallback_replicas: 2, bounded_load: 1.25}
        strategy: latency
      big:
        launch: {command: "vllm serve big --port {port}"}
        scaling: {min: 0, max: 1, idle_timeout: 600}

Rules for `scaling` (see `ModelMode`): a model with static endpoints and no scaling stanza
is STATIC (always routed); `max: 0` is OFF; a launched model needs a scaling stanza to run:
`min: 0, max: >0` is ON_DEMAND, `min: >0` is ALWAYS_ON, no stanza is OFF.
"""

from __future__ import annotations

import enum
import importlib.util
import ipaddress
import re
import shlex
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from llmgw.breaker import BreakerSettings
from llmgw.discovery import DiscoverySpec, namespace_name, object_name
from llmgw.errors import ConfigError
from llmgw.promtext import OPTIONAL_ROLES
from llmgw.scheduling.specs import StrategySpec
from llmgw.scheduling.strategies import PRESETS, tuned
from llmgw.types import Endpoint, Engine

_HOSTNAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")
# A header name (RFC 9110 token): one with a space, a colon or nothing in it never matches,
# and what it turned on (session affinity, the model header) was silently off.
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_NOT_A_HEADER = "must be an HTTP header name (RFC 9110 token), got"
_METRIC_ROLES = (
    "waiting",
    "running",
    "kv_usage",
    "finished",
    "model_label",
    "path",
    *OPTIONAL_ROLES,
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class EndpointSpec(_Strict):
    address: str
    weight: StrictFloat = Field(default=1.0, gt=0)

    @field_validator("address")
    @classmethod
    def _host_port(cls, value: str) -> str:
        return canonical_address(host_port(value))


def canonical_address(address: str) -> str:
    """One spelling per server: the host lower-cased, an IPv6 literal compressed (an
    IPv4-mapped one as its IPv4 address), the port without leading zeros (`Node-A:08000` and `node-a:8000` were two endpoints of one
    server: two ring replicas, its load split between them)."""
    host, _, port = address.rpartition(":")
    bare = host.removeprefix("[").removesuffix("]")
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        return f"{host.lower()}:{int(port)}"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return f"{ip.ipv4_mapped}:{int(port)}"  # [::ffff:10.0.0.1] is 10.0.0.1
    return f"[{ip.compressed}]:{int(port)}" if ip.version == 6 else f"{ip}:{int(port)}"


def host_port(value: str) -> str:
    """`value` if it is host:port with a port in 1..65535 (a pydantic validator's check)."""
    m = _ADDRESS.match(value)
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise ValueError(f"must be host:port with a port in 1..65535, got {value!r}")
    if m.group(1).startswith("["):
        try:
            ipaddress.IPv6Address(m.group(1)[1:-1])
        except ValueError:
            raise ValueError(
                f"must be host:port with an IPv6 address in the brackets, got {value!r}"
            ) from None
    return value


class ScalingSpec(_Strict):
    min: StrictInt = Field(default=0, ge=0)
    max: StrictInt | None = Field(default=None, ge=0)
    idle_timeout: StrictFloat = Field(default=600.0, gt=0)
    start_timeout: StrictFloat = Field(default=300.0, gt=0)
    max_waiting_requests: StrictInt = Field(default=256, ge=1)

    @model_validator(mode="after")
    def _bounds(self) -> ScalingSpec:
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max: must be >= min ({self.min})")
        return self


class LaunchSpec(_Strict):
    """How a control plane starts a replica: a local command or a Kubernetes Deployment."""

    command: str | None = None
    health_path: str = "/health"
    host: str = "127.0.0.1"
    base_port: StrictInt = Field(default=0, ge=0, le=65535)
    deployment: str | None = None
    namespace: str = "default"
    service: str | None = None
    port: StrictInt = Field(default=8000, ge=1, le=65535)
    expected_start_seconds: StrictFloat = Field(default=30.0, gt=0)

    @field_validator("host")
    @classmethod
    def _host(cls, value: str) -> str:
        bare = value.removeprefix("[").removesuffix("]")  # an IPv6 literal, bracketed or not
        try:
            ipaddress.ip_address(bare)
        except ValueError:
            if not _HOSTNAME.match(value):
                raise ValueError(f"must be an IP address or a host name, got {value!r}") from None
            return value
        return bare

    @field_validator("health_path")
    @classmethod
    def _health_path(cls, value: str) -> str:
        # `GET health HTTP/1.1` got a 400, and every start failed after start_timeout.
        if not value.startswith("/"):
            raise ValueError(f"must start with '/' (the engine's health path), got {value!r}")
        return value

    @field_validator("deployment", "service")
    @classmethod
    def _object_name(cls, value: str | None) -> str | None:
        return None if value is None else object_name(value)

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        return namespace_name(value)

    @model_validator(mode="after")
    def _one_kind(self) -> LaunchSpec:
        if (self.command is None) == (self.deployment is None):
            raise ValueError("command: give exactly one of `command` (local) or `deployment` (k8s)")
        local = self.command is not None
        kind, other = ("command", _K8S_LAUNCH) if local else ("deployment", _LOCAL_LAUNCH)
        stray = sorted(self.model_fields_set & other)
        if stray:  # accepted and ignored, `{command: ..., port: 8001}` looked right
            raise ValueError(
                f"{stray[0]}: not read with `{kind}` (a local command reads "
                f"{', '.join(sorted(_LOCAL_LAUNCH))}; a deployment "
                f"{', '.join(sorted(_K8S_LAUNCH))})"
            )
        if self.command is not None:
            launch_argv(self.command, port=8000, host=self.host, model="m")
            if self.base_port == 0 and "port" not in _field_names(self.command):
                # llmgw picks a free port and health-checks it; the engine, never told,
                # listens elsewhere: every start failed after start_timeout.
                raise ValueError(
                    "command: has no {port} placeholder and base_port is 0, so the engine "
                    "never hears the port llmgw picks for it; add `--port {port}`, or set "
                    "base_port to the port the command listens on"
                )
        return self


_LOCAL_LAUNCH = frozenset({"command", "health_path", "host", "base_port"})
_K8S_LAUNCH = frozenset({"deployment", "namespace", "service", "port"})


def _field_names(text: str) -> list[str]:
    """Every placeholder's name in a format string, those inside format specs too
    (`{port:{host.x}}` formats `{host.x}` as well)."""
    names: list[str] = []
    for _, field, spec, _ in string.Formatter().parse(text):
        if field is not None:
            names.append(field)
        if spec:
            names.extend(_field_names(spec))
    return names


def fill_template(field: str, text: str, values: Mapping[str, object], hint: str = "") -> str:
    """`text` with its `{name}` placeholders filled from `values`; raises ValueError naming
    `field`, the placeholder it does not know or the brace it cannot read (`hint`: more on
    where literal braces come from)."""
    known = ", ".join(f"{{{name}}}" for name in values)
    try:
        # The names alone: format() also reads `{port.real}` and `{host[0]}`, and `{port.x}`
        # escaped as an AttributeError (a traceback from check-config).
        unknown = next((f for f in _field_names(text) if f not in values), None)
        if unknown is not None:
            raise KeyError(unknown)
        return text.format(**values)
    except (KeyError, IndexError) as exc:
        raise ValueError(
            f"{field}: unknown placeholder {{{exc.args[0]}}} (known: {known}; write a literal "
            f"brace as {{{{ or }}}}{hint})"
        ) from None
    except ValueError as exc:
        raise ValueError(
            f"{field}: {exc} (placeholders are {known}; write a literal brace as {{{{ or }}}}"
            f"{hint})"
        ) from None


def launch_argv(command: str, *, port: int, host: str, model: str) -> list[str]:
    """`launch.command` with its placeholders filled, split as a shell would (no shell runs).
    Raises ValueError saying what to fix."""
    values = {"port": port, "host": host, "model": model}
    filled = fill_template("command", command, values, ", e.g. JSON arguments")
    try:
        argv = shlex.split(filled)
    except ValueError as exc:
        raise ValueError(f"command: {exc} (quote it as a shell would)") from None
    if not argv:
        raise ValueError("command: is empty")
    return argv


class SessionSpec(_Strict):
    headers: tuple[str, ...] = ("x-session-id",)
    num_fallback_replicas: StrictInt = Field(default=2, ge=0)
    num_virtual_nodes: StrictInt = Field(default=100, ge=1)
    bounded_load: StrictFloat | None = Field(default=None, ge=1.0)

    @field_validator("headers")
    @classmethod
    def _lower(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("must name at least one header")
        for i, name in enumerate(value):
            if not _TOKEN.match(name):
                raise ValueError(f"{i}: {_NOT_A_HEADER} {name!r}")
        return tuple(h.lower() for h in value)


def _preset_strategy(name: str) -> StrategySpec:
    if name not in PRESETS:
        raise ValueError(f"unknown strategy preset {name!r} (known: {', '.join(PRESETS)})")
    return PRESETS[name]


class SaturationSpec(_Strict):
    queue_ceiling: StrictFloat = Field(default=64, gt=0)
    kv_ceiling: StrictFloat = Field(default=0.98, gt=0, le=1)


class KvEventsSpec(_Strict):
    """Where each endpoint's engine publishes KV-cache events (vLLM `--kv-events-config`).

    `endpoint` is a ZMQ address template (`tcp://{host}:5557`, `{host}` = the endpoint's
    host; the engine binds `tcp://*:5557`); `discover: true` reads it (and the replay
    address and topic) from the engine's `GET /kv_event_sources` instead."""

    endpoint: str | None = None
    replay_endpoint: str | None = None
    topic: str = ""
    discover: StrictBool = False
    resync: StrictFloat = Field(default=10.0, ge=0)  # seconds gap-free after a gap before trusting

    @model_validator(mode="after")
    def _source(self) -> KvEventsSpec:
        if (self.endpoint is None) == (not self.discover):
            raise ValueError(
                "give either endpoint (a tcp://{host}:PORT template) or discover: true"
            )
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None:
                continue
            if not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"{name}: {value!r} is not a ZMQ address (tcp://{{host}}:PORT)")
            # Filled per endpoint at run time: a typo raised there, in every follower,
            # every second, and exact matching never came on.
            fill_template(name, value, {"host": "h"}, "; the port is written out")
        missing = [m for m in ("zmq", "msgpack") if importlib.util.find_spec(m) is None]
        if missing:
            raise ValueError(
                f"KV events need the optional packages {', '.join(missing)} "
                "(pip install 'llmgw[exact]')"
            )
        return self


class ModelSpec(_Strict):
    engine: Engine = Engine.VLLM
    endpoints: tuple[EndpointSpec, ...] = ()
    discovery: DiscoverySpec | None = None  # endpoints followed on Kubernetes
    metrics: dict[str, str] = Field(default_factory=dict)
    served_name: str | None = None  # the model_name label on /metrics, if it differs
    scaling: ScalingSpec | None = None
    launch: LaunchSpec | None = None
    session: SessionSpec = SessionSpec()
    # A preset name becomes its StrategySpec here: a `StrategySpec | str` union would put
    # pydantic's member names in error paths (`strategy.function-after[...].scorers.x`).
    strategy: StrategySpec = Field(default_factory=lambda: _preset_strategy("latency"))
    saturation: SaturationSpec = SaturationSpec()
    kv_events: KvEventsSpec | None = None

    @field_validator("endpoints", mode="before")
    @classmethod
    def _address_shorthand(cls, value: Any) -> Any:
        if isinstance(value, list | tuple):
            return [{"address": v} if isinstance(v, str) else v for v in value]
        return value

    @field_validator("metrics")
    @classmethod
    def _metric_roles(cls, value: dict[str, str]) -> dict[str, str]:
        for role in value:
            if role not in _METRIC_ROLES:
                raise ValueError(
                    f"{role}: unknown metric role (allowed: {', '.join(_METRIC_ROLES)})"
                )
        path = value.get("path")
        if path is not None and not path.startswith("/"):
            raise ValueError(f"path: must start with '/' (the engine's metrics path), got {path!r}")
        return value

    @field_validator("strategy", mode="before")
    @classmethod
    def _preset(cls, value: Any) -> Any:
        return _preset_strategy(value) if isinstance(value, str) else value

    @field_validator("strategy")
    @classmethod
    def _tuned_preset(cls, value: StrategySpec) -> StrategySpec:
        return tuned(value)

    @model_validator(mode="after")
    def _shape(self) -> ModelSpec:
        addresses = [e.address for e in self.endpoints]
        dupes = sorted({a for a in addresses if addresses.count(a) > 1})
        if dupes:
            raise ValueError(f"endpoints: duplicate address {', '.join(dupes)}")
        if self.endpoints and self.launch is not None:
            # Routed to the static endpoints while the launch never ran (its status "off").
            raise ValueError("endpoints: give either endpoints or launch, not both")
        if self.discovery is not None and (self.endpoints or self.launch is not None):
            raise ValueError(
                "discovery: give either discovery or endpoints/launch, not both (an on-demand "
                "Kubernetes model is followed through launch.service)"
            )
        if (
            self.launch is None
            and not self.endpoints
            and self.discovery is None
            and self.scaling is None
        ):
            raise ValueError(
                "endpoints: a model needs endpoints, discovery, or a launch spec and scaling"
            )
        # An omitted max is filled by normalize() with max(min, 1): it counts as above 0.
        if self.launch is None and self.scaling is not None and self.scaling.max != 0:
            raise ValueError("launch: scaling above 0 replicas needs a launch spec to start them")
        return self


class BreakerSpec(_Strict):
    failure_threshold: StrictInt = Field(default=3, ge=1)
    success_threshold: StrictInt = Field(default=2, ge=1)
    base_cooldown: StrictFloat = Field(default=1.0, gt=0)
    max_cooldown: StrictFloat = Field(default=60.0, gt=0)
    half_open_probes: StrictInt = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _caps(self) -> BreakerSpec:
        if self.max_cooldown < self.base_cooldown:
            raise ValueError(f"max_cooldown: must be >= base_cooldown ({self.base_cooldown})")
        return self

    def settings(self) -> BreakerSettings:
        return BreakerSettings(**self.model_dump())


class ScrapeSpec(_Strict):
    interval: StrictFloat = Field(default=0.1, gt=0)
    timeout: StrictFloat = Field(default=0.5, gt=0)
    staleness: StrictFloat = Field(default=2.0, gt=0)
    jitter: StrictFloat = Field(default=0.1, ge=0, le=1)
    # A replica added to a running model takes at most this many requests at once until
    # its first scrape says how busy it is (it may still be warming up).
    warmup_inflight: StrictInt = Field(default=2, ge=1)

    @model_validator(mode="after")
    def _fresh_between_scrapes(self) -> ScrapeSpec:
        # Metrics older than `staleness` are not used: with scrapes further apart, every
        # endpoint read stale for most of each interval and the load-aware scorers ran
        # blind, silently. An omitted staleness follows a long interval instead.
        needed = self.interval * (1 + self.jitter) + self.timeout
        if self.staleness > needed:
            return self
        if "staleness" in self.model_fields_set:
            raise ValueError(
                f"staleness: {self.staleness:g} s would mark metrics stale between scrapes "
                f"(interval {self.interval:g} s x (1 + jitter {self.jitter:g}) + timeout "
                f"{self.timeout:g} s = {needed:g} s); make it longer, or scrape more often"
            )
        object.__setattr__(self, "staleness", max(2.0, 2 * needed))  # frozen: set once here
        return self


class LimitsSpec(_Strict):
    max_body_bytes: StrictInt = Field(default=8 * 1024 * 1024, ge=1024)
    prompt_prefix_chars: StrictInt = Field(default=32 * 1024, ge=0)
    # The embedded proxy's upstream connections (per endpoint, HTTP/1.1 keep-alive).
    upstream_max_connections: StrictInt = Field(default=512, ge=1)
    upstream_connect_timeout: StrictFloat = Field(default=5.0, gt=0)
    upstream_read_timeout: StrictFloat = Field(default=600.0, gt=0)  # longest silence mid-response
    # Idle keep-alive kept this long: below uvicorn's 5 s, which vLLM and SGLang serve with.
    upstream_idle_timeout: StrictFloat = Field(default=4.0, gt=0)
    # A client's request: its head must arrive whole within client_header_timeout s of the
    # connection (or, on a kept-alive one, of its first byte); its body may pause at most
    # client_body_timeout s between two reads (nginx's two timeouts). Then 408 and close.
    client_header_timeout: StrictFloat = Field(default=60.0, gt=0)
    client_body_timeout: StrictFloat = Field(default=60.0, gt=0)
    # A client's idle keep-alive connection is kept this long: past what client pools keep
    # theirs (httpx 5 s, aiohttp 15 s, ingress-nginx and AWS balancers 60 s), so they never
    # send on a connection the proxy is closing (a front proxy that keeps longer, Envoy's
    # 1 h, needs its own set below this). uvicorn's 5 s did, once in ~6,000 requests of a
    # 15 s aiohttp pool: the request failed (ServerDisconnectedError).
    client_idle_timeout: StrictFloat = Field(default=75.0, gt=0)
    # The proxy's answer: a client that accepts no response byte for this long (its socket
    # open, nothing read) is dropped and its request ends as cancelled.
    client_write_timeout: StrictFloat = Field(default=60.0, gt=0)


class AdminSpec(_Strict):
    # POST /admin/explain on the health port (the proxy: its own port). Read-only, but it
    # shows endpoints and scores: off unless asked for.
    explain: StrictBool = False


class PeersSpec(_Strict):
    """Router replicas that share what they route (llmgw/runtime/peers.py): each one sends
    the prefix blocks it routes, and where, to the others over UDP, so every replica's
    prefix index holds the whole fleet's traffic, not its own share."""

    listen: str  # host:port this replica receives on, e.g. 0.0.0.0:9005
    # Every peer, host:port; a name resolving to several addresses (a headless Service)
    # names them all. Re-resolved every `resolve_interval` seconds; datagrams from any
    # other address are dropped. This replica may be among them (it skips itself).
    addresses: tuple[str, ...] = Field(min_length=1)
    resolve_interval: StrictFloat = Field(default=10.0, gt=0)
    # The name of an environment variable holding a secret every replica shares: datagrams
    # then carry an HMAC-SHA256 tag, and untagged or wrongly tagged ones are dropped. Read
    # at start (a replica without it does not start), not at load: configs are checked
    # where secrets are not.
    secret_env: str | None = Field(default=None, min_length=1)

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        return host_port(value)

    @field_validator("addresses")
    @classmethod
    def _addresses(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(host_port(v) for v in value)

    @model_validator(mode="after")
    def _reachable(self) -> PeersSpec:
        """A peer address of a family the listen socket cannot reach started and peered with
        nobody (the only trace a warning that it 'does not resolve')."""
        listen = _ip_version(self.listen)
        for address in self.addresses:
            version = _ip_version(address)
            if listen == 4 and version == 6:
                raise ValueError(
                    f"addresses: {address} is IPv6 and listen {self.listen} is IPv4; listen on "
                    "[::]:PORT (both families) to reach it"
                )
            if listen == 6 and version == 4 and _host(self.listen) != "::":
                raise ValueError(
                    f"addresses: {address} is IPv4 and listen {self.listen} is one IPv6 "
                    "address; listen on [::]:PORT or 0.0.0.0:PORT to reach it"
                )
        return self


def _host(address: str) -> str:
    return address.rpartition(":")[0].removeprefix("[").removesuffix("]")


def _ip_version(address: str) -> int | None:
    """4 or 6 for an IP literal's host:port, None for a name (either may resolve)."""
    try:
        return ipaddress.ip_address(_host(address)).version
    except ValueError:
        return None


class TraceSpec(_Strict):
    """The decision trace: one JSON line per sampled request (never prompt text)."""

    path: str | None = None  # a JSONL file; None: no trace
    sample: StrictFloat = Field(default=1.0, ge=0, le=1)  # share of requests written
    max_bytes: StrictInt = Field(default=64 * 1024 * 1024, ge=4096)  # rotate past this size
    backups: StrictInt = Field(default=3, ge=1)  # rotated files kept (path.1 .. path.N)


class Config(_Strict):
    models: dict[str, ModelSpec]
    breaker: BreakerSpec = BreakerSpec()
    scrape: ScrapeSpec = ScrapeSpec()
    limits: LimitsSpec = LimitsSpec()
    admin: AdminSpec = AdminSpec()
    trace: TraceSpec = TraceSpec()
    peers: PeersSpec | None = None
    activation_timeout: StrictFloat = Field(default=45.0, gt=0)
    activation_poll_interval: StrictFloat = Field(default=0.25, gt=0)
    model_header: str = "x-llmgw-model"
    debug_headers: StrictBool = False
    # ext_proc: list the fallbacks after the primary in `x-gateway-destination-endpoint` and
    # `envoy.lb` (for gateways that retry down the list, e.g. llmgw's override-host config).
    # Off: the primary only, which ORIGINAL_DST clusters (GIE's reference config) need.
    destination_fallbacks: StrictBool = False
    # ext_proc: honour GIE's conformance-test headers (`test-epp-endpoint-selection` picks
    # among the listed IPs; `x-conformance-test-served-endpoint` echoes the served host).
    conformance_headers: StrictBool = False
    seed: StrictInt | None = None

    @field_validator("models")
    @classmethod
    def _nonempty(cls, value: dict[str, ModelSpec]) -> dict[str, ModelSpec]:
        if not value:
            raise ValueError("must configure at least one model")
        return value

    @field_validator("model_header")
    @classmethod
    def _header_name(cls, value: str) -> str:
        # Both edges see header names lower-cased (HTTP/2, Envoy, ASGI): `X-Model` as
        # written was never read.
        if not value.strip():
            raise ValueError("must name a header")
        if not _TOKEN.match(value.strip()):
            raise ValueError(f"{_NOT_A_HEADER} {value.strip()!r}")
        return value.strip().lower()


class ModelMode(enum.StrEnum):
    STATIC = "static"  # endpoints run by someone else: always routed
    ALWAYS_ON = "always_on"  # launched, min > 0
    ON_DEMAND = "on_demand"  # launched, min 0, max > 0
    OFF = "off"  # configured but off: requests get 503 model_disabled


def model_mode(spec: ModelSpec) -> ModelMode:
    """The scaling rules, in one place. `normalize()` has already filled an omitted max."""
    scaling = spec.scaling
    if scaling is None:
        return ModelMode.OFF if spec.launch is not None else ModelMode.STATIC
    if scaling.max == 0:
        return ModelMode.OFF
    if spec.launch is None:
        return ModelMode.STATIC
    return ModelMode.ALWAYS_ON if scaling.min > 0 else ModelMode.ON_DEMAND


def normalize(config: Config) -> Config:
    """Fill defaults that depend on other fields. An explicit `max: 0` stays 0 (off)."""
    models: dict[str, ModelSpec] = {}
    for name, spec in config.models.items():
        scaling = spec.scaling
        if scaling is not None and scaling.max is None:
            scaling = scaling.model_copy(update={"max": max(scaling.min, 1)})
        models[name] = spec.model_copy(update={"scaling": scaling})
    return config.model_copy(update={"models": models})


def endpoints_of(name: str, spec: ModelSpec) -> list[Endpoint]:
    return [
        Endpoint(address=e.address, model=name, pool=name, engine=spec.engine, weight=e.weight)
        for e in spec.endpoints
    ]


def _problem(err: Mapping[str, Any]) -> str:
    path = ".".join(str(p) for p in err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
    elif err["type"] == "missing":
        msg = "required field is missing"
    head = re.match(r"^([\w.-]+): (.*)$", msg, re.S)
    if head and err["type"] == "value_error":
        path = f"{path}.{head.group(1)}" if path else head.group(1)
        msg = head.group(2)
    return f"{path or '<root>'}: {msg}"


def load_dict(data: Any, source: str = "config") -> Config:
    if not isinstance(data, Mapping):
        raise ConfigError([f"<root>: must be a mapping, got {type(data).__name__}"], source)
    try:
        return normalize(Config.model_validate(data))
    except ValidationError as exc:
        raise ConfigError([_problem(e) for e in exc.errors()], source) from None
    except RecursionError:
        raise ConfigError(["<root>: nested too deeply to be a config"], source) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping: PyYAML keeps the last, so a
    model block copied without renaming it replaced the first model, and check-config
    called the file valid. Merged keys (`<<: *base`) may still be overridden: the check
    runs as each mapping is composed, before any merge is flattened into it (checked at
    construction, a chained merge's flattened pairs read as duplicates). Floats in YAML
    1.2 (and JSON) form too: `1e-1` is a string to YAML 1.1, refused by the strict
    number fields where it used to be coerced."""

    def compose_mapping_node(self, anchor: Any) -> yaml.MappingNode:
        node = super().compose_mapping_node(anchor)
        seen: set[tuple[str, str]] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(
                key_node, yaml.ScalarNode
            ):
                continue
            key = (key_node.tag, key_node.value)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key_node.value!r}", key_node.start_mark
                )
            seen.add(key)
        return node


_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)
# Booleans as YAML 1.2 reads them, true/false only: YAML 1.1's yes/no/on/off loaded as
# booleans, so `debug_headers: on` passed the strict switches unchecked, and a model named
# `off` became a boolean key whose error named no model.
_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in _UniqueKeyLoader.yaml_implicit_resolvers.items()
}
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def load_text(text: str, source: str = "config") -> Config:
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except RecursionError:
        raise ConfigError(["<yaml>: nested too deeply to be a config"], source) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ConfigError(
            [f"<yaml>: {where}{getattr(exc, 'problem', None) or exc}"], source
        ) from None
    return load_dict(data, source)


def load_file(path: str | Path) -> Config:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"<file>: cannot read {p}: {exc}"], str(p)) from None
    return load_text(text, str(p))
