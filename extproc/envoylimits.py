"""The hardening pieces of the generated Envoy config (both shapes): Envoy's defaults that bite.

- Circuit breakers sized to the fleet: Envoy allows 1,024 requests and 3 concurrent retries
  per cluster by default; LLM streams are long, so a fleet of 16 replicas x 256 sequences
  would see 503 overflows, and 3 retries let a failing replica's 5xx through under load.
  A retry budget of 100 % of active requests never overflows (each request retries one try
  at a time), with a floor of one per endpoint. The fleet: the static endpoints, each
  on-demand model's `scaling.max`, and DISCOVERED_ENDPOINTS for each discovered model.
- Outlier detection: a replica that answers 5xx or resets streams (counted as 5xx) is
  ejected for a while, even before llmgw's breaker hears of it.
- Header limits answered with 431 by a few lines of Lua before ext_proc (see
  CLIENT_MAX_HEADERS), not a 500 or a dropped connection.
- The body limit before ext_proc: the buffer filter answers 413 as soon as the body passes
  `limits.max_body_bytes` (with Content-Length: at once), instead of a 500 from a gRPC
  message over the size limit or a stall until the request timeout.
- A request head that does not arrive whole within `limits.client_header_timeout` gets 408
  (Envoy's `request_headers_timeout`; the proxy applies the same limit).
- Envoy's own 408, 413 and 431 in OpenAI's error shape (a JSON body, not Envoy's text).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from typing import Any

from llmgw.request import CLIENT_MAX_HEADERS, CLIENT_MAX_HEADERS_KB, HEADERS_TOO_LARGE

_T = "type.googleapis.com/"

# Requests (and pending requests) one endpoint may have in Envoy at once: above any
# engine's batch (vLLM's max_num_seqs defaults to 256).
PER_ENDPOINT_REQUESTS = 1024
# The endpoints a Kubernetes-discovered model counts for the breakers: its size is known only
# at run time, and the breakers are fixed in the bootstrap (a larger fleet still shares these).
DISCOVERED_ENDPOINTS = 64
# The client header limits (CLIENT_MAX_HEADERS*) are checked by a Lua filter: Envoy's
# HTTP/1 codec closes the connection without a response past its own limits, and ext_proc
# answers 500 when its mutation pushes the map over them. The codec's own, far above: room
# for the headers Envoy (x-request-id, x-forwarded-proto...) and ext_proc add.
CODEC_MAX_HEADERS = 2000
CODEC_MAX_HEADERS_KB = 256
# gRPC messages between Envoy and ext_proc carry at most the body plus headers.
GRPC_MESSAGE_MARGIN = 1 << 20


def circuit_breakers(endpoints: int) -> dict[str, Any]:
    requests = PER_ENDPOINT_REQUESTS * max(1, endpoints)
    return {
        "thresholds": [
            {
                "priority": "DEFAULT",
                "max_connections": requests,
                "max_pending_requests": requests,
                "max_requests": requests,
                "retry_budget": {
                    "budget_percent": {"value": 100.0},
                    "min_retry_concurrency": max(3, endpoints),
                },
            }
        ]
    }


def outlier_detection() -> dict[str, Any]:
    return {
        "consecutive_5xx": 3,  # resets and connect failures count as 5xx here
        "interval": "1s",
        "base_ejection_time": "5s",
        "max_ejection_time": "60s",
        "max_ejection_percent": 50,  # never eject more than half the fleet
        "consecutive_gateway_failure": 3,
        "enforcing_consecutive_gateway_failure": 100,
    }


def extproc_health_check() -> dict[str, Any]:
    """Envoy's active gRPC health check of each ext_proc replica (llmgw serves
    grpc.health.v1 on the ext_proc port for this service, `grpchealth.PROCESS_SERVICE`:
    SERVING until SIGTERM; named here, not imported, to keep grpc out of envoy-config)."""
    return {
        "timeout": "1s",
        "interval": "1s",
        "no_traffic_interval": "1s",  # the default 60 s would miss a replica that died idle
        "unhealthy_threshold": 2,
        "healthy_threshold": 1,
        "grpc_health_check": {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"},
    }


def upstream_tls(
    *, ca_file: str | None = None, sni: str | None = None, names: Sequence[str] = ()
) -> dict[str, Any]:
    """The ext_proc cluster's TLS: like GIE's gateways, no verification unless a CA is given
    (llmgw's default certificate is self-signed). With a CA, the certificate must also name
    one of `names` (an IP address as an IP SAN, else a DNS SAN): a CA alone let any
    certificate it issued, to whatever workload, answer as llmgw."""
    common: dict[str, Any] = {"alpn_protocols": ["h2"]}
    if ca_file:
        context: dict[str, Any] = {"trusted_ca": {"filename": ca_file}}
        if names:
            context["match_typed_subject_alt_names"] = [_san(name) for name in names]
        common["validation_context"] = context
    upstream: dict[str, Any] = {
        "@type": _T + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": common,
    }
    if sni:
        upstream["sni"] = sni
    return {"name": "envoy.transport_sockets.tls", "typed_config": upstream}


def _san(name: str) -> dict[str, Any]:
    """Envoy's SAN matcher for a host: an IP SAN for an address, a DNS SAN for a name."""
    bare = name.removeprefix("[").removesuffix("]")
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        return {"san_type": "DNS", "matcher": {"exact": bare.lower()}}
    return {"san_type": "IP_ADDRESS", "matcher": {"exact": ip.compressed}}


_HEADER_LIMIT_LUA = """
function envoy_on_request(handle)
  local count, size = 0, 0
  for key, value in pairs(handle:headers()) do
    count = count + 1
    size = size + #key + #value
  end
  if count > %(count)d or size > %(bytes)d then
    handle:respond({[":status"] = "431", ["content-type"] = "application/json"}, "")
    return
  end
  local length = tonumber(handle:headers():get("content-length") or "")
  if length ~= nil and length > %(body)d then
    handle:respond({[":status"] = "413", ["content-type"] = "application/json"}, "")
  end
end
"""


def header_limit_filter(max_body_bytes: int) -> dict[str, Any]:
    """431 past CLIENT_MAX_HEADERS headers or CLIENT_MAX_HEADERS_KB, and 413 for a declared
    content-length above the body limit before any of the body is read (the buffer filter
    waits for the limit to pass; the proxy checks the header too). The bodies come from the
    local reply mapper."""
    code = _HEADER_LIMIT_LUA % {
        "count": CLIENT_MAX_HEADERS,
        "bytes": CLIENT_MAX_HEADERS_KB * 1024,
        "body": max_body_bytes,
    }
    return {
        "name": "envoy.filters.http.lua",
        "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": code.strip() + "\n"},
        },
    }


