"""Exchange: ext_proc messages in, ProcessingResponse bytes out, leases in the registry."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import ProtocolConfiguration

from llmgw.breaker import BreakerState
from llmgw.errors import LlmgwError
from llmgw.extproc.translate import Exchange
from llmgw.gateway import Gateway
from llmgw.lifecycle import Hooks
from llmgw.runtime.telemetry import Telemetry
from llmgw.scheduling.scheduler import Scheduler
from llmgw.testing.extproc import (
    chat_headers,
    destinations,
    make_config,
    parse,
    request_body,
    request_headers,
    response_headers,
    response_trailers,
    set_headers,
)
from llmgw.types import Outcome

CHAT = orjson.dumps(
    {"model": "m1", "messages": [{"role": "user", "content": "hello"}], "stream": False}
)


def inflight(scheduler: Scheduler) -> dict[str, int]:
    return {s.id: s.inflight for s in scheduler.registry.states("m1")}


def test_headers_only_decision_sets_header_metadata_and_clears_route_cache() -> None:
    scheduler = Scheduler(make_config())
    answer = parse(
        Exchange(Gateway(scheduler)).handle(
            request_headers(chat_headers(**{"x-llmgw-model": "m1", "x-session-id": "s1"}))
        )
    )
    assert answer.WhichOneof("response") == "request_headers"
    common = answer.request_headers.response
    assert common.clear_route_cache
    headers = set_headers(answer)
    chain = destinations(answer).split(",")
    # The protocol forbids two different values in the header and the metadata.
    assert headers["x-gateway-destination-endpoint"] == ",".join(chain)
    assert len(chain) == 3 and len(set(chain)) == 3
    # An Envoy that did not say its modes (before 1.33) gets no override.
    assert not answer.HasField("mode_override")


@pytest.mark.parametrize("response_mode", [ProcessingMode.NONE, ProcessingMode.STREAMED])
def test_a_request_routed_at_the_headers_turns_the_response_headers_on(
    response_mode: int,
) -> None:
    """llmgw's own config leaves response headers off (Envoy's own replies to requests it
    never saw are then not held for it); each routed request turns them on, keeping the
    configured response body mode."""
    message = request_headers(chat_headers(**{"x-llmgw-model": "m1"}))
    message.protocol_config.CopyFrom(
        ProtocolConfiguration(
            request_body_mode=ProcessingMode.NONE, response_body_mode=response_mode
        )
    )
    answer = parse(Exchange(Gateway(Scheduler(make_config()))).handle(message))
    assert "x-gateway-destination-endpoint" in set_headers(answer)
    override = answer.mode_override
    assert override.response_header_mode == ProcessingMode.SEND
    assert override.request_body_mode == ProcessingMode.NONE
    assert override.response_body_mode == response_mode


@pytest.mark.parametrize("raw", [True, False])
def test_reads_raw_value_and_legacy_value_headers(raw: bool) -> None:
    scheduler = Scheduler(make_config())
    headers = chat_headers(**{"x-llmgw-model": "m1", "x-session-id": "s1"})
    answer = parse(Exchange(Gateway(scheduler)).handle(request_headers(headers, raw=raw)))
    assert answer.request_headers.response.clear_route_cache


def test_same_session_gets_same_primary_and_no_session_spreads() -> None:
    scheduler = Scheduler(make_config(endpoints=4))

    def primary(**extra: str) -> str:
        answer = parse(
            Exchange(Gateway(scheduler)).handle(
                request_headers(chat_headers(**{"x-llmgw-model": "m1"}, **extra))
            )
        )
        return set_headers(answer)["x-gateway-destination-endpoint"].split(",")[0]

    assert len({primary(**{"x-session-id": "abc"}) for _ in range(20)}) == 1
    spread = {primary(**{"x-request-id": f"r{i}"}) for i in range(60)}
    assert len(spread) == 4


def test_body_needed_asks_for_buffered_body_then_routes_on_it() -> None:
    scheduler = Scheduler(make_config(strategy="chat"))
    exchange = Exchange(Gateway(scheduler))
    first = parse(exchange.handle(request_headers(chat_headers())))
    assert first.WhichOneof("response") == "request_headers"
    assert first.mode_override.request_body_mode == ProcessingMode.BUFFERED
    assert first.mode_override.response_header_mode == ProcessingMode.SEND
    assert not first.request_headers.response.HasField("header_mutation")
    second = parse(exchange.handle(request_body(CHAT)))
    assert second.WhichOneof("response") == "request_body"
    assert second.request_body.response.clear_route_cache
    assert set_headers(second)["x-gateway-destination-endpoint"] in destinations(second)
    assert sum(inflight(scheduler).values()) == 1


def test_body_in_chunks_is_joined_before_parsing() -> None:
    scheduler = Scheduler(make_config(strategy="chat"))
    exchange = Exchange(Gateway(scheduler))
    exchange.handle(request_headers(chat_headers()))
    middle = parse(exchange.handle(request_body(CHAT[:10], end_of_stream=False)))
    assert middle.WhichOneof("response") == "request_body"
    assert not middle.request_body.response.HasField("header_mutation")
    last = parse(exchange.handle(request_body(CHAT[10:])))
    assert "x-gateway-destination-endpoint" in set_headers(last)


@pytest.mark.parametrize(
    ("body", "model_header", "status", "code"),
    [
        (b"{not json", None, 400, "invalid_request"),
        (b'{"model": 7, "messages": []}', None, 400, "invalid_request"),
        (b'{"model": "nope", "messages": []}', None, 404, "model_not_found"),
        (b'{"model": "m1", "prompt": "' + b"x" * 5000 + b'"}', None, 413, "body_too_large"),
    ],
)
def test_errors_become_immediate_responses_with_json_bodies(
    body: bytes, model_header: str | None, status: int, code: str
) -> None:
    config = make_config(strategy="chat").model_copy(
        update={"limits": make_config().limits.model_copy(update={"max_body_bytes": 4096})}
    )
    scheduler = Scheduler(config)
    exchange = Exchange(Gateway(scheduler))
    exchange.handle(request_headers(chat_headers()))
    answer = parse(exchange.handle(request_body(body)))
    assert answer.WhichOneof("response") == "immediate_response"
    immediate = answer.immediate_response
    assert immediate.status.code == status
    assert orjson.loads(immediate.body)["error"]["code"] == code
    headers = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    assert headers["content-type"] == "application/json"
    assert sum(inflight(scheduler).values()) == 0


def test_unknown_model_header_is_404_without_asking_for_the_body() -> None:
    scheduler = Scheduler(make_config())
    answer = parse(
        Exchange(Gateway(scheduler)).handle(
            request_headers(chat_headers(**{"x-llmgw-model": "nope"}))
        )
    )
    assert answer.immediate_response.status.code == 404


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
def test_a_method_other_than_post_on_an_inference_path_is_405(method: str) -> None:
    scheduler = Scheduler(make_config())
    headers = chat_headers(**{":method": method, "x-llmgw-model": "m1"})
    answer = parse(
        Exchange(Gateway(scheduler)).handle(request_headers(headers, end_of_stream=True))
    )
    immediate = answer.immediate_response
    assert immediate.status.code == 405
    assert orjson.loads(immediate.body)["error"]["code"] == "method_not_allowed"
    sent = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    assert sent["allow"] == "POST"
    assert sum(inflight(scheduler).values()) == 0


def test_a_cors_preflight_is_answered_200_at_the_headers_and_routes_nothing() -> None:
    """vLLM answers a browser's preflight with 200 and access-control-allow-*; ext_proc
    answered 405, so no browser app could call the models behind Envoy (found by a review
    helper). A GET of a local answer with an Origin says any origin may read it."""
    scheduler = Scheduler(make_config())
    asked = {
        ":method": "OPTIONS",
        "origin": "http://localhost:3000",
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    answer = parse(
        Exchange(Gateway(scheduler)).handle(
            request_headers(chat_headers(**asked), end_of_stream=True)
        )
    )
    immediate = answer.immediate_response
    assert immediate.status.code == 200 and immediate.body == b"OK"
    sent = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    assert sent["access-control-allow-origin"] == "*"
    assert sent["access-control-allow-headers"] == "authorization, content-type"
    assert "POST" in sent["access-control-allow-methods"]
    assert sum(inflight(scheduler).values()) == 0
    local = Exchange(Gateway(scheduler), local=lambda path: (200, b"{}"))
    headers = chat_headers(**{":method": "GET", ":path": "/v1/models", "origin": "http://a"})
    listed = parse(local.handle(request_headers(headers, end_of_stream=True))).immediate_response
    sent = {h.header.key: h.header.raw_value.decode() for h in listed.headers.set_headers}
    assert sent["access-control-allow-origin"] == "*" and sent["vary"] == "Origin"


def test_llmgw_own_errors_to_a_browser_carry_cors() -> None:
    """llmgw's own error answers (a 404 model_not_found, a 405) to a request with an Origin
    had no access-control-allow-origin, as vLLM's errors do: a browser app read a network
    error, not the JSON error (found by a review helper). Without Origin, none is added."""
    scheduler = Scheduler(make_config())

    def refused(headers: dict[str, str], body: bytes | None) -> tuple[int, dict[str, str]]:
        exchange = Exchange(Gateway(scheduler))
        answer = parse(exchange.handle(request_headers(chat_headers(**headers))))
        if body is not None:
            answer = parse(exchange.handle(request_body(body, end_of_stream=True)))
        immediate = answer.immediate_response
        sent = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
        return immediate.status.code, sent

    unknown = orjson.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    browser = {"origin": "http://localhost:3000"}
    status, sent = refused(browser, unknown)
    assert status == 404
    assert sent["access-control-allow-origin"] == "*" and sent["vary"] == "Origin"
    status, sent = refused({**browser, ":path": "/v1/models/m1"}, None)
    assert status == 405 and sent["access-control-allow-origin"] == "*"
    status, sent = refused({}, unknown)
    assert status == 404 and "access-control-allow-origin" not in sent


def test_a_post_to_the_model_catalog_is_405() -> None:
    scheduler = Scheduler(make_config())
    headers = chat_headers(**{":path": "/v1/models/m1"})
    answer = parse(Exchange(Gateway(scheduler)).handle(request_headers(headers)))
    immediate = answer.immediate_response
    assert immediate.status.code == 405
    sent = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    assert sent["allow"] == "GET, HEAD"


def test_post_without_body_is_400() -> None:
    scheduler = Scheduler(make_config(strategy="chat"))
    answer = parse(
        Exchange(Gateway(scheduler)).handle(request_headers(chat_headers(), end_of_stream=True))
    )
    assert answer.immediate_response.status.code == 400


def test_every_breaker_open_is_503_with_retry_hint() -> None:
    scheduler = Scheduler(make_config())
    for state in scheduler.registry.states("m1"):
        for _ in range(3):
            scheduler.registry.acquire("m1", state.id)
            scheduler.registry.release("m1", state.id, Outcome.FAILURE)
    answer = parse(
        Exchange(Gateway(scheduler)).handle(
            request_headers(chat_headers(**{"x-llmgw-model": "m1"}))
        )
    )
    assert answer.immediate_response.status.code == 503
    assert b"no_healthy_endpoint" in answer.immediate_response.body


def test_lease_is_held_until_the_response_ends() -> None:
    scheduler = Scheduler(make_config())
    exchange = Exchange(Gateway(scheduler))
    answer = parse(exchange.handle(request_headers(chat_headers(**{"x-llmgw-model": "m1"}))))
    primary = set_headers(answer)["x-gateway-destination-endpoint"].split(",")[0]
    assert inflight(scheduler)[primary] == 1
    exchange.handle(response_headers(200, primary))
    assert inflight(scheduler)[primary] == 1  # streaming: still in flight
    exchange.handle(response_trailers())
    assert inflight(scheduler)[primary] == 0
    exchange.close()  # idempotent
    assert inflight(scheduler)[primary] == 0


def test_client_abort_releases_without_touching_the_breaker() -> None:
    scheduler = Scheduler(make_config())
    exchange = Exchange(Gateway(scheduler))
    exchange.handle(request_headers(chat_headers(**{"x-llmgw-model": "m1"})))
    assert sum(inflight(scheduler).values()) == 1
    exchange.close()
    assert sum(inflight(scheduler).values()) == 0
    assert all(s is BreakerState.CLOSED for s in scheduler.registry.breaker_states().values())


def test_5xx_responses_open_the_breaker() -> None:
    scheduler = Scheduler(make_config())
    target = None
    for _ in range(3):
        exchange = Exchange(Gateway(scheduler))
        answer = parse(
            exchange.handle(
                request_headers(chat_headers(**{"x-llmgw-model": "m1", "x-session-id": "s"}))
            )
        )
        target = set_headers(answer)["x-gateway-destination-endpoint"].split(",")[0]
        exchange.handle(response_headers(500, target, end_of_stream=True))
    assert target is not None
    assert scheduler.registry.breaker_states()[("m1", target)] is BreakerState.OPEN


def test_answer_from_a_fallback_charges_the_primary_and_holds_the_fallback() -> None:
    scheduler = Scheduler(make_config())
    outcomes: list[tuple[str, Outcome]] = []
    hooks = Hooks(outcome=lambda _m, e, o: outcomes.append((e, o)))
    exchange = Exchange(Gateway(scheduler), hooks)
    answer = parse(exchange.handle(request_headers(chat_headers(**{"x-llmgw-model": "m1"}))))
    primary, fallback, _ = destinations(answer).split(",")
    exchange.handle(response_headers(200, fallback))
    assert inflight(scheduler)[primary] == 0
    assert inflight(scheduler)[fallback] == 1
    exchange.close()
    assert outcomes == [(primary, Outcome.FAILURE), (fallback, Outcome.SUCCESS)]


def test_upstream_header_is_stripped_unless_debugging() -> None:
    scheduler = Scheduler(make_config(debug=False))
    exchange = Exchange(Gateway(scheduler))
    exchange.handle(request_headers(chat_headers(**{"x-llmgw-model": "m1"})))
    reply = parse(exchange.handle(response_headers(200, "127.0.0.1:9100")))
    assert list(reply.response_headers.response.header_mutation.remove_headers) == [
        "x-llmgw-upstream"
    ]


def test_hooks_feed_telemetry() -> None:
    scheduler = Scheduler(make_config())
    telemetry = Telemetry()
    telemetry.bind(scheduler.registry)
    hooks = Hooks(
        decision=lambda d, _rid: telemetry.decision(d),
        error=telemetry.error,
        outcome=telemetry.outcome,
        stage=telemetry.stage,
    )
    exchange = Exchange(Gateway(scheduler), hooks)
    exchange.handle(request_headers(chat_headers(**{"x-llmgw-model": "m1"})))
    exchange.handle(response_headers(200, end_of_stream=True))
    Exchange(Gateway(scheduler), hooks).handle(
        request_headers(chat_headers(**{"x-llmgw-model": "zz"}))
    )
    text = telemetry.render()[0].decode()
    assert 'llmgw_decisions_total{endpoint="127.0.0.1:' in text
    assert 'llmgw_errors_total{code="model_not_found",status="404"} 1.0' in text
    assert 'llmgw_stage_seconds_count{stage="total"} 1.0' in text
    assert 'outcome="success"' in text
    assert 'llmgw_breaker_state{endpoint="127.0.0.1:9100",model="m1",state="closed"} 1.0' in text


def test_a_router_bug_is_a_500_not_a_broken_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler = Scheduler(make_config())

    def boom(_request: object) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(scheduler, "pick", boom)
    answer = parse(
        Exchange(Gateway(scheduler)).handle(
            request_headers(chat_headers(**{"x-llmgw-model": "m1"}))
        )
    )
    assert answer.immediate_response.status.code == 500


def test_llmgw_error_headers_reach_the_immediate_response() -> None:
    from llmgw.extproc.translate import immediate_response  # noqa: PLC0415

    error = LlmgwError("x", headers={"retry-after": "5"})
    answer = parse(immediate_response(error))
    headers = {
        h.header.key: h.header.raw_value.decode()
        for h in answer.immediate_response.headers.set_headers
    }
    assert headers["retry-after"] == "5"


def test_debug_headers_explain_the_decision_on_the_response() -> None:
    scheduler = Scheduler(make_config(debug=True))
    exchange = Exchange(Gateway(scheduler))
    answer = parse(exchange.handle(request_headers(chat_headers(**{"x-llmgw-model": "m1"}))))
    primary = set_headers(answer)["x-gateway-destination-endpoint"].split(",")[0]
    reply = parse(exchange.handle(response_headers(200, primary)))
    summary = set_headers(reply)["x-llmgw-decision"]
    assert summary.startswith(f"endpoint={primary} strategy=ring")


async def test_a_request_handed_to_a_gateway_that_reports_no_response_stays_in_flight() -> None:
    """NGINX Gateway Fabric closes the stream right after the pick and reports nothing more.
    The lease ended then: the request, just sent, left the queue and load terms at once and
    counted as released, lowering that engine's load until its next scrape, so the next
    picks went there too. It is held to its predicted first token, then ended `unknown`
    (found by a review helper)."""
    scheduler = Scheduler(make_config(strategy="latency"))
    ended: list[Outcome] = []
    over = asyncio.Event()

    def end(_model: str, outcome: Outcome) -> None:
        ended.append(outcome)
        over.set()

    exchange = Exchange(Gateway(scheduler), Hooks(ended=end))
    body = b'{"model": "m1", "messages": [{"role": "user", "content": "' + b"hi " * 3000 + b'"}]}'
    exchange.handle(request_headers({"content-type": "application/json"}))  # no :path
    answer = exchange.handle(request_body(body, end_of_stream=True))
    assert answer, "routed"
    lease = exchange.lifecycle.lease
    assert lease is not None and lease.ready_at is not None
    exchange.close()
    state = scheduler.registry.get("m1", lease.endpoint_id)
    assert state is not None and state.inflight == 1 and ended == []
    await asyncio.wait_for(over.wait(), 30)  # at its predicted first token
    assert state.inflight == 0 and ended == [Outcome.UNKNOWN]
