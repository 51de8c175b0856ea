"""`llmgw envoy-config`: the Envoy bootstrap that puts llmgw's ext_proc in front of a pool.

Two shapes (both speak the Gateway API Inference Extension endpoint-picker protocol):

- `original-dst`: an ORIGINAL_DST cluster with `use_http_header` on
  `x-gateway-destination-endpoint`: one host per request, no fallback (the GIE default).
  A second route without that header goes to a cluster listing the configured
  endpoints, so fail-open still lands somewhere sensible.
- `override-host`: one cluster listing the endpoints with the
  `envoy.load_balancing_policies.override_host` policy reading the `envoy.lb` metadata
  list (primary, then fallbacks) and the header; Envoy retries (5xx, reset, connect
  failure, 429) walk the fallbacks. Without a pick (fail-open) it falls back to
  least-request over the same endpoints.

Timeouts: `route_timeout` bounds a whole request (streams included; 0 disables);
`limits.upstream_read_timeout` (the longest silence from an endpoint, the same knob as
the embedded proxy's) is the route's idle timeout in `original-dst`, and the per-try idle
timeout in `override-host`, so a replica that hangs is retried on a fallback; the route's
idle timeout there is one silence a try ((retries + 1) x upstream_read_timeout), so it
never ends the request before the last retry. With on-demand models, the idle timeouts
add message_timeout: the stream is silent while llmgw waits for a start. The HCM's
stream idle timeout is the same (Envoy's default, 300 s, is shorter than the default read
timeout).

Both: the ext_proc filter (`body_mode` override, the default) asks for request headers only
(the server asks for the body per request with `mode_override`, so GETs and header-routed
requests never buffer, and turns the response headers on for each request it routes, so
Envoy's own replies to requests it never saw are not held for it); `gie` copies GIE's
reference processing mode
(FULL_DUPLEX_STREAMED bodies, trailers sent). It accepts dynamic metadata in `envoy.lb`, and Envoy adds `x-llmgw-upstream`
(the host that answered) to responses so outcomes are charged to the right replica.
Clients cannot choose a host: `x-gateway-destination-endpoint` is stripped on arrival,
before any filter runs. Limits, breakers and the TLS socket to ext_proc (the command's
default, like `llmgw extproc`'s; `build()` defaults to plaintext): extproc/envoylimits.py.

The output is plain YAML built from dicts; the tests run `envoy --mode validate` on it.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from llmgw.config import Config, ModelMode, load_file, model_mode
from llmgw.errors import ConfigError
from llmgw.extproc import envoylimits
from llmgw.lifecycle import (
    DESTINATION_HEADER,
    INTERNAL_HEADERS,
    METADATA_NAMESPACE,
    SUBSET_NAMESPACE,
    UPSTREAM_HEADER,
)

SHAPES = ("original-dst", "override-host")
EXTPROC_CLUSTER = "llmgw-extproc"
POOL_CLUSTER = "llm-pool"
ORIGINAL_DST_CLUSTER = "llm-original-dst"
_T = "type.googleapis.com/"


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _bind_address(address: str, what: str) -> tuple[str, int]:
    """A listener's `ip:port` (Envoy binds IP literals only; IPv6 in brackets)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not _is_ip(host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"{what} {address!r}: give an IP address and a port in 1..65535, e.g. 0.0.0.0:8080 "
            "or [::]:8080 (Envoy binds addresses, not host names)"
        )
    return host, int(port)


MAX_MESSAGE_TIMEOUT = 3600.0  # Envoy's bound on the ext_proc filter's message_timeout


