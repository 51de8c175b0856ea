"""Real Envoy with the gateways' own ext_proc processing modes (GIE reference, Envoy
Gateway, buffered): llmgw is a drop-in endpoint picker for each."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from llmgw.sim import ThreadedFleet
from llmgw.testing.extproc import (
    EnvoyProcess,
    ExtProcThread,
    StackFactory,
    fleet_config,
    loopback_bootstrap,
    wait_for,
)

pytestmark = pytest.mark.e2e

MODES = ("gie", "envoy-gateway", "buffered")


def _body(stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m1",
        "messages": [{"role": "user", "content": "hello there"}],
        "stream": stream,
        **extra,
    }


def _outcomes(s: Any) -> str:
    text: str = s.extproc.server.telemetry.render()[0].decode()
    return text


@pytest.mark.parametrize("mode", MODES)
def test_chat_and_completions_route_in_the_gateways_processing_mode(
    stack: StackFactory, mode: str
) -> None:
    s = stack("original-dst", body_mode=mode)
    with httpx.Client(timeout=10) as client:
        chat = client.post(s.url + "/v1/chat/completions", json=_body())
        assert chat.status_code == 200, chat.text
        assert chat.json()["object"] == "chat.completion"
        # The body reached the engine unchanged (it answered the model it was sent).
        assert chat.json()["model"] == "m1"
        completion = client.post(
            s.url + "/v1/completions", json={"model": "m1", "prompt": "once upon", "max_tokens": 3}
        )
        assert completion.status_code == 200, completion.text
        assert completion.json()["object"] == "text_completion"
        with client.stream("POST", s.url + "/v1/chat/completions", json=_body(True)) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert all(json.loads(x[6:])["object"] == "chat.completion.chunk" for x in lines[:-1])
    wait_for(lambda: sum(s.extproc.inflight().values()) == 0, 5, "leases released")


@pytest.mark.parametrize("mode", MODES)
def test_a_large_body_streams_through_unchanged(stack: StackFactory, mode: str) -> None:
    # ~280 KB: Envoy splits it into many chunks; llmgw must hand every one back in order.
    # It is over the engine's context, so the engine's 400 states the token count it read.
    s = stack("original-dst", body_mode=mode)
    content = "".join(f"{i:06d} " for i in range(40_000))
    body = {"model": "m1", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    with httpx.Client(timeout=20) as client:
        r = client.post(s.url + "/v1/chat/completions", json=body)
        direct = client.post(s.fleet.urls[0] + "/v1/chat/completions", json=body)
    assert r.status_code == direct.status_code == 400, r.text
    assert "70006 in the messages" in r.json()["error"]["message"]
    assert r.json() == direct.json()


def test_body_over_the_limit_is_413_in_full_duplex(
    stack: StackFactory, sim_fleet: ThreadedFleet
) -> None:
    config = fleet_config(sim_fleet, limits={"max_body_bytes": 64 * 1024})
    s = stack("original-dst", body_mode="gie", config=config)
    body = _body(messages=[{"role": "user", "content": "x" * 200_000}])
    r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "body_too_large"


def test_errors_are_local_replies_in_full_duplex(stack: StackFactory) -> None:
    s = stack("original-dst", body_mode="gie")
    with httpx.Client(timeout=10) as client:
        bad = client.post(
            s.url + "/v1/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        unknown = client.post(s.url + "/v1/chat/completions", json={**_body(), "model": "nope"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"
    assert unknown.status_code == 404


def test_client_abort_mid_stream_is_counted_cancelled(
    stack: StackFactory, sim_fleet: ThreadedFleet
) -> None:
    # Needs response bodies (GIE mode): without them Envoy ends the ext_proc stream the
    # same way whether the response finished or the client left (measured: override mode
    # still records success).
    s = stack("original-dst", body_mode="gie")
    sim_fleet.call(lambda: [r.set_faults(slowdown=100.0) for r in sim_fleet.fleet.replicas])
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", s.url + "/v1/chat/completions", json=_body(True)) as r,
    ):
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: "))
        # Leave after the first token: the 200 status must not make it a success.
    wait_for(lambda: sum(s.extproc.inflight().values()) == 0, 10, "lease released on abort")
    wait_for(lambda: 'outcome="cancelled"} 1.0' in _outcomes(s), 5, "cancelled counted")
    assert 'outcome="success"} 1.0' not in _outcomes(s)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the metrics")


def test_first_token_is_the_first_body_chunk_not_the_end(
    stack: StackFactory, sim_fleet: ThreadedFleet
) -> None:
    s = stack("original-dst", body_mode="gie")
    sim_fleet.call(lambda: [r.set_faults(slowdown=100.0) for r in sim_fleet.fleet.replicas])
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", s.url + "/v1/chat/completions", json=_body(True, max_tokens=4)) as r,
    ):
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    wait_for(lambda: sum(s.extproc.inflight().values()) == 0, 5, "lease released")
    text = _outcomes(s)
    assert _metric(text, "llmgw_ttft_observed_seconds_count") == 1.0
    ttft = _metric(text, "llmgw_ttft_observed_seconds_sum")
    # Tokens come every ~200 ms: the first chunk arrives well before the last of four.
    assert ttft < 0.5, ttft


@pytest.mark.parametrize("mode", ("override", "gie"))
def test_openai_models_list_and_health_through_envoy(stack: StackFactory, mode: str) -> None:
    openai = pytest.importorskip("openai")
    s = stack("original-dst", body_mode=mode)
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == ["m1"]
    assert client.models.retrieve("m1").id == "m1"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    client.close()
    # Readiness probes aimed at the gateway get an answer, not "cannot tell the model".
    with httpx.Client(timeout=5) as http:
        assert http.get(s.url + "/health").status_code == 200
        ready = http.get(s.url + "/readyz")
    assert ready.status_code == 200 and ready.json()["ready"] is True


def _with_subset_hint(bootstrap: dict[str, Any], addresses: list[str]) -> dict[str, Any]:
    """Put a set_metadata filter before ext_proc, as a gateway that subsets would."""
    listener = bootstrap["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hint = {
        "name": "envoy.filters.http.set_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
            "metadata": [
                {
                    "metadata_namespace": "envoy.lb.subset_hint",
                    "value": {"x-gateway-destination-endpoint-subset": addresses},
                }
            ],
        },
    }
    hcm["http_filters"].insert(0, hint)
    return bootstrap


@pytest.mark.parametrize("mode", ("override", "gie"))
def test_subset_hint_limits_the_pick_and_none_eligible_is_503(
    sim_fleet: ThreadedFleet, envoy_path: str, mode: str
) -> None:
    config = fleet_config(sim_fleet)
    allowed = sim_fleet.urls[2].removeprefix("http://")
    extproc = ExtProcThread(config)
    try:
        for subset, expect in (([allowed], 200), (["10.9.9.9:1"], 503)):
            bootstrap = loopback_bootstrap(
                config,
                extproc.address,
                message_timeout=5.0,
                body_mode=mode,
            )
            with EnvoyProcess(_with_subset_hint(bootstrap, subset)) as envoy:
                replies = [
                    httpx.post(envoy.url + "/v1/chat/completions", json=_body(), timeout=10)
                    for _ in range(6)
                ]
            assert {r.status_code for r in replies} == {expect}, replies[0].text
            if expect == 200:
                assert {r.headers["x-sim-replica"] for r in replies} == {"2"}
            else:
                error = replies[0].json()["error"]
                assert error["code"] == "no_healthy_endpoint"
                assert "subset hint" in error["message"]
    finally:
        extproc.stop()


def test_conformance_headers_select_and_report_the_served_endpoint(
    stack: StackFactory, sim_fleet: ThreadedFleet
) -> None:
    config = fleet_config(sim_fleet, conformance_headers=True)
    s = stack("original-dst", body_mode="gie", config=config)
    with httpx.Client(timeout=10) as client:
        for index in (1, 3):
            address = sim_fleet.urls[index].removeprefix("http://")
            r = client.post(
                s.url + "/v1/chat/completions",
                json=_body(),
                headers={"test-epp-endpoint-selection": address},
            )
            assert r.status_code == 200, r.text
            assert r.headers["x-sim-replica"] == str(index)
            assert r.headers["x-conformance-test-served-endpoint"] == address


def test_full_duplex_with_override_host_retries_on_the_listed_fallback(
    stack: StackFactory, sim_fleet: ThreadedFleet
) -> None:
    s = stack("override-host", body_mode="gie")
    with httpx.Client(timeout=10) as client:
        first = client.post(
            s.url + "/v1/chat/completions", json=_body(), headers={"x-session-id": "fd"}
        )
        assert first.status_code == 200, first.text
        primary = int(first.headers["x-sim-replica"])
        sim_fleet.set_faults(primary, status=429)
        second = client.post(
            s.url + "/v1/chat/completions", json=_body(), headers={"x-session-id": "fd"}
        )
    # Envoy replayed the streamed body to the fallback llmgw listed after the primary.
    assert second.status_code == 200, second.text
    assert int(second.headers["x-sim-replica"]) != primary
    assert second.json()["object"] == "chat.completion"
    wait_for(lambda: sum(s.extproc.inflight().values()) == 0, 5, "leases released")
