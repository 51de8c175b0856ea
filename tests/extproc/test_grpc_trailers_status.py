"""A gRPC answer's status in its response trailers (GIE's mode sends them) decides its outcome."""

from __future__ import annotations

import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpTrailers,
    ProcessingRequest,
    ProtocolConfiguration,
)

from llmgw.extproc.translate import Exchange
from llmgw.gateway import Gateway
from llmgw.lifecycle import Hooks
from llmgw.scheduling.scheduler import Scheduler
from llmgw.testing.extproc import chat_headers, make_config, request_headers, response_headers
from llmgw.types import Outcome

FULL_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
CHAT = orjson.dumps({"model": "m1", "messages": [{"role": "user", "content": "hello"}]})


def _first(headers: dict[str, str], request_mode: int, response_mode: int) -> ProcessingRequest:
    message = request_headers(headers)
    message.protocol_config.CopyFrom(
        ProtocolConfiguration(request_body_mode=request_mode, response_body_mode=response_mode)
    )
    return message


def _body(chunk: bytes, end: bool = False, *, response: bool = False) -> ProcessingRequest:
    part = HttpBody(body=chunk, end_of_stream=end)
    return (
        ProcessingRequest(response_body=part) if response else ProcessingRequest(request_body=part)
    )


def _exchange(events: list[Outcome]) -> Exchange:
    hooks = Hooks(outcome=lambda _m, _e, o: events.append(o))
    return Exchange(Gateway(Scheduler(make_config())), hooks)


@pytest.mark.parametrize(
    ("grpc_status", "outcome"),
    [("14", Outcome.BACKPRESSURE), ("13", Outcome.FAILURE), ("0", Outcome.SUCCESS)],
)
def test_a_grpc_error_in_the_response_trailers_is_charged_as_its_code(
    grpc_status: str, outcome: Outcome
) -> None:
    """GIE's mode sends the response trailers to ext_proc; a gRPC engine that fails after
    its 200 head (mid-generation, or any error that is not trailers-only) says so only in
    them. llmgw read a grpc-status in the head only: the failure was charged a success and
    the breaker never heard of it (found by a review helper)."""
    events: list[Outcome] = []
    ex = _exchange(events)
    ex.handle(_first(chat_headers(), FULL_DUPLEX, FULL_DUPLEX))
    ex.handle(_body(CHAT, end=True))
    head = response_headers(200)
    head.response_headers.headers.headers.add(key="content-type", raw_value=b"application/grpc")
    ex.handle(head)
    ex.handle(_body(b"\x00\x00\x00\x00\x02\x08\x01", response=True))  # one gRPC message
    trailers = HeaderMap(headers=[HeaderValue(key="grpc-status", raw_value=grpc_status.encode())])
    ex.handle(ProcessingRequest(response_trailers=HttpTrailers(trailers=trailers)))
    ex.close()
    assert events == [outcome]
