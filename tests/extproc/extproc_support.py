"""Builders for ext_proc request messages and readers for the answers (tests only)."""

from __future__ import annotations

from collections.abc import Mapping

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    HttpTrailers,
    ProcessingRequest,
    ProcessingResponse,
)

from llmgw.config import Config, load_dict


def make_config(
    endpoints: int = 3, *, strategy: str = "ring", debug: bool = True, **model: object
) -> Config:
    return load_dict(
        {
            "models": {
                "m1": {
                    "endpoints": [f"127.0.0.1:{9100 + i}" for i in range(endpoints)],
                    "strategy": strategy,
                    **model,
                }
            },
            "debug_headers": debug,
        }
    )


def request_headers(
    headers: Mapping[str, str], *, end_of_stream: bool = False, raw: bool = True
) -> ProcessingRequest:
    values = [
        HeaderValue(key=k, raw_value=v.encode()) if raw else HeaderValue(key=k, value=v)
        for k, v in headers.items()
    ]
    return ProcessingRequest(
        request_headers=HttpHeaders(headers=HeaderMap(headers=values), end_of_stream=end_of_stream)
    )


def request_body(body: bytes, *, end_of_stream: bool = True) -> ProcessingRequest:
    return ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=end_of_stream))


def response_headers(
    status: int, upstream: str | None = None, *, end_of_stream: bool = False
) -> ProcessingRequest:
    headers = {":status": str(status)}
    if upstream is not None:
        headers["x-llmgw-upstream"] = upstream
    values = [HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    return ProcessingRequest(
        response_headers=HttpHeaders(headers=HeaderMap(headers=values), end_of_stream=end_of_stream)
    )


def response_trailers() -> ProcessingRequest:
    return ProcessingRequest(response_trailers=HttpTrailers())


def parse(data: bytes) -> ProcessingResponse:
    return ProcessingResponse.FromString(data)


def set_headers(response: ProcessingResponse) -> dict[str, str]:
    kind = response.WhichOneof("response")
    common = getattr(response, kind).response
    return {
        h.header.key: h.header.raw_value.decode() or h.header.value
        for h in common.header_mutation.set_headers
    }


def destinations(response: ProcessingResponse) -> str:
    return str(
        response.dynamic_metadata.fields["envoy.lb"]
        .struct_value.fields["x-gateway-destination-endpoint"]
        .string_value
    )


def chat_headers(**extra: str) -> dict[str, str]:
    return {":method": "POST", ":path": "/v1/chat/completions", "x-request-id": "r1", **extra}
