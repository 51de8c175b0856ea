"""`llmgw envoy-config`: both shapes validate with the real Envoy; committed files match."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmgw.config import load_dict, load_file
from llmgw.extproc.envoyconfig import SHAPES, build, duration, main, render
from llmgw.extproc.envoylimits import DISCOVERED_ENDPOINTS, PER_ENDPOINT_REQUESTS
from llmgw.extproc.grpchealth import PROCESS_SERVICE
from llmgw.lifecycle import INTERNAL_HEADERS
from llmgw.testing.extproc import BootstrapOptions, loopback_bootstrap, make_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "envoy" / "llmgw.yaml"


def envoy() -> str:
    found = shutil.which("envoy") or str(Path(sys.executable).with_name("envoy"))
    if not os.access(found, os.X_OK):
        pytest.skip("envoy is not installed")
    return found


@pytest.mark.parametrize("shape", SHAPES)
def test_generated_config_passes_envoy_validate(shape: str, tmp_path: Path) -> None:
    out = tmp_path / f"{shape}.yaml"
    assert main(["--config", str(EXAMPLE), "--shape", shape, "--out", str(out)]) == 0
    result = subprocess.run(
        [envoy(), "--mode", "validate", "-c", str(out), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout


@pytest.mark.parametrize("shape", SHAPES)
def test_committed_envoy_files_are_up_to_date(shape: str) -> None:
    expected = render(build(load_file(EXAMPLE), shape=shape, extproc_tls=True), EXAMPLE.name)
    assert (ROOT / "envoy" / f"{shape}.yaml").read_text() == expected, (
        f"regenerate: llmgw envoy-config --config envoy/llmgw.yaml --shape {shape} "
        f"--out envoy/{shape}.yaml"
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_client_copies_of_llmgws_own_headers_are_stripped_before_anything(shape: str) -> None:
    """Only the destination header was: a client's `x-llmgw-decision` or `x-llmgw-upstream`
    reached the engine, where `INTERNAL_HEADERS` says they are dropped (found by a review
    helper)."""
    bootstrap = build(load_file(EXAMPLE), shape=shape)
    (listener,) = bootstrap["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (early,) = hcm["early_header_mutation_extensions"]
    removed = {m["remove"] for m in early["typed_config"]["mutations"]}
    assert removed == INTERNAL_HEADERS


def test_override_host_reads_metadata_list_first_and_retries_429() -> None:
    bootstrap = build(load_file(EXAMPLE), shape="override-host")
    text = yaml.safe_dump(bootstrap)
    pool = next(c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "llm-pool")
    policy = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    sources = policy["typed_config"]["override_host_sources"]
    assert sources[0] == {
        "metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}
    }
    assert sources[1] == {"header": "x-gateway-destination-endpoint"}
    assert "retriable_status_codes" in text and "429" in text
    assert len(pool["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 4
    # Not Envoy's default of 3 concurrent retries a cluster: past it, a failing replica's
    # 5xx reaches the client instead of a fallback. A 100 % budget never overflows.
    (threshold,) = pool["circuit_breakers"]["thresholds"]
    assert threshold["retry_budget"]["budget_percent"] == {"value": 100.0}


@pytest.mark.parametrize("shape", SHAPES)
def test_both_shapes_size_breakers_to_the_fleet_and_eject_outliers(shape: str) -> None:
    bootstrap = build(load_file(EXAMPLE), shape=shape)
    upstreams = [
        c for c in bootstrap["static_resources"]["clusters"] if c["name"] != "llmgw-extproc"
    ]
    assert upstreams
    for cluster in upstreams:
        (threshold,) = cluster["circuit_breakers"]["thresholds"]
        # Envoy's default 1,024 requests a cluster is below 4 replicas x 256 long streams.
        assert threshold["max_requests"] == threshold["max_pending_requests"] == 4 * 1024
        assert threshold["retry_budget"]["min_retry_concurrency"] >= 4
        assert cluster["outlier_detection"]["consecutive_5xx"] >= 1


@pytest.mark.parametrize("shape", SHAPES)
def test_limits_are_checked_before_ext_proc_and_grpc_fits_the_body(shape: str) -> None:
    config = load_file(EXAMPLE)
    bootstrap = build(config, shape=shape)
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = hcm["typed_config"]["http_filters"]
    names = [f["name"] for f in filters]
    assert names == [
        "envoy.filters.http.lua",
        "envoy.filters.http.buffer",
        "envoy.filters.http.header_mutation",  # drops the upstream header ext_proc did not
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.router",
    ]
    limit = config.limits.max_body_bytes
    assert filters[1]["typed_config"]["max_request_bytes"] == limit
    grpc = filters[3]["typed_config"]["grpc_service"]["envoy_grpc"]
    assert grpc["max_receive_message_length"] > limit
    mappers = hcm["typed_config"]["local_reply_config"]["mappers"]
    mapped = {
        m["filter"]["status_code_filter"]["comparison"]["value"]["default_value"]
        for m in mappers
        if "status_code_filter" in m["filter"]
    }
    assert mapped == {408, 413, 431}  # never llmgw's own statuses (their JSON is kept)
    # The rest pick Envoy's own replies by their details, never ext_proc's (`llmgw_*`).
    expressions = [
        m["filter"]["extension_filter"]["typed_config"]["expression"]
        for m in mappers
        if "extension_filter" in m["filter"]
    ]
    assert expressions[-1] == (  # nor llmgw's direct responses (the no-pick 503)
        "!response.code_details.startsWith('llmgw_') && response.code_details != 'direct_response'"
    )
    assert hcm["typed_config"]["request_headers_timeout"] == "60s"


@pytest.mark.parametrize("shape", SHAPES)
def test_extproc_tls_adds_a_tls_socket_and_the_command_defaults_to_it(
    shape: str, tmp_path: Path
) -> None:
    plain = build(load_file(EXAMPLE), shape=shape)
    clusters = {c["name"]: c for c in plain["static_resources"]["clusters"]}
    assert "transport_socket" not in clusters["llmgw-extproc"]
    out = tmp_path / "envoy.yaml"
    assert main(["--config", str(EXAMPLE), "--shape", shape, "--out", str(out)]) == 0
    generated = yaml.safe_load(out.read_text())
    clusters = {c["name"]: c for c in generated["static_resources"]["clusters"]}
    socket = clusters["llmgw-extproc"]["transport_socket"]
    assert socket["name"] == "envoy.transport_sockets.tls"
    assert socket["typed_config"]["common_tls_context"]["alpn_protocols"] == ["h2"]
    argv = ["--config", str(EXAMPLE), "--shape", shape, "--extproc-plaintext", "--out", str(out)]
    assert main(argv) == 0
    generated = yaml.safe_load(out.read_text())
    clusters = {c["name"]: c for c in generated["static_resources"]["clusters"]}
    assert "transport_socket" not in clusters["llmgw-extproc"]


def test_several_extproc_replicas_are_one_cluster_envoy_balances_and_bad_ones_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def extproc_cluster(address: str) -> dict[str, Any]:
        bootstrap = build(load_file(EXAMPLE), shape="override-host", extproc_address=address)
        clusters: list[dict[str, Any]] = bootstrap["static_resources"]["clusters"]
        (cluster,) = (c for c in clusters if c["name"] == "llmgw-extproc")
        return cluster

    def hosts(cluster: dict[str, Any]) -> list[tuple[str, int]]:
        (group,) = cluster["load_assignment"]["endpoints"]
        sockets = [e["endpoint"]["address"]["socket_address"] for e in group["lb_endpoints"]]
        return [(s["address"], s["port_value"]) for s in sockets]

    both = extproc_cluster("10.0.0.1:9002, 10.0.0.2:9012,10.0.0.1:09002")
    assert hosts(both) == [("10.0.0.1", 9002), ("10.0.0.2", 9012)]  # duplicates once
    assert both["type"] == "STATIC" and "lb_policy" not in both  # round robin per stream
    (check,) = both["health_checks"]  # the service each replica's grpc.health.v1 serves
    assert check["grpc_health_check"]["service_name"] == PROCESS_SERVICE
    named = extproc_cluster("llmgw-0.llmgw:9002,[::1]:9002")
    assert hosts(named) == [("llmgw-0.llmgw", 9002), ("::1", 9002)]
    assert named["type"] == "STRICT_DNS"
    bad_ones = ["10.0.0.1", "10.0.0.1:9002,:9002", "10.0.0.1:port", "10.0.0.1:70000", ","]
    bad_ones += ["::1", "fe80::1", "10.0.0.1 :9002", "h:\u00b2", "[::1:9002", "[zz::]:1"]
    for bad in bad_ones:
        with pytest.raises(ValueError, match=r"ext_proc address .*host:port"):
            extproc_cluster(bad)
    out = tmp_path / "envoy.yaml"
    argv = ["--config", str(EXAMPLE), "--shape", "override-host", "--out", str(out)]
    assert main([*argv, "--extproc", "127.0.0.1:9002,127.0.0.1:9003"]) == 0
    generated = yaml.safe_load(out.read_text())
    clusters = generated["static_resources"]["clusters"]
    (cluster,) = (c for c in clusters if c["name"] == "llmgw-extproc")
    assert hosts(cluster) == [("127.0.0.1", 9002), ("127.0.0.1", 9003)]
    assert main([*argv, "--extproc", "127.0.0.1"]) == 2
    assert "ext_proc address '127.0.0.1': give host:port" in capsys.readouterr().err


def test_original_dst_uses_the_header_and_has_a_fail_open_default() -> None:
    bootstrap = build(load_file(EXAMPLE), shape="original-dst", fail_open=True)
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    assert clusters["llm-original-dst"]["original_dst_lb_config"] == {
        "use_http_header": True,
        "http_header_name": "x-gateway-destination-endpoint",
    }
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    (ext_proc,) = (
        f["typed_config"]
        for f in hcm["typed_config"]["http_filters"]
        if f["name"] == "envoy.filters.http.ext_proc"
    )
    assert ext_proc["failure_mode_allow"] is True
    assert ext_proc["allow_mode_override"] is True
    assert ext_proc["metadata_options"]["receiving_namespaces"]["untyped"] == ["envoy.lb"]
    routes = hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    assert routes[-1]["route"]["cluster"] == "llm-pool"


def test_bad_input_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: {}\n")
    assert main(["--config", str(bad)]) == 2
    assert "models" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "config", "phrase"),
    [
        (["--listen", "localhost:8080"], {}, "--listen 'localhost:8080': give an IP address"),
        (["--listen", "0.0.0.0:99999"], {}, "a port in 1..65535"),
        (["--admin", ":9901"], {}, "--admin ':9901'"),
        (["--route-timeout", "-1"], {}, "--route-timeout: -1.0 is not a duration"),
        (["--message-timeout", "7200"], {}, "--message-timeout 7200: give seconds in (0, 3600]"),
        ([], {"limits": {"max_body_bytes": 5_000_000_000}}, "Envoy's buffer limits are 32-bit"),
        (  # Envoy's override host never matched a name: every request failed (503)
            ["--shape", "override-host"],
            {"models": {"m": {"endpoints": ["vllm-0.models:8000"]}}},
            "endpoint vllm-0.models:8000: behind Envoy, endpoints must be IP addresses",
        ),
    ],
)
def test_input_envoy_would_refuse_is_refused_here(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    config: dict[str, Any],
    phrase: str,
) -> None:
    """Each of these wrote a config Envoy then refused to load (exit 0 here)."""
    path = tmp_path / "llmgw.yaml"
    path.write_text(yaml.safe_dump({"models": {"m": {"endpoints": ["127.0.0.1:8000"]}}, **config}))
    assert main(["--config", str(path), *extra]) == 2
    assert phrase in capsys.readouterr().err


def test_an_on_demand_models_launch_host_name_is_refused_as_a_static_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`launch.host: localhost` gave the started model the endpoint localhost:PORT, which
    Envoy never reached (every request a 503); a static `vllm-a:8000` was refused already
    (found by a review helper)."""
    launch = {"command": "vllm serve m --port {port}", "host": "localhost"}
    lazy = {"launch": launch, "scaling": {"min": 0, "max": 1}}
    path = tmp_path / "llmgw.yaml"
    path.write_text(yaml.safe_dump({"models": {"lazy": lazy}}))
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "models.lazy.launch.host 'localhost': behind Envoy, endpoints must be IP" in err
    by_ip = load_dict({"models": {"lazy": {**lazy, "launch": {**launch, "host": "::1"}}}})
    assert build(by_ip)["static_resources"]  # an IP (here IPv6) launch host is fine


