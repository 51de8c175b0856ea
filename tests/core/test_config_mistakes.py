"""Config mistakes that loaded without a word and then misbehaved at run time: each is
refused at load now, naming the field and what to write instead (or, where a default can
follow the user's other values, made to work)."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.config import load_dict
from llmgw.discovery import missing_port, slice_addresses
from llmgw.errors import ConfigError

A = "10.0.0.1:8000"


def _launched(launch: dict[str, object]) -> dict[str, object]:
    return {"models": {"big": {"launch": launch, "scaling": {"max": 1}}}}


@pytest.mark.parametrize(
    ("launch", "says"),
    [
        # No {port} and base_port 0: llmgw health-checks a free port it picked and told
        # nobody; the engine, healthy on 8001, failed every start after start_timeout.
        ({"command": "vllm serve big --port 8001"}, "no {port} placeholder"),
        # `port` belongs to the Kubernetes kind: with a command it was silently ignored.
        ({"command": "vllm serve big --port {port}", "port": 8001}, "port: not read"),
        ({"deployment": "big", "base_port": 9000}, "base_port: not read"),
        ({"deployment": "big", "health_path": "/ready"}, "health_path: not read"),
    ],
)
def test_a_launch_that_cannot_work_as_written_is_refused(
    launch: dict[str, object], says: str
) -> None:
    with pytest.raises(ConfigError, match=r"models\.big\.launch") as info:
        load_dict(_launched(launch))
    assert says in str(info.value)


def test_a_command_without_port_runs_at_its_base_port() -> None:
    config = load_dict(_launched({"command": "vllm serve big --port 8001", "base_port": 8001}))
    launch = config.models["big"].launch
    assert launch is not None and launch.base_port == 8001


def _with_kv_events(**kv_events: str) -> dict[str, object]:
    return {"models": {"chat": {"endpoints": [A], "kv_events": kv_events}}}


@pytest.mark.parametrize(
    "template",
    ["tcp://{hots}:5557", "tcp://{host}:{port}", "tcp://{host:5557", "tcp://{host}:5557}"],
    ids=["typo", "unknown-port", "unclosed", "stray-brace"],
)
def test_a_kv_events_address_that_cannot_be_filled_is_refused(template: str) -> None:
    """Filled per endpoint only when its follower ran: a typo raised there every retry, and
    exact prefix matching was silently never on."""
    pytest.importorskip("zmq")
    pytest.importorskip("msgpack")
    with pytest.raises(ConfigError, match=r"models\.chat\.kv_events") as info:
        load_dict(_with_kv_events(endpoint=template))
    assert "{host}" in str(info.value)
    with pytest.raises(ConfigError, match="replay_endpoint"):
        load_dict(_with_kv_events(endpoint="tcp://{host}:5557", replay_endpoint=template))


def test_scrapes_further_apart_than_the_staleness_window() -> None:
    """`scrape: {interval: 5}` with the default staleness of 2 s loaded, and every
    endpoint's metrics were stale for 3 s of every 5: the load-aware scorers ran blind."""
    config = load_dict({"models": {"m": {"endpoints": [A]}}, "scrape": {"interval": 5}})
    scrape = config.scrape
    assert scrape.staleness > scrape.interval * (1 + scrape.jitter) + scrape.timeout
    with pytest.raises(ConfigError, match=r"scrape") as info:
        load_dict({"models": {"m": {"endpoints": [A]}}, "scrape": {"interval": 5, "staleness": 3}})
    assert "staleness" in str(info.value)
    assert load_dict({"models": {"m": {"endpoints": [A]}}}).scrape.staleness == 2.0


def _portless_slice(*ips: str) -> dict[str, Any]:
    # What Kubernetes writes for a headless Service that defines no ports (KubeRay's,
    # JobSet's): `ports: []` on every slice.
    return {
        "addressType": "IPv4",
        "ports": [],
        "endpoints": [
            {"addresses": [ip], "conditions": {"ready": True, "serving": True}} for ip in ips
        ],
    }


def test_a_headless_service_without_ports_is_routed_at_the_pod_port_number() -> None:
    """The pod port number is the only word on where its engines listen; given, every
    endpoint was dropped, and nothing said why."""
    slices = [_portless_slice("10.0.0.1", "10.0.0.2")]
    assert slice_addresses(slices, 30000) == ["10.0.0.1:30000", "10.0.0.2:30000"]
    assert slice_addresses(slices, None) == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert missing_port(slices, 30000) is None
    # A port name cannot be found where none is listed: said so, not an empty set in silence.
    said = missing_port(slices, "http")
    assert said is not None and "headless" in said
