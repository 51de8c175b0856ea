"""The floor of Python gRPC: a grpc.aio ext_proc that routes every request to one fixed host.

No parsing, no scheduling, no metrics: each answer is pre-serialized bytes. It uses the
same stream handling as `extproc/server.py` (reader/writer API, identity serializer), so
`bench/envoy_overhead.py` compares like with like.

    python bench/bare_extproc.py --port 9102 --destination 127.0.0.1:8000 [--body]

`--body` asks Envoy for the buffered body first (mode_override, like llmgw does when it
needs the model name or prompt), then routes: the floor for body-routed requests.
`--full-duplex` is the floor for GIE's FULL_DUPLEX_STREAMED mode: it holds the headers
answer until the body ends, then sends it and every body chunk back unchanged, and passes
response body chunks through.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    ProcessingRequest,
    ProcessingResponse,
)
from google.protobuf.struct_pb2 import Struct  # type: ignore[import-untyped]

from llmgw.extproc.translate import (
    ASK_FOR_BODY,
    CONTINUE_REQUEST_BODY,
    CONTINUE_REQUEST_HEADERS,
    CONTINUE_REQUEST_TRAILERS,
    CONTINUE_RESPONSE_BODY,
    CONTINUE_RESPONSE_HEADERS,
    CONTINUE_RESPONSE_TRAILERS,
    streamed_request_body,
    streamed_response_body,
)
from llmgw.lifecycle import DESTINATION_HEADER, METADATA_NAMESPACE

# Field numbers of ProcessingRequest's oneof -> the answer when nothing is decided there.
_CONTINUE = {
    "request_headers": CONTINUE_REQUEST_HEADERS,
    "request_body": CONTINUE_REQUEST_BODY,
    "request_trailers": CONTINUE_REQUEST_TRAILERS,
    "response_headers": CONTINUE_RESPONSE_HEADERS,
    "response_body": CONTINUE_RESPONSE_BODY,
    "response_trailers": CONTINUE_RESPONSE_TRAILERS,
}


def routed(destination: str, *, after_body: bool) -> bytes:
    """The fixed routing answer, serialized once."""
    message = ProcessingResponse()
    common = message.request_body.response if after_body else message.request_headers.response
    option = common.header_mutation.set_headers.add()
    option.header.key = DESTINATION_HEADER
    option.header.raw_value = destination.encode()
    common.clear_route_cache = True
    metadata = Struct()
    metadata.fields[METADATA_NAMESPACE].struct_value.fields[
        DESTINATION_HEADER
    ].string_value = destination
    message.dynamic_metadata.CopyFrom(metadata)
    data: bytes = message.SerializeToString()
    return data


def make_handler(destination: str, body: bool) -> Any:
    on_headers = ASK_FOR_BODY if body else routed(destination, after_body=False)
    on_body = routed(destination, after_body=True)

    async def process(_requests: AsyncIterator[ProcessingRequest], context: Any) -> None:
        read, write, eof = context.read, context.write, grpc.aio.EOF
        while True:
            message = await read()
            if message is eof:
                return
            kind = message.WhichOneof("request")
            if kind == "request_headers":
                await write(on_headers)
            elif kind == "request_body" and message.request_body.end_of_stream:
                await write(on_body)
            else:
                await write(_CONTINUE[kind])

    return process


def make_full_duplex_handler(destination: str) -> Any:
    on_headers = routed(destination, after_body=False)

    async def process(_requests: AsyncIterator[ProcessingRequest], context: Any) -> None:
        read, write, eof = context.read, context.write, grpc.aio.EOF
        held: list[bytes] | None = None  # body chunks while the headers answer is held
        while True:
            message = await read()
            if message is eof:
                return
            kind = message.WhichOneof("request")
            if kind == "request_headers":
                if message.request_headers.end_of_stream:
                    await write(on_headers)
                else:
                    held = []
            elif kind == "request_body":
                part = message.request_body
                if held is None:
                    await write(streamed_request_body(part.body, end_of_stream=part.end_of_stream))
                    continue
                held.append(part.body)
                if part.end_of_stream:
                    await write(on_headers)
                    for i, chunk in enumerate(held):
                        await write(streamed_request_body(chunk, end_of_stream=i == len(held) - 1))
                    held = None
            elif kind == "request_trailers":
                if held is not None:
                    await write(on_headers)
                    for chunk in held:
                        await write(streamed_request_body(chunk, end_of_stream=False))
                    held = None
                await write(CONTINUE_REQUEST_TRAILERS)
            elif kind == "response_body":
                part = message.response_body
                await write(streamed_response_body(part.body, end_of_stream=part.end_of_stream))
            else:
                await write(_CONTINUE[kind])

    return process


async def serve(host: str, port: int, destination: str, body: bool, full_duplex: bool) -> None:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 16 << 20)])
    handler = grpc.stream_stream_rpc_method_handler(
        make_full_duplex_handler(destination) if full_duplex else make_handler(destination, body),
        request_deserializer=ProcessingRequest.FromString,
        response_serializer=lambda data: data,
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "envoy.service.ext_proc.v3.ExternalProcessor", {"Process": handler}
            ),
        )
    )
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9102)
    parser.add_argument("--destination", required=True, help="ip:port every request goes to")
    parser.add_argument("--body", action="store_true", help="ask for the buffered body first")
    parser.add_argument(
        "--full-duplex", action="store_true", help="answer FULL_DUPLEX_STREAMED bodies"
    )
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.host, args.port, args.destination, args.body, args.full_duplex))


if __name__ == "__main__":
    main()