def duration(seconds: float, what: str) -> str:
    """Seconds as a protobuf Duration string Envoy parses ("1e+06s" is refused)."""
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{what}: {seconds!r} is not a duration in seconds (>= 0)")
    text = f"{seconds:.9f}".rstrip("0").rstrip(".")
    if seconds and text == "0":  # Envoy reads 0 s as "no limit"
        raise ValueError(
            f"{what}: {seconds!r} is under Envoy's resolution of 1 ns (give 0 or more)"
        )
    return f"{text or '0'}s"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def host_name_problem(config: Config) -> str | None:
    """Why Envoy could not reach an endpoint `config` names (None: it can), for
    `envoy-config` and the ext_proc server alike (original-dst's envoy.yaml lists no
    endpoints: the server's config, at start and on reload, is the one place to refuse).

    Envoy takes llmgw's pick as an address: override-host matches it against its hosts'
    resolved IPs, original-dst connects to it. With names, every request through Envoy
    failed (503 upstream_unreachable, then open breakers), measured with Envoy 1.40. A
    local on-demand model's endpoint is `launch.host:PORT`; Kubernetes gives pod IPs."""
    why = (
        "behind Envoy, endpoints must be IP addresses (llmgw's pick goes to Envoy as an "
        "address, matched by IP); Kubernetes discovery gives pod IPs, and the embedded proxy "
        "(`llmgw proxy`) takes host names"
    )
    for name, model in config.models.items():
        for endpoint in model.endpoints:
            if not _is_ip(_split(endpoint.address)[0]):
                return f"endpoint {endpoint.address}: {why}"
        launch = model.launch
        if launch is not None and launch.command is not None and not _is_ip(launch.host):
            return f"models.{name}.launch.host {launch.host!r}: {why}"
    return None


def _socket(host: str, port: int) -> dict[str, Any]:
    address: dict[str, Any] = {"address": host, "port_value": port}
    if host == "::":  # every address, IPv4 clients too (bare `::` binds IPv6 only)
        address["ipv4_compat"] = True
    return {"socket_address": address}


def _drop_response_header(name: str) -> dict[str, Any]:
    mutation = _T + "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
    return {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": mutation,
            "mutations": {"response_mutations": [{"remove": name}]},
        },
    }


def _extproc_addresses(addresses: str) -> list[str]:
    """`host:port[,host:port...]` (an IPv6 host in brackets): several llmgw replicas, which
    Envoy balances its ext_proc streams over (one per request, round robin; `peers:` keeps
    their views shared). Each checked, each once."""
    out: dict[tuple[str, int], str] = {}
    for item in addresses.split(",") if addresses.strip(",") else [addresses]:
        address = item.strip()
        host, _, port = address.rpartition(":")
        bare = host.removeprefix("[").removesuffix("]")
        ok = bool(bare) and port.isascii() and port.isdigit() and 0 < int(port) < 65536
        if ok and ":" in bare:  # IPv6: bracketed, and an address
            ok = host == f"[{bare}]" and _is_ip(bare)
        elif ok:
            ok = host == bare and not any(c.isspace() or c in "[]/" for c in host)
        if not ok:
            raise ValueError(
                f"ext_proc address {address!r}: give host:port ([v6 address]:port), or "
                "several separated by commas"
            )
        out.setdefault((bare, int(port)), f"{host}:{int(port)}")
    return list(out.values())


def _static_cluster(
    name: str, addresses: list[str], *, http2: bool = False, connect_timeout: str = "1s"
) -> dict[str, Any]:
    hosts = [_split(a) for a in addresses]
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC" if all(_is_ip(h) for h, _ in hosts) else "STRICT_DNS",
        "connect_timeout": connect_timeout,
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _socket(h, p)}} for h, p in hosts]}
            ],
        },
    }
    if http2:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return cluster


def _http1_options(idle_timeout: str) -> dict[str, Any]:
    """HTTP/1.1 to the model servers, idle connections closed after `idle_timeout`."""
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": _T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "common_http_protocol_options": {"idle_timeout": idle_timeout},
            "explicit_http_config": {"http_protocol_options": {}},
        }
    }


