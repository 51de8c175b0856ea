"""Discovery config (path-named errors) and the pure rules from API objects to addresses."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.config import ModelMode, load_dict, model_mode
from llmgw.discovery import missing_port, pod_addresses, pool_selection, slice_addresses
from llmgw.errors import ConfigError
from llmgw.gateway import restart_only_changes


def discovered(**source: Any) -> dict[str, Any]:
    return {"models": {"chat": {"discovery": source}}}


def problems_of(data: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_dict(data)
    return info.value.problems


def test_each_source_kind_loads_and_the_model_is_routed_always() -> None:
    for source in (
        {"service": {"namespace": "models", "name": "vllm-chat", "port": "http"}},
        {"service": {"name": "vllm-chat", "port": 8000}},
        {"inference_pool": {"namespace": "models", "name": "chat-pool"}},
        {"pods": {"namespace": "models", "selector": {"app": "vllm"}, "port": 8000}},
    ):
        spec = load_dict(discovered(**source)).models["chat"]
        assert spec.discovery is not None and not spec.endpoints
        assert model_mode(spec) is ModelMode.STATIC


INVALID: list[tuple[str, Any, str, str]] = [
    ("no-source", discovered(), "models.chat.discovery.service", "exactly one of"),
    (
        "two-sources",
        discovered(service={"name": "a"}, pods={"selector": {"a": "b"}, "port": 1}),
        "models.chat.discovery.service",
        "got service, pods",
    ),
    (
        "bad-namespace",
        discovered(service={"namespace": "Models_", "name": "a"}),
        "models.chat.discovery.service.namespace",
        "RFC 1123",
    ),
    (
        "bad-service-name",
        discovered(service={"name": "vLLM chat"}),
        "models.chat.discovery.service.name",
        "object name",
    ),
    (
        "port-out-of-range",
        discovered(service={"name": "a", "port": 70000}),
        "models.chat.discovery.service.port",
        "1..65535",
    ),
    (
        "pool-without-name",
        discovered(inference_pool={"namespace": "models"}),
        "models.chat.discovery.inference_pool.name",
        "required field is missing",
    ),
    (
        "empty-selector",
        discovered(pods={"selector": {}, "port": 8000}),
        "models.chat.discovery.pods.selector",
        "at least 1",
    ),
    (
        "bad-label",
        discovered(pods={"selector": {"app": "-x"}, "port": 8000}),
        "models.chat.discovery.pods.selector.app",
        "label value",
    ),
    (
        "unknown-field",
        discovered(service={"name": "a", "selector": {}}),
        "models.chat.discovery.service.selector",
        "unknown field",
    ),
    (
        "with-endpoints",
        {
            "models": {
                "chat": {"endpoints": ["10.0.0.1:80"], "discovery": {"service": {"name": "a"}}}
            }
        },
        "models.chat.discovery",
        "not both",
    ),
]


@pytest.mark.parametrize(
    ("data", "path", "phrase"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID]
)
def test_invalid_discovery_names_the_path(data: Any, path: str, phrase: str) -> None:
    problems = problems_of(data)
    assert any(p.startswith(f"{path}: ") and phrase in p for p in problems), problems


def test_changing_a_discovery_source_is_a_restart_only_change() -> None:
    old = load_dict(discovered(service={"name": "a"}))
    new = load_dict(discovered(service={"name": "b"}))
    assert restart_only_changes(old, new) == [
        "models.chat.discovery: where a model's endpoints are discovered changes only on restart"
    ]
    assert restart_only_changes(old, old) == []


def _slice(*endpoints: dict[str, Any], ports: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "endpoints": list(endpoints),
        "ports": ports if ports is not None else [{"name": "http", "port": 8000}],
    }


def _ep(ip: str, **conditions: bool | None) -> dict[str, Any]:
    return {"addresses": [ip], "conditions": conditions}


# (case, slices, configured port, addresses that take new requests)
SLICES: list[tuple[str, list[dict[str, Any]], str | int | None, list[str]]] = [
    ("ready", [_slice(_ep("10.0.0.1", ready=True))], None, ["10.0.0.1:8000"]),
    ("nil-ready-counts-as-ready", [_slice(_ep("10.0.0.1", ready=None))], None, ["10.0.0.1:8000"]),
    ("not-ready", [_slice(_ep("10.0.0.1", ready=False))], None, []),
    (
        "terminating-but-serving",
        [_slice(_ep("10.0.0.1", ready=None, serving=True, terminating=True))],
        None,
        [],
    ),
    (
        "published-not-ready-not-serving",  # publishNotReadyAddresses: `ready` always true
        [_slice(_ep("10.0.0.1", ready=True, serving=False, terminating=False))],
        None,
        [],
    ),
    (
        "nil-serving-counts-as-serving",
        [_slice(_ep("10.0.0.1", serving=None))],
        None,
        ["10.0.0.1:8000"],
    ),
    ("ipv6", [_slice(_ep("fd00::1", ready=True))], None, ["[fd00::1]:8000"]),
    (
        "port-by-name",
        [
            _slice(
                _ep("10.0.0.1"), ports=[{"name": "metrics", "port": 9}, {"name": "api", "port": 81}]
            )
        ],
        "api",
        ["10.0.0.1:81"],
    ),
    (
        "port-by-number",
        [_slice(_ep("10.0.0.1"), ports=[{"name": "metrics", "port": 9}, {"port": 81}])],
        81,
        ["10.0.0.1:81"],
    ),
    (
        "slice-without-the-named-port-is-skipped",
        [_slice(_ep("10.0.0.1"), ports=[{"name": "metrics", "port": 9}])],
        "api",
        [],
    ),
    (
        "http-port-by-default",
        [
            _slice(
                _ep("10.0.0.1"),
                ports=[{"name": "metrics", "port": 9}, {"name": "http", "port": 80}],
            )
        ],
        None,
        ["10.0.0.1:80"],
    ),
]


@pytest.mark.parametrize(
    ("slices", "port", "expected"), [c[1:] for c in SLICES], ids=[c[0] for c in SLICES]
)
def test_slice_addresses_keep_only_ready_endpoints_that_are_not_terminating(
    slices: list[dict[str, Any]], port: str | int | None, expected: list[str]
) -> None:
    assert slice_addresses(slices, port) == expected


def test_a_not_ready_pod_of_a_service_publishing_not_ready_addresses_is_not_routed() -> None:
    """With `publishNotReadyAddresses` (a StatefulSet's headless Service, LWS) every endpoint
    is `ready` and the pod's readiness is in `serving` alone: a pod failing its readiness
    probe was routed, by discovery and by on-demand Kubernetes (found by a review helper)."""
    from llmgw.runtime.controlplanes.k8s import ready_addresses  # noqa: PLC0415

    slice_ = _slice(
        _ep("10.0.0.1", ready=True, serving=True, terminating=False),
        _ep("10.0.0.2", ready=True, serving=False, terminating=False),
    )
    assert slice_addresses([slice_], "http") == ["10.0.0.1:8000"]
    assert ready_addresses([slice_], 8000) == ["10.0.0.1:8000"]


def _stack(family: str, ip: str, pod: str) -> dict[str, Any]:
    return {
        "addressType": family,
        "ports": [{"name": "http", "port": 8000}],
        "endpoints": [{"addresses": [ip], "targetRef": {"kind": "Pod", "name": pod}}],
    }


def test_a_dual_stack_service_lists_each_pod_once_at_its_ipv4_address() -> None:
    """Two slices per pod (IPv4, IPv6) made each engine two endpoints: scraped twice, its
    load split between the two."""
    slices = [_stack("IPv6", "fd00::5", "p5"), _stack("IPv4", "10.1.0.5", "p5"),
              _stack("IPv6", "fd00::6", "p6")]  # fmt: skip
    assert slice_addresses(slices, "http") == ["10.1.0.5:8000", "[fd00::6]:8000"]


@pytest.mark.parametrize(
    ("port", "missing"), [("http", None), (8000, None), ("api", "http:8000"), (80, "http:8000")]
)
def test_a_port_no_slice_has_is_named_with_the_ports_they_have(
    port: str | int, missing: str | None
) -> None:
    slices = [_stack("IPv4", "10.1.0.5", "p5"), {"addressType": "IPv4", "endpoints": []}]
    assert missing_port(slices, port) == missing


def test_on_demand_kubernetes_routes_to_launch_port_where_the_service_lists_it() -> None:
    """A Service listing a metrics port first sent every request to the metrics port."""
    from llmgw.runtime.controlplanes.k8s import ready_addresses  # noqa: PLC0415

    slice_ = {
        "ports": [{"name": "metrics", "port": 9090}, {"name": "api", "port": 8000}],
        "endpoints": [{"addresses": ["10.1.0.5"]}],
    }
    assert ready_addresses([slice_], 8000) == ["10.1.0.5:8000"]
    assert ready_addresses([slice_], 7000) == ["10.1.0.5:9090"]  # not listed: the old rule


def _pod(
    ip: str | None, *, ready: str = "True", phase: str = "Running", deleting: bool = False
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": f"p-{ip}"}
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": metadata,
        "status": {"phase": phase, "podIP": ip, "conditions": [{"type": "Ready", "status": ready}]},
    }


def test_pod_addresses_take_ready_running_pods_not_being_deleted_at_every_port() -> None:
    pods = [
        _pod("10.0.0.1"),
        _pod("10.0.0.2", ready="False"),
        _pod("10.0.0.3", deleting=True),
        _pod("10.0.0.4", phase="Pending"),
        _pod(None),
    ]
    assert pod_addresses(pods, [8000, 8001]) == ["10.0.0.1:8000", "10.0.0.1:8001"]


def test_pool_selection_reads_match_labels_and_target_ports_or_names_the_missing_field() -> None:
    pool = {
        "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 8000}]}
    }
    assert pool_selection(pool) == ({"app": "vllm"}, [8000])
    with pytest.raises(ValueError, match=r"spec\.targetPorts"):
        pool_selection({"spec": {"selector": {"matchLabels": {"app": "vllm"}}}})
    with pytest.raises(ValueError, match=r"spec\.selector\.matchLabels"):
        pool_selection({"spec": {"targetPorts": [{"number": 1}]}})