def test_large_and_small_timeouts_are_written_as_envoy_parses_them(tmp_path: Path) -> None:
    """`:g` wrote 1e+06s and 1e-05s: Envoy wants a plain decimal ending in a single s."""
    config = load_dict(
        {"models": {"m": {"endpoints": ["127.0.0.1:8000"]}},
         "limits": {"upstream_read_timeout": 1_000_000, "client_header_timeout": 10_000_000}}
    )  # fmt: skip
    out = tmp_path / "envoy.yaml"
    out.write_text(render(build(config, message_timeout=0.00001, route_timeout=1e7), "x"))
    text = out.read_text()
    assert "1000000s" in text and "10000000s" in text and "0.00001s" in text and "e+" not in text
    result = subprocess.run(
        [envoy(), "--mode", "validate", "-c", str(out), "--disable-hot-restart"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_out_path_that_cannot_be_written_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--config", str(EXAMPLE), "--out", str(tmp_path)]) == 2
    assert "cannot write --out" in capsys.readouterr().err


def test_message_timeout_outlasts_activation_wait_when_models_start_on_demand() -> None:
    static = load_dict({"models": {"m": {"endpoints": ["127.0.0.1:1"]}}})
    lazy = load_dict(
        {
            "activation_timeout": 45,
            "models": {
                "m": {"endpoints": ["127.0.0.1:1"]},
                "big": {"launch": {"command": "serve {port}"}, "scaling": {"min": 0, "max": 1}},
            },
        }
    )

    def timeout_of(bootstrap: dict[str, object]) -> str:
        text = str(bootstrap)
        return text.split("'message_timeout': '")[1].split("'", maxsplit=1)[0]

    assert timeout_of(build(static)) == "2s"
    assert timeout_of(build(lazy)) == "50s"
    assert timeout_of(build(lazy, message_timeout=3)) == "3s"


def test_original_dst_refuses_a_destination_list_it_cannot_parse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    listed = tmp_path / "listed.yaml"
    listed.write_text(EXAMPLE.read_text() + "destination_fallbacks: true\n")
    with pytest.raises(ValueError, match="destination_fallbacks"):
        build(load_file(listed), shape="original-dst")
    assert main(["--config", str(listed), "--shape", "original-dst"]) == 2
    err = capsys.readouterr().err
    assert "destination_fallbacks" in err and "override-host" in err
    assert main(["--config", str(listed), "--shape", "override-host"]) == 0
    assert capsys.readouterr().err == ""


def test_override_host_without_the_destination_list_says_retries_skip_llmgws_fallbacks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--config", str(EXAMPLE), "--shape", "override-host"]) == 0
    err = capsys.readouterr().err
    assert "destination_fallbacks: true" in err
    assert main(["--config", str(EXAMPLE), "--shape", "original-dst"]) == 0
    assert capsys.readouterr().err == ""


def test_loopback_bootstrap_is_build_on_loopback_with_free_ports_and_passes_options() -> None:
    config = make_config(destination_fallbacks=False)
    options: BootstrapOptions = {"shape": "original-dst", "fail_open": True, "message_timeout": 7.0}
    got = loopback_bootstrap(config, "127.0.0.1:4321", **options)
    listener = got["static_resources"]["listeners"][0]["address"]["socket_address"]
    admin = got["admin"]["address"]["socket_address"]
    assert listener["address"] == "127.0.0.1" and admin["address"] == "127.0.0.1"
    assert listener["port_value"] != admin["port_value"]
    assert got == build(
        config,
        listen_host="127.0.0.1",
        listen_port=listener["port_value"],
        admin_port=admin["port_value"],
        extproc_address="127.0.0.1:4321",
        **options,
    )
    assert got != build(
        config,
        listen_host="127.0.0.1",
        listen_port=listener["port_value"],
        admin_port=admin["port_value"],
        extproc_address="127.0.0.1:4321",
    )


def test_model_server_clusters_close_idle_connections_and_refuse_a_sub_ms_limit() -> None:
    """Envoy reads a 0 s idle timeout as never: a limit under 1 ms would have written one."""
    for shape in SHAPES:
        bootstrap = build(load_file(EXAMPLE), shape=shape)
        for cluster in bootstrap["static_resources"]["clusters"][1:]:  # after ext_proc's
            options = cluster["typed_extension_protocol_options"]
            (http,) = options.values()
            assert http["common_http_protocol_options"] == {"idle_timeout": "4s"}
            assert http["explicit_http_config"] == {"http_protocol_options": {}}  # HTTP/1.1
    config = load_file(EXAMPLE)
    tiny = config.model_copy(
        update={"limits": config.limits.model_copy(update={"upstream_idle_timeout": 0.0005})}
    )
    with pytest.raises(ValueError, match=r"give at least 0\.001 s"):
        build(tiny)


def _hcm(bootstrap: dict[str, Any]) -> dict[str, Any]:
    hcm: dict[str, Any] = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0][
        "filters"
    ][0]["typed_config"]
    return hcm


def _routes(bootstrap: dict[str, Any]) -> list[dict[str, Any]]:
    routes: list[dict[str, Any]] = _hcm(bootstrap)["route_config"]["virtual_hosts"][0]["routes"]
    return routes


@pytest.mark.parametrize("retries", [0, 1, 2])
def test_override_host_lets_each_try_stay_silent_for_upstream_read_timeout(retries: int) -> None:
    """override-host set upstream_read_timeout only as the retry policy's per-try idle
    timeout: with no retries (`--retries 0`) nothing bounded a hung replica, and with retries
    Envoy's default stream idle timeout (300 s) cut a silent answer before the 600 s llmgw
    allows (found by a review helper)."""
    config = load_file(EXAMPLE)
    assert config.limits.upstream_read_timeout == 600
    bootstrap = build(config, shape="override-host", retries=retries)
    (route,) = (r["route"] for r in _routes(bootstrap))
    every_try = f"{(retries + 1) * 600}s"  # the route never ends a try that may be retried
    assert route["idle_timeout"] == _hcm(bootstrap)["stream_idle_timeout"] == every_try
    if retries:
        assert route["retry_policy"]["per_try_idle_timeout"] == "600s"
    else:
        assert "retry_policy" not in route


def test_on_demand_models_get_idle_limits_that_outlast_the_start_wait() -> None:
    """message_timeout was raised to activation_timeout + 5 for on-demand models, but the
    stream was idle meanwhile and the route's idle timeout (upstream_read_timeout), or Envoy's
    300 s default on the 503 route when every model starts on demand, ended the wait first
    (found by a review helper)."""
    lazy = {"launch": {"command": "serve {port}"}, "scaling": {"min": 0, "max": 1}}
    mixed = load_dict(
        {
            "activation_timeout": 900,
            "models": {"m": {"endpoints": ["127.0.0.1:1"]}, "big": lazy},
        }
    )
    bootstrap = build(mixed)
    # The start's wait (message_timeout 905 s), then the engine's silence (600 s).
    assert [r["route"]["idle_timeout"] for r in _routes(bootstrap)] == ["1505s", "1505s"]
    assert _hcm(bootstrap)["stream_idle_timeout"] == "1505s"
    only = load_dict({"activation_timeout": 900, "models": {"big": lazy}})
    bootstrap = build(only)
    arrival = _routes(bootstrap)[-1]
    assert "direct_response" in arrival  # no idle_timeout of its own: the HCM's applies
    assert _hcm(bootstrap)["stream_idle_timeout"] == "1505s"
    assert build(only, message_timeout=30)["static_resources"] != bootstrap["static_resources"]
    assert _hcm(build(only, message_timeout=30))["stream_idle_timeout"] == "630s"
    static = build(load_dict({"models": {"m": {"endpoints": ["127.0.0.1:1"]}}}))
    assert [r["route"]["idle_timeout"] for r in _routes(static)] == ["600s", "600s"]


@pytest.mark.parametrize(
    "other",
    [
        {"launch": {"command": "serve {port}"}, "scaling": {"min": 0, "max": 1}},
        {"discovery": {"service": {"namespace": "llmgw", "name": "vllm"}}},
    ],
    ids=["on-demand", "discovered"],
)
def test_override_host_refuses_a_model_whose_endpoints_are_not_in_its_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], other: dict[str, Any]
) -> None:
    """override-host lists only the static endpoints: llmgw's pick for an on-demand or
    discovered model beside a static one was no host of the cluster, and Envoy sent the
    request to the static model's engine (404, wrong model) (found by a review helper)."""
    path = tmp_path / "llmgw.yaml"
    models = {"m": {"endpoints": ["127.0.0.1:8000"]}, "other": other}
    path.write_text(yaml.safe_dump({"models": models}))
    assert main(["--config", str(path), "--shape", "override-host"]) == 2
    err = capsys.readouterr().err
    assert "model other: shape 'override-host' lists only the static endpoints" in err
    assert "Use shape original-dst" in err
    out = str(tmp_path / "envoy.yaml")
    assert main(["--config", str(path), "--shape", "original-dst", "--out", out]) == 0
    assert capsys.readouterr().err == ""