def _override_host_policy() -> dict[str, Any]:
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.override_host",
                    "typed_config": {
                        "@type": _T
                        + "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                        # The metadata list first: it carries the fallbacks for retries.
                        "override_host_sources": [
                            {
                                "metadata": {
                                    "key": METADATA_NAMESPACE,
                                    "path": [{"key": DESTINATION_HEADER}],
                                }
                            },
                            {"header": DESTINATION_HEADER},
                        ],
                        "fallback_policy": {
                            "policies": [
                                {
                                    "typed_extension_config": {
                                        "name": "envoy.load_balancing_policies.least_request",
                                        "typed_config": {
                                            "@type": _T
                                            + "envoy.extensions.load_balancing_policies."
                                            "least_request.v3.LeastRequest"
                                        },
                                    }
                                }
                            ]
                        },
                    },
                }
            }
        ]
    }


NO_PICK_BODY = (
    '{"error": {"message": "the router could not pick an endpoint (ext_proc unavailable)", '
    '"type": "service_unavailable", "code": "no_pick"}}'
)


def build(
    config: Config,
    *,
    shape: str = "original-dst",
    listen_host: str = "0.0.0.0",
    listen_port: int = 8080,
    admin_host: str = "127.0.0.1",
    admin_port: int = 9901,
    extproc_address: str = "127.0.0.1:9002",
    fail_open: bool = False,
    message_timeout: float | None = None,
    route_timeout: float = 600.0,
    retries: int | None = None,
    connect_timeout: float = 1.0,
    read_timeout: float | None = None,
    body_mode: str = "override",
    extproc_tls: bool = False,
    extproc_ca: str | None = None,
    extproc_names: Sequence[str] = (),
) -> dict[str, Any]:
    """The Envoy bootstrap as a dict (dump it as YAML or JSON)."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    if body_mode not in BODY_MODES:
        raise ValueError(f"body mode must be one of {', '.join(BODY_MODES)}, got {body_mode!r}")
    if shape == "original-dst" and config.destination_fallbacks:
        raise ValueError(
            "destination_fallbacks: true sends `primary,fallback,...` as the destination, which "
            "an ORIGINAL_DST cluster cannot parse: set it false for shape original-dst, or use "
            "shape override-host"
        )
    problem = host_name_problem(config)
    if problem is not None:
        raise ValueError(problem)
    addresses = list(dict.fromkeys(e.address for m in config.models.values() for e in m.endpoints))
    if not addresses and shape != "original-dst":
        raise ValueError(
            f"shape {shape!r} needs static endpoints to list in the Envoy cluster; the config has "
            "none (on-demand or Kubernetes-discovered models only): use shape original-dst"
        )
    # A launched model switched off (`scaling.max: 0`) never has an endpoint: llmgw answers
    # its requests itself, none reaches an engine.
    dynamic = [
        n
        for n, m in config.models.items()
        if (m.launch is not None and model_mode(m) is not ModelMode.OFF) or m.discovery is not None
    ]
    if dynamic and shape != "original-dst":
        # Envoy would not find llmgw's pick among the cluster's hosts and fall back to a
        # static endpoint: another model's engine (a 404, or another model's answer).
        raise ValueError(
            f"model {dynamic[0]}: shape {shape!r} lists only the static endpoints in its "
            "cluster, and this model's endpoints (started on demand or discovered on "
            "Kubernetes) are not among them: Envoy would send its requests to another "
            "model's endpoint. Use shape original-dst"
        )
    launched = any(
        m.launch is not None and model_mode(m) is not ModelMode.OFF for m in config.models.values()
    )
    if message_timeout is None:
        # A request for an on-demand model holds its ext_proc answer while the model starts:
        # Envoy must wait longer than llmgw's activation_timeout, or it cuts the wait short.
        message_timeout = config.activation_timeout + 5.0 if launched else 2.0
        if message_timeout > MAX_MESSAGE_TIMEOUT:
            raise ValueError(
                f"activation_timeout {config.activation_timeout:g} s: Envoy holds an ext_proc "
                f"answer at most {MAX_MESSAGE_TIMEOUT:g} s (message_timeout), so an on-demand "
                f"model's wait must end before: set activation_timeout below "
                f"{MAX_MESSAGE_TIMEOUT - 5:g}"
            )
    elif not 0 < message_timeout <= MAX_MESSAGE_TIMEOUT:
        raise ValueError(
            f"--message-timeout {message_timeout:g}: give seconds in (0, {MAX_MESSAGE_TIMEOUT:g}]"
        )
    if retries is None:
        retries = max(m.session.num_fallback_replicas for m in config.models.values())
    if retries < 0:
        raise ValueError(f"--retries {retries}: give 0 or more")
    read = read_timeout or config.limits.upstream_read_timeout
    # Envoy's stream idle timer runs from the client's last byte (only traffic to or from
    # the client resets it): through ext_proc's answer, which for an on-demand model waits
    # for its start (up to message_timeout), and through every try's silence.
    tries = retries + 1 if shape == "override-host" else 1
    silence = tries * read + (message_timeout if launched else 0.0)
    timing = _Timing(
        route=duration(route_timeout, "--route-timeout"),
        idle=duration(read, "limits.upstream_read_timeout"),
        stream_idle=duration(silence, "stream idle timeout"),
        connect=duration(connect_timeout, "connect timeout"),
    )
    if config.limits.max_body_bytes + (64 << 10) + envoylimits.GRPC_MESSAGE_MARGIN >= 1 << 32:
        raise ValueError(
            f"limits.max_body_bytes {config.limits.max_body_bytes}: Envoy's buffer limits are "
            "32-bit: give at most 4 GB less 2 MB"
        )
    if config.limits.upstream_idle_timeout < 0.001:  # Envoy reads 0 as "never close"
        raise ValueError(
            f"limits.upstream_idle_timeout {config.limits.upstream_idle_timeout:g}: give at "
            "least 0.001 s (Envoy keeps idle connections forever at 0)"
        )
    idle = duration(config.limits.upstream_idle_timeout, "limits.upstream_idle_timeout")
    if shape == "original-dst":
        routes, clusters = _original_dst_shape(addresses, timing)
    else:
        routes, clusters = _override_host_shape(addresses, timing, retries)
    fleet = _fleet_size(config, len(addresses))
    for cluster in clusters:  # the model-server clusters, both shapes
        # The ORIGINAL_DST cluster carries every model's requests, the pool only its hosts'.
        size = fleet if cluster["name"] == ORIGINAL_DST_CLUSTER else len(addresses)
        cluster["circuit_breakers"] = envoylimits.circuit_breakers(size)
        cluster["outlier_detection"] = envoylimits.outlier_detection()
        # Idle upstream connections closed before the engine closes them (vLLM and SGLang
        # serve with uvicorn's 5 s keep-alive; Envoy's own default is 1 h): a request sent
        # on a connection the engine is closing is reset before any answer, a 503 where no
        # retry policy sends it on (original-dst), a gateway failure toward ejection either
        # way. The proxy's upstream pool keeps the same limit.
        cluster["typed_extension_protocol_options"] = _http1_options(idle)
    extproc_cluster = _static_cluster(
        EXTPROC_CLUSTER, _extproc_addresses(extproc_address), http2=True,
        connect_timeout=timing.connect,
    )  # fmt: skip
    if extproc_tls or extproc_ca:
        hosts = [a.rpartition(":")[0] for a in _extproc_addresses(extproc_address)]
        names = list(extproc_names) if extproc_names else hosts
        # A name's certificate is asked for by it (SNI), as a client of that name would.
        sni = next((n for n in names if not _is_ip(n.strip("[]"))), None) if extproc_ca else None
        extproc_cluster["transport_socket"] = envoylimits.upstream_tls(
            ca_file=extproc_ca, sni=sni, names=names
        )
    # A dead or draining replica of several must not keep its share of the requests (each
    # would fail, or pass unrouted with fail-open): Envoy asks each one's grpc.health.v1
    # (NOT_SERVING from SIGTERM on) and ejects one whose streams fail. With every replica
    # down, Envoy's panic mode still tries them: a single replica behaves as before.
    extproc_cluster["health_checks"] = [envoylimits.extproc_health_check()]
    extproc_cluster["outlier_detection"] = envoylimits.outlier_detection()
    # Every request Envoy carries holds one ext_proc stream for its whole life: sized as
    # the fleet's, not Envoy's default 1,024 (the 1,025th concurrent stream got 500, or
    # went unrouted with fail-open).
    extproc_cluster["circuit_breakers"] = envoylimits.circuit_breakers(fleet)
    max_body = config.limits.max_body_bytes
    listener = _listener(
        _socket(listen_host, listen_port),
        routes,
        _ext_proc_filter(
            fail_open=fail_open,
            message_timeout=message_timeout,
            max_message=max_body + envoylimits.GRPC_MESSAGE_MARGIN,
            body_mode=body_mode,
        ),
        # Room for the largest body llmgw accepts (it answers 413 beyond it).
        buffer_limit=max_body + (64 << 10),
        max_body=max_body,
        header_timeout=config.limits.client_header_timeout,
        stream_idle=timing.stream_idle,
    )
    return {
        "admin": {"address": _socket(admin_host, admin_port)},
        "static_resources": {"listeners": [listener], "clusters": [extproc_cluster, *clusters]},
    }


def _fleet_size(config: Config, static: int) -> int:
    """The endpoints Envoy may see at once, for the breakers: the static ones, each on-demand
    model's `scaling.max`, and envoylimits.DISCOVERED_ENDPOINTS for each discovered model
    (its size is unknown here)."""
    size = static
    for spec in config.models.values():
        if spec.discovery is not None:
            size += envoylimits.DISCOVERED_ENDPOINTS
        elif spec.launch is not None:
            scaled = spec.scaling.max if spec.scaling is not None else None
            size += 1 if scaled is None else scaled
    return size


@dataclass(frozen=True, slots=True)
class _Timing:
    route: str  # whole request
    idle: str  # longest silence from one endpoint (one try)
    stream_idle: str  # longest silence of the whole request: ext_proc's answer, every try
    connect: str


Routes = list[dict[str, Any]]
Clusters = list[dict[str, Any]]


def _original_dst_shape(addresses: list[str], timing: _Timing) -> tuple[Routes, Clusters]:
    """(a) ORIGINAL_DST reading the destination header: one host, no fallback (GIE default)."""
    picked = {
        "cluster": ORIGINAL_DST_CLUSTER,
        "timeout": timing.route,
        "idle_timeout": timing.stream_idle,
    }
    routes: Routes = [
        {
            "match": {
                "prefix": "/",
                "headers": [{"name": DESTINATION_HEADER, "present_match": True}],
            },
            "route": picked,
        },
        # No pick (ext_proc down, fail-open): any configured endpoint, or a clear 503
        # when every model is started on demand (nothing static to fall back to).
        {
            "match": {"prefix": "/"},
            "route": {
                "cluster": POOL_CLUSTER,
                "timeout": timing.route,
                "idle_timeout": timing.stream_idle,
            },
        }
        if addresses
        else {
            "match": {"prefix": "/"},
            "direct_response": {"status": 503, "body": {"inline_string": NO_PICK_BODY}},
        },
    ]
    clusters: Clusters = [
        {
            "name": ORIGINAL_DST_CLUSTER,
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": timing.connect,
            "original_dst_lb_config": {
                "use_http_header": True,
                "http_header_name": DESTINATION_HEADER,
            },
        }
    ]
    if addresses:
        pool = _static_cluster(POOL_CLUSTER, addresses, connect_timeout=timing.connect)
        pool["lb_policy"] = "LEAST_REQUEST"
        clusters.append(pool)
    return routes, clusters


def _override_host_shape(
    addresses: list[str], timing: _Timing, retries: int
) -> tuple[Routes, Clusters]:
    """(b) The endpoints listed, override_host LB: primary first, fallbacks on retries.
    Each try may be silent for `idle` (a hung replica is retried on the next); the route's
    idle timeout lets every try take it (without one, Envoy's default 300 s cut a silent
    answer short, and with no retries nothing bounded a hung replica's silence)."""
    route: dict[str, Any] = {
        "cluster": POOL_CLUSTER,
        "timeout": timing.route,
        "idle_timeout": timing.stream_idle,
    }
    if retries > 0:
        route["retry_policy"] = {
            "retry_on": "5xx,reset,connect-failure,retriable-status-codes",
            "retriable_status_codes": [429],
            "num_retries": retries,
            "per_try_idle_timeout": timing.idle,
        }
    pool = _static_cluster(POOL_CLUSTER, addresses, connect_timeout=timing.connect)
    pool["load_balancing_policy"] = _override_host_policy()
    return [{"match": {"prefix": "/"}, "route": route}], [pool]


def _mode(request_body: str, response_body: str, response_headers: str = "SEND") -> dict[str, str]:
    # FULL_DUPLEX_STREAMED requires the trailers of that direction to be sent. A BUFFERED
    # request body sends them too: an HTTP/2 request whose trailers follow no body brings
    # ext_proc no body message, only them (skipped, it would pass unrouted).
    return {
        "request_header_mode": "SEND",
        "response_header_mode": response_headers,
        "request_body_mode": request_body,
        "response_body_mode": response_body,
        "request_trailer_mode": "SKIP" if request_body == "NONE" else "SEND",
        "response_trailer_mode": "SEND" if response_body == "FULL_DUPLEX_STREAMED" else "SKIP",
    }


# ext_proc processing modes, by the gateway they copy (only the filter settings):
# - override: llmgw's own: request headers only; llmgw asks for the body per request
#   (mode_override), so GETs and header-routed requests never buffer, and turns the response
#   headers on for the requests it routes: Envoy's own replies to requests ext_proc never saw
#   (a malformed HTTP/1 request's 400, the buffer's 413) are not held for it, which lost them
#   (the connection closed while the reply waited for ext_proc).
# - gie: GIE's reference / kgateway / Istio: both bodies FULL_DUPLEX_STREAMED, trailers sent.
# - envoy-gateway: GIE's Envoy Gateway patch: request body FULL_DUPLEX_STREAMED only.
# - buffered: the request body BUFFERED, no override.
BODY_MODES: dict[str, tuple[dict[str, str], bool]] = {
    "override": (_mode("NONE", "NONE", response_headers="SKIP"), True),
    "gie": (_mode("FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED"), False),
    "envoy-gateway": (_mode("FULL_DUPLEX_STREAMED", "NONE"), False),
    "buffered": (_mode("BUFFERED", "NONE"), False),
}


def _ext_proc_filter(
    *, fail_open: bool, message_timeout: float, max_message: int, body_mode: str = "override"
) -> dict[str, Any]:
    processing_mode, allow_override = BODY_MODES[body_mode]
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {
                "envoy_grpc": {
                    "cluster_name": EXTPROC_CLUSTER,
                    "max_receive_message_length": max_message,  # ext_proc's answers: body + 1 MiB
                }
            },
            "failure_mode_allow": fail_open,
            "allow_mode_override": allow_override,
            "message_timeout": duration(message_timeout, "message timeout"),
            "processing_mode": processing_mode,
            # Sent to llmgw: the subset hint, and `envoy.lb` (where a gateway reports the
            # endpoint that served); received from llmgw: the picked endpoints.
            "metadata_options": {
                "forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE, METADATA_NAMESPACE]},
                "receiving_namespaces": {"untyped": [METADATA_NAMESPACE]},
            },
        },
    }


