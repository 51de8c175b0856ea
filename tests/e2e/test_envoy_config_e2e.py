"""The generated Envoy config under a real Envoy 1.40: the ext_proc cluster's breaker is
the fleet's, the no-pick 503 reaches clients as written, `[::]` takes IPv4 clients too,
and the upstream header never leaks with fail-open."""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.config import load_dict, load_file
from llmgw.extproc.envoyconfig import (
    EXTPROC_CLUSTER,
    ORIGINAL_DST_CLUSTER,
    _bind_address,
    build,
)
from llmgw.lifecycle import UPSTREAM_HEADER
from llmgw.runtime.ports import free_port
from llmgw.sim import SimFleet
from llmgw.testing.extproc import EnvoyProcess, envoy_binary, loopback_bootstrap

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def _clusters(bootstrap: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}


def _max_requests(cluster: dict[str, Any]) -> int:
    """The DEFAULT-priority max_requests Envoy applies (its default: 1024)."""
    for t in cluster.get("circuit_breakers", {}).get("thresholds", []):
        if t.get("priority", "DEFAULT") == "DEFAULT" and "max_requests" in t:
            return int(t["max_requests"])
    return 1024


def test_extproc_cluster_breaker_lets_every_admitted_request_open_its_ext_proc_stream() -> None:
    """Each request Envoy carries holds one ext_proc gRPC stream (one request on the
    llmgw-extproc cluster) for its whole life, in every body mode (measured: override and
    gie both show upstream_rq_active 1 on llmgw-extproc for the length of a stream). The
    model-server clusters' breakers are sized to the fleet (1,024 per endpoint), but the
    ext_proc cluster keeps Envoy's default max_requests of 1,024: the 1,025th concurrent
    request gets 500 router_unavailable (fail-closed) or passes unrouted (fail-open)."""
    config = load_file(ROOT / "deploy" / "k8s" / "llmgw-config.yaml")  # the shipped example
    clusters = _clusters(build(config, shape="original-dst", extproc_tls=True))
    upstream = _max_requests(clusters[ORIGINAL_DST_CLUSTER])
    extproc = _max_requests(clusters[EXTPROC_CLUSTER])
    assert extproc >= upstream, (
        f"ext_proc cluster admits {extproc} concurrent streams, the model servers {upstream}"
    )


def test_envoy_applies_the_1024_default_to_the_extproc_cluster() -> None:
    """The same, read from a running Envoy's admin /clusters (no traffic)."""
    try:
        envoy_binary()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    endpoints = [f"127.0.0.1:{20000 + i}" for i in range(4)]
    config = load_dict({"models": {"m": {"endpoints": endpoints}}})
    with (
        EnvoyProcess(loopback_bootstrap(config, "127.0.0.1:1")) as envoy,
        urllib.request.urlopen(envoy.admin_url + "/clusters?format=json", timeout=5) as r,
    ):
        status = json.loads(r.read())
    limits = {}
    for cluster in status["cluster_statuses"]:
        for t in cluster.get("circuit_breakers", {}).get("thresholds", []):
            if t.get("priority", "DEFAULT") == "DEFAULT":
                limits[cluster["name"]] = int(t["max_requests"])
    assert limits[ORIGINAL_DST_CLUSTER] == 4 * 1024
    assert limits[EXTPROC_CLUSTER] >= limits[ORIGINAL_DST_CLUSTER], limits


def test_the_no_pick_503_reaches_the_client_as_written() -> None:
    """With no static endpoint (on-demand or discovered models only, as deploy/k8s) the
    no-pick route is a direct_response carrying NO_PICK_BODY (code `no_pick`). Envoy runs
    direct responses through the local reply mapper, whose catch-all
    (`!code_details.startsWith('llmgw_')`) rewrites it: the client gets code
    `gateway_error`, type `server_error`, and the intended JSON escaped inside `message`."""
    try:
        envoy_binary()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    lazy = {"launch": {"command": "serve {port}"}, "scaling": {"min": 0, "max": 1}}
    config = load_dict({"models": {"big": lazy}})
    # ext_proc unreachable + fail-open: the request takes the no-pick route.
    with EnvoyProcess(loopback_bootstrap(config, "127.0.0.1:1", fail_open=True)) as envoy:
        r = httpx.post(
            envoy.url + "/v1/chat/completions", json={"model": "big", "messages": []}, timeout=10
        )
    assert r.status_code == 503
    error = r.json()["error"]
    assert error["code"] == "no_pick", r.text
    assert error["type"] == "service_unavailable", r.text


def test_listen_on_the_suggested_any_address_takes_ipv4_clients_too() -> None:
    """`--listen` refuses a host name suggesting "0.0.0.0:8080 or [::]:8080"; but the
    listener is written as a bare `::` socket address, which Envoy binds IPv6-only
    (`ipv4_compat` unset): every IPv4 client (kube-proxy, 127.0.0.1) is refused."""
    try:
        envoy_binary()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    host, port = _bind_address(f"[::]:{free_port()}", "--listen")
    config = load_dict({"models": {"m": {"endpoints": ["127.0.0.1:1"]}}})
    bootstrap = build(config, listen_host=host, listen_port=port, admin_port=free_port())
    with EnvoyProcess(bootstrap):
        with socket.create_connection(("::1", port), timeout=2):
            pass
        with socket.create_connection(("127.0.0.1", port), timeout=2):  # refused today
            pass


def test_fail_open_responses_do_not_carry_the_internal_upstream_header() -> None:
    """`x-llmgw-upstream` (the engine's ip:port, added by Envoy for llmgw) is one of
    INTERNAL_HEADERS and is stripped by llmgw when it sees the response headers; with
    --fail-open and ext_proc down nothing strips it, and clients see the engine's address."""
    try:
        envoy_binary()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    fleet = SimFleet.start_in_thread(replicas=1, model="m1", seed=1, decode_ms=1.0)
    try:
        config = load_dict({"models": {"m1": {"endpoints": [f"127.0.0.1:{fleet.ports[0]}"]}}})
        bootstrap = loopback_bootstrap(config, "127.0.0.1:1", fail_open=True)
        with EnvoyProcess(bootstrap) as envoy:
            r = httpx.post(
                envoy.url + "/v1/chat/completions",
                json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
                timeout=10,
            )
    finally:
        fleet.stop()
    assert r.status_code == 200
    assert UPSTREAM_HEADER not in r.headers, r.headers[UPSTREAM_HEADER]