def test_breakers_count_on_demand_and_discovered_endpoints() -> None:
    """The breakers were sized from the static endpoints alone: an on-demand or discovered
    fleet (deploy/k8s) had one endpoint's 1,024 requests for every model together, the
    1,025th a 503 overflow (found by a review helper)."""

    def thresholds(config_dict: dict[str, Any]) -> dict[str, dict[str, Any]]:
        bootstrap = build(load_dict(config_dict))
        clusters = bootstrap["static_resources"]["clusters"][1:]  # after ext_proc's
        return {c["name"]: c["circuit_breakers"]["thresholds"][0] for c in clusters}

    lazy = {"launch": {"deployment": "big"}, "scaling": {"min": 0, "max": 8}}
    got = thresholds({"models": {"m": {"endpoints": ["127.0.0.1:1"]}, "big": lazy}})
    assert got["llm-original-dst"]["max_requests"] == 9 * PER_ENDPOINT_REQUESTS
    assert got["llm-original-dst"]["retry_budget"]["min_retry_concurrency"] == 9
    assert got["llm-pool"]["max_requests"] == PER_ENDPOINT_REQUESTS  # its one host
    shipped = build(load_file(ROOT / "deploy" / "k8s" / "llmgw-config.yaml"))
    (cluster,) = shipped["static_resources"]["clusters"][1:]
    assert cluster["name"] == "llm-original-dst"
    discovered = 2 * DISCOVERED_ENDPOINTS * PER_ENDPOINT_REQUESTS  # two discovered models
    assert cluster["circuit_breakers"]["thresholds"][0]["max_requests"] == discovered