def body_limit_filter(max_body_bytes: int) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.buffer",
        "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.buffer.v3.Buffer",
            "max_request_bytes": max_body_bytes,
        },
    }


def _mapper(match: dict[str, Any], message: str, code: str, kind: str) -> dict[str, Any]:
    """A local reply mapper: replies that `match` (an access-log filter) selects get an
    OpenAI-shaped JSON error body."""
    return {
        "filter": match,
        "body_format_override": {
            "json_format": {"error": {"message": message, "type": kind, "code": code}}
        },
    }


def _openai_error(status: int, message: str, code: str, kind: str) -> dict[str, Any]:
    """The mapper for every local reply with this status."""
    value = {"default_value": status, "runtime_key": f"llmgw.reply_{status}"}
    match = {"status_code_filter": {"comparison": {"op": "EQ", "value": value}}}
    return _mapper(match, message, code, kind)


def _envoy_error(when: str, message: str, code: str, kind: str = "server_error") -> dict[str, Any]:
    """The mapper for Envoy's local replies that the CEL expression `when` matches."""
    cel = _T + "envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter"
    match = {
        "extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {"@type": cel, "expression": when},
        }
    }
    return _mapper(match, message, code, kind)


def local_reply_config(max_body_bytes: int) -> dict[str, Any]:
    """Envoy's own replies as OpenAI-shaped JSON errors: 408, 413 and 431 by status (llmgw's
    own 413 says the same thing), the rest by their response code details, which tell
    Envoy's replies from ext_proc's immediate responses (`llmgw_*`: those carry llmgw's JSON
    bodies, and a mapper would rewrite them)."""
    return {
        "mappers": [
            _openai_error(
                413,
                f"request body is larger than the limit of {max_body_bytes} bytes",
                "body_too_large",
                "invalid_request_error",
            ),
            _openai_error(
                408,  # request_headers_timeout, or a body that stalls past the route's idle timeout
                "the request did not arrive whole in time (its head within "
                "limits.client_header_timeout)",
                "request_timeout",
                "invalid_request_error",
            ),
            _openai_error(
                431,
                HEADERS_TOO_LARGE,
                "headers_too_large",
                "invalid_request_error",
            ),
            # Envoy's own replies below: ext_proc's immediate responses (details `llmgw_*`)
            # carry llmgw's JSON already and must pass untouched.
            _envoy_error(
                "response.code_details.startsWith('ext_proc')",
                "the router did not answer: llmgw's ext_proc server is down, Envoy cannot reach "
                "it, or it answered past the filter's message_timeout (%RESPONSE_CODE_DETAILS%)",
                "router_unavailable",
            ),
            _envoy_error(  # a 408 stream_idle_timeout (a stalled client) is mapped above
                "response.code_details.startsWith('upstream') || response.code_details in "
                "['no_healthy_upstream', 'response_timeout', 'stream_idle_timeout']",
                "no model server answered: %LOCAL_REPLY_BODY% (%RESPONSE_CODE_DETAILS%)",
                "upstream_unreachable",
            ),
            _envoy_error(
                "response.code < 500 && !response.code_details.startsWith('llmgw_')",
                "%LOCAL_REPLY_BODY% (%RESPONSE_CODE_DETAILS%)",
                "invalid_request",
                "invalid_request_error",
            ),
            _envoy_error(  # (a direct response is llmgw's own JSON: the no-pick 503)
                "!response.code_details.startsWith('llmgw_') && "
                "response.code_details != 'direct_response'",
                "%LOCAL_REPLY_BODY% (%RESPONSE_CODE_DETAILS%)",
                "gateway_error",
            ),
        ]
    }
