"""What a request holds at its endpoint (inflight, queued prefill) is given back on the
ext_proc edge's odd paths: a failed first attempt, a stream reset before a non-Envoy
gateway's answer, trailers after no body. Found by fuzzing exchanges in an event loop."""

from __future__ import annotations

import asyncio
import types

import grpc
import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    HttpTrailers,
    ProcessingRequest,
)
from google.protobuf.struct_pb2 import Struct  # type: ignore[import-untyped]

from llmgw.extproc.server import ExtProcServer
from llmgw.extproc.translate import Exchange
from llmgw.gateway import Gateway
from llmgw.lifecycle import Hooks
from llmgw.scheduling.scheduler import Scheduler
from llmgw.testing.extproc import make_config, parse, set_headers
from llmgw.types import Outcome

LONG_CHAT = orjson.dumps(
    {"model": "m1", "stream": True, "messages": [{"role": "user", "content": "hello " * 20000}]}
)


def served_by(status: int, address: str) -> ProcessingRequest:
    """Response headers with the `envoy.lb` served-endpoint metadata (Envoy retried)."""
    message = ProcessingRequest(
        response_headers=HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key=":status", raw_value=str(status).encode())])
        )
    )
    s = Struct()
    s.update({"x-gateway-destination-endpoint-served": address})
    message.metadata_context.filter_metadata["envoy.lb"].CopyFrom(s)
    return message


def chat_request_headers(**extra: str) -> ProcessingRequest:
    values = [
        HeaderValue(key=k, raw_value=v.encode())
        for k, v in {":method": "POST", ":path": "/v1/chat/completions", **extra}.items()
    ]
    return ProcessingRequest(request_headers=HttpHeaders(headers=HeaderMap(headers=values)))


def test_a_primary_that_failed_over_to_a_fallback_is_not_left_with_its_queued_prefill() -> None:
    """latency strategy, llmgw's own body mode (response bodies off: the queue term is
    `busy_until`). Envoy's first try failed and its retry on the first fallback answered.
    The request is over, the primary never prefilled it; yet the primary keeps the
    request's whole predicted prefill (~3 s here) as a queue, which a cancelled request
    does not leave (`Lease.end` lowers it). (found by a review helper)"""
    scheduler = Scheduler(make_config(4, strategy="latency"), seed=1)
    registry = scheduler.registry
    exchange = Exchange(Gateway(scheduler))
    exchange.handle(chat_request_headers())
    exchange.handle(ProcessingRequest(request_body=HttpBody(body=LONG_CHAT, end_of_stream=True)))
    decision = exchange.decision
    assert decision is not None and decision.fallbacks
    primary = registry.get("m1", decision.endpoint.id)
    assert primary is not None and primary.busy_until - registry.clock() > 1.0  # the prefill
    exchange.handle(served_by(200, decision.fallbacks[0].address))
    exchange.handle(ProcessingRequest(response_trailers=HttpTrailers()))
    exchange.close()
    assert all(s.inflight == 0 for s in registry.states("m1"))
    assert primary.pending_prefill == 0.0  # the exact term forgot it ...
    queue = primary.busy_until - registry.clock()
    assert queue <= 0.01, f"primary still queues {queue:.2f} s of a request that ended"


class AbortAtFirstWrite:
    """grpc.aio cancels the handler at a write when the peer reset the stream."""

    def __init__(self, *messages: ProcessingRequest) -> None:
        self.messages = list(messages)
        self.writes = 0

    async def read(self) -> object:
        return self.messages.pop(0) if self.messages else grpc.aio.EOF

    async def write(self, _answer: bytes) -> None:
        self.writes += 1
        raise asyncio.CancelledError


async def test_a_gateway_that_is_not_envoy_reset_before_its_answer_leaves_nothing_in_flight() -> (
    None
):
    """NGINX Gateway Fabric's sequence (no `:path`: the headers answer is held until the
    body's end). The stream is reset while llmgw writes that answer: NGF never got an
    endpoint, nothing went to an engine. llmgw still counts the request in flight (load and
    queued prefill) until its predicted first token (up to 30 s), then ends it `unknown`
    with its first token owed to the engine's count, instead of `cancelled` at once as
    `close(aborted=True)` does for Envoy. (found by a review helper)"""
    scheduler = Scheduler(make_config(4, strategy="latency"), seed=1)
    outcomes: list[Outcome] = []
    server = types.SimpleNamespace(
        gateway=Gateway(scheduler),
        hooks=Hooks(edge="extproc", ended=lambda _m, o: outcomes.append(o)),
        local_answer=lambda _p: None,
        open_streams=0,
    )
    ngf_headers = ProcessingRequest(
        request_headers=HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key="content-type", value="application/json")])
        )
    )
    stream = AbortAtFirstWrite(
        ngf_headers, ProcessingRequest(request_body=HttpBody(body=LONG_CHAT, end_of_stream=True))
    )
    with pytest.raises(asyncio.CancelledError):
        await ExtProcServer.process(server, None, stream)  # type: ignore[arg-type]
    assert stream.writes == 1  # the routing answer never left
    inflight = sum(s.inflight for s in scheduler.registry.states("m1"))
    assert inflight == 0 and outcomes == [Outcome.CANCELLED], (inflight, outcomes)


@pytest.mark.parametrize("strategy", ["latency", "chat"])
def test_trailers_after_no_body_on_a_sub_path_do_not_take_a_lease_envoy_never_hears_of(
    strategy: str,
) -> None:
    """`POST /v1/responses/{id}/cancel` (no body; the model in the header) over HTTP/2 with
    trailers: the default strategies read the prompt, so llmgw asks for the BUFFERED body;
    Envoy sends only the trailers. `_request_trailers` assumes routing an empty body is an
    error, but below an inference path an empty body routes by the header: a lease is taken
    (counted in flight, charged at the end) while the trailers answer carries no
    destination, so Envoy sends the request unrouted. (found by a review helper)"""
    scheduler = Scheduler(make_config(4, strategy=strategy), seed=1)
    exchange = Exchange(Gateway(scheduler))
    headers = ProcessingRequest(
        request_headers=HttpHeaders(
            headers=HeaderMap(
                headers=[
                    HeaderValue(key=":method", raw_value=b"POST"),
                    HeaderValue(key=":path", raw_value=b"/v1/responses/resp_1/cancel"),
                    HeaderValue(key="x-llmgw-model", raw_value=b"m1"),
                ]
            )
        )
    )
    answers = [parse(exchange.handle(headers))]
    answers.append(parse(exchange.handle(ProcessingRequest(request_trailers=HttpTrailers()))))
    routed = any(
        "x-gateway-destination-endpoint" in set_headers(a)
        for a in answers
        if a.WhichOneof("response") in ("request_headers", "request_body")
    )
    inflight = sum(s.inflight for s in scheduler.registry.states("m1"))
    assert routed or inflight == 0, (
        f"a lease on {exchange.decision and exchange.decision.endpoint.id} "
        f"(inflight {inflight}) but no answer named an endpoint: "
        f"{[a.WhichOneof('response') for a in answers]}"
    )