@pytest.mark.parametrize("body_mode", ["gie", "envoy-gateway", "override", "buffered"])
def test_streamed_body_modes_say_message_timeout_and_fail_open_do_not_apply(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, body_mode: str
) -> None:
    """Envoy starts no message_timeout timer for a FULL_DUPLEX_STREAMED body: a stalled
    ext_proc held every request until the idle timeout, fail-open or not, and neither the
    command nor the README said so (found by a review helper)."""
    out = str(tmp_path / "envoy.yaml")
    assert main(["--config", str(EXAMPLE), "--body-mode", body_mode, "--out", out]) == 0
    noted = "Envoy starts no message_timeout timer" in capsys.readouterr().err
    assert noted == (body_mode in ("gie", "envoy-gateway"))


@pytest.mark.parametrize("fail_open", [True, False])
@pytest.mark.parametrize("body_mode", ["gie", "envoy-gateway", "override", "buffered"])
def test_fail_open_with_a_streamed_body_mode_is_noted_as_having_no_effect(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, body_mode: str, fail_open: bool
) -> None:
    """With a FULL_DUPLEX_STREAMED body Envoy answers 500 router_unavailable while ext_proc is
    down, fail-open or not; the command and the README said Envoy still routes (found by a
    review helper)."""
    out = str(tmp_path / "envoy.yaml")
    flag = "--fail-open" if fail_open else "--fail-closed"
    assert main(["--config", str(EXAMPLE), "--body-mode", body_mode, flag, "--out", out]) == 0
    noted = "--fail-open has no effect" in capsys.readouterr().err
    assert noted == (fail_open and body_mode in ("gie", "envoy-gateway"))