def _listener(
    address: dict[str, Any],
    routes: Routes,
    ext_proc: dict[str, Any],
    *,
    buffer_limit: int,
    max_body: int,
    header_timeout: float,
    stream_idle: str,
) -> dict[str, Any]:
    """The HTTP listener: client copies of llmgw's own headers (the destination, the
    decision, the upstream) stripped first, ext_proc, then the router; responses say which
    host answered (for the outcome after retries)."""
    strip_internal = {
        "name": "envoy.http.early_header_mutation.header_mutation",
        "typed_config": {
            "@type": _T
            + "envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
            "mutations": [{"remove": name} for name in sorted(INTERNAL_HEADERS)],
        },
    }
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": _T + "envoy.extensions.filters.http.router.v3.Router"},
    }
    hcm = {
        "@type": _T
        + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "llm",
        "codec_type": "AUTO",
        "early_header_mutation_extensions": [strip_internal],
        "max_request_headers_kb": envoylimits.CODEC_MAX_HEADERS_KB,
        "common_http_protocol_options": {"max_headers_count": envoylimits.CODEC_MAX_HEADERS},
        "request_headers_timeout": duration(header_timeout, "limits.client_header_timeout"),
        # The routes' idle timeout again, for the 503 route, which sets none: with every
        # model on demand a start's wait matched it, and Envoy's default 300 s ended it.
        "stream_idle_timeout": stream_idle,
        "local_reply_config": envoylimits.local_reply_config(max_body),
        "route_config": {
            "name": "llm",
            "virtual_hosts": [
                {
                    "name": "llm",
                    "domains": ["*"],
                    "routes": routes,
                    "response_headers_to_add": [
                        {
                            "header": {"key": UPSTREAM_HEADER, "value": "%UPSTREAM_HOST%"},
                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                        }
                    ],
                }
            ],
        },
        # The header and body limits first: an oversized request never reaches ext_proc.
        "http_filters": [
            envoylimits.header_limit_filter(max_body),
            envoylimits.body_limit_filter(max_body),
            # Responses pass filters in reverse: ext_proc reads the upstream header first,
            # then this drops it where ext_proc did not (down, with fail-open: the engine's
            # address reached clients).
            _drop_response_header(UPSTREAM_HEADER),
            ext_proc,
            router,
        ],
    }
    return {
        "name": "llm",
        "address": address,
        "per_connection_buffer_limit_bytes": buffer_limit,
        "filter_chains": [
            {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]
            }
        ],
    }


def render(bootstrap: dict[str, Any], source: str = "") -> str:
    head = "# Generated by `llmgw envoy-config`"
    head += f" from {source}.\n" if source else ".\n"
    return head + yaml.safe_dump(bootstrap, sort_keys=False, width=100)


def _count(text: str) -> int:
    """An argparse type: a whole number, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number, 0 or more")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmgw envoy-config",
        description="Generate the Envoy config that routes through llmgw's ext_proc.",
    )
    parser.add_argument("--config", required=True, help="llmgw config file (endpoints, limits)")
    parser.add_argument("--shape", choices=SHAPES, default="original-dst")
    parser.add_argument("--listen", default="0.0.0.0:8080", help="client listener host:port")
    parser.add_argument("--admin", default="127.0.0.1:9901", help="admin host:port")
    parser.add_argument(
        "--extproc",
        default="127.0.0.1:9002",
        help="ext_proc server host:port; several llmgw replicas separated by commas "
        "(Envoy balances requests over them; give them `peers:`)",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--fail-open",
        dest="fail_open",
        action="store_true",
        help="route without llmgw when it is unreachable",
    )
    mode.add_argument(
        "--fail-closed", dest="fail_open", action="store_false", help="answer 500 (default)"
    )
    parser.add_argument(
        "--message-timeout",
        type=float,
        default=None,
        help="seconds per ext_proc message (default 2, or activation_timeout + 5 with on-demand models)",
    )
    parser.add_argument("--route-timeout", type=float, default=600.0, help="0 disables")
    parser.add_argument("--retries", type=_count, help="override-host retries (default: fallbacks)")
    parser.add_argument(
        "--body-mode",
        choices=tuple(BODY_MODES),
        default="override",
        help="ext_proc processing mode: override (llmgw asks per request), gie "
        "(FULL_DUPLEX_STREAMED both ways, as GIE/kgateway/Istio), envoy-gateway, buffered",
    )
    tls = parser.add_mutually_exclusive_group()
    tls.add_argument(
        "--extproc-plaintext",
        action="store_true",
        help="talk to ext_proc without TLS (pair with `llmgw extproc --plaintext`); "
        "default: TLS without verification, as llmgw's self-signed default",
    )
    tls.add_argument(
        "--extproc-ca",
        help="PEM CA file to verify the ext_proc certificate with; the certificate must also "
        "name the --extproc host (or an --extproc-san)",
    )
    parser.add_argument(
        "--extproc-san",
        action="append",
        default=[],
        help="a name (DNS or IP) the ext_proc certificate must carry instead of the --extproc "
        "hosts (repeatable; with --extproc-ca)",
    )
    parser.add_argument("--out", help="write here instead of stdout")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = load_file(args.config)
        listen_host, listen_port = _bind_address(args.listen, "--listen")
        admin_host, admin_port = _bind_address(args.admin, "--admin")
        bootstrap = build(
            config,
            shape=args.shape,
            listen_host=listen_host,
            listen_port=listen_port,
            admin_host=admin_host,
            admin_port=admin_port,
            extproc_address=args.extproc,
            fail_open=args.fail_open,
            message_timeout=args.message_timeout,
            route_timeout=args.route_timeout,
            retries=args.retries,
            body_mode=args.body_mode,
            extproc_tls=not args.extproc_plaintext,
            extproc_ca=args.extproc_ca,
            extproc_names=args.extproc_san,
        )
        text = render(bootstrap, Path(args.config).name)
    except (ConfigError, ValueError) as exc:
        print(f"llmgw envoy-config: {exc}", file=sys.stderr)
        return 2
    if args.shape == "override-host" and not config.destination_fallbacks:
        # Valid, but Envoy's retries then pick any endpoint, not the Decision's fallbacks.
        print(
            "llmgw envoy-config: note: set `destination_fallbacks: true` in the llmgw config "
            "for shape override-host, so Envoy retries on llmgw's fallbacks (without it they "
            "go to the least-loaded endpoint Envoy sees)",
            file=sys.stderr,
        )
    streamed = BODY_MODES[args.body_mode][0]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    if streamed:
        listener = bootstrap["static_resources"]["listeners"][0]
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        print(
            f"llmgw envoy-config: note: with --body-mode {args.body_mode} (FULL_DUPLEX_STREAMED) "
            "Envoy starts no message_timeout timer: an ext_proc server that never answers "
            "(llmgw wedged, a partition that keeps the connection) holds each request for twice "
            f"the stream idle timeout ({hcm['stream_idle_timeout']}: it fires, then Envoy's own "
            "504 waits out another at ext_proc's response-headers step), and --fail-open never "
            "routes around it",
            file=sys.stderr,
        )
    if streamed and args.fail_open:
        print(
            f"llmgw envoy-config: note: --fail-open has no effect with --body-mode "
            f"{args.body_mode}: Envoy does not apply failure_mode_allow to a "
            "FULL_DUPLEX_STREAMED ext_proc filter, so while the ext_proc server is down every "
            "request gets 500 router_unavailable, as with --fail-closed (a server killed "
            "mid-request cuts the streams in flight; a wedged one holds them as above)",
            file=sys.stderr,
        )
    if args.shape == "override-host" and args.retries != 0 and streamed:
        print(
            "llmgw envoy-config: note: Envoy (1.35 to at least 1.40) sends a FULL_DUPLEX_STREAMED "
            "request body twice when the route may retry and trailers end the body "
            "(envoyproxy/envoy#45470): HTTP/2 requests with trailers get the engine's 400 here; "
            "`--body-mode override` or `--retries 0` avoid it",
            file=sys.stderr,
        )
    if args.out:
        try:
            Path(args.out).write_text(text)
        except OSError as exc:
            print(
                f"llmgw envoy-config: cannot write --out {args.out}: {exc.strerror}",
                file=sys.stderr,
            )
            return 2
    else:
        sys.stdout.write(text)
    return 0