def test_negative_retries_and_sub_nanosecond_durations_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--retries -1` wrote `num_retries: -1` (Envoy refuses it) and a duration under 1 ns
    was written as 0 s, which Envoy reads as no limit (found by a review helper)."""
    with pytest.raises(SystemExit) as exited:
        main(["--config", str(EXAMPLE), "--shape", "override-host", "--retries", "-1"])
    assert exited.value.code == 2
    assert "--retries: '-1': give a whole number, 0 or more" in capsys.readouterr().err
    with pytest.raises(ValueError, match="under Envoy's resolution of 1 ns"):
        build(load_file(EXAMPLE), message_timeout=1e-10)
    with pytest.raises(ValueError, match="--retries -1: give 0 or more"):
        build(load_file(EXAMPLE), shape="override-host", retries=-1)
    assert duration(0, "x") == "0s" and duration(1e-9, "x") == "0.000000001s"


def test_override_host_takes_a_launched_model_that_is_switched_off() -> None:
    """`scaling.max: 0`: no endpoint ever, llmgw answers its requests itself, so none can
    reach another model's engine; the refusal of launched models took it too. Found by a
    review helper."""
    config = load_dict(
        {
            "models": {
                "chat": {"endpoints": ["10.0.0.1:8000", "10.0.0.2:8000"]},
                "big": {
                    "launch": {"command": "vllm serve big --port {port}"},
                    "scaling": {"max": 0},
                },
            }
        }
    )
    build(config, shape="override-host")
