"""Random ext_proc streams through the real `ExtProcServer.process` coroutine, several at
once in one event loop, over a Router with an on-demand model: every body mode Envoy can
say, gateways without `:path`, subset and conformance hints, response statuses that move
the request to a fallback, streams cut at any read or reset at any write. Afterwards
nothing a request held is left: in flight, queued prefill, predicted queue time, breaker
probe slots, activation uses and waiters. (`test_fuzz_extproc.py` drives one exchange
without a loop; this reaches hand-offs, activation and the server's own paths.)"""

from __future__ import annotations

import asyncio
import contextlib
import math
import types
from dataclasses import dataclass, field

import grpc
import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    HttpTrailers,
    ProcessingRequest,
    ProcessingResponse,
    ProtocolConfiguration,
)
from google.protobuf.struct_pb2 import Struct  # type: ignore[import-untyped]
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.config import load_dict
from llmgw.extproc import translate
from llmgw.extproc.server import ExtProcServer
from llmgw.lifecycle import Hooks
from llmgw.runtime.router import Router
from llmgw.testing.controlplane import FakeControlPlane

ENDPOINTS = [f"127.0.0.1:{9100 + i}" for i in range(4)]
LAZY = "127.0.0.1:9"
ADDRESSES = [*ENDPOINTS, LAZY, "10.9.9.9:1"]
MODES = [
    None,  # an Envoy before 1.33: no protocol_config
    int(ProcessingMode.NONE),
    int(ProcessingMode.STREAMED),
    int(ProcessingMode.BUFFERED),
    int(ProcessingMode.BUFFERED_PARTIAL),
    int(ProcessingMode.FULL_DUPLEX_STREAMED),
]
REQUEST_TRAILERS = ProcessingRequest(request_trailers=HttpTrailers())
RESPONSE_TRAILERS = ProcessingRequest(response_trailers=HttpTrailers())


def make_router(strategy: str, *, fallbacks: bool, conformance: bool, debug: bool) -> Router:
    config = load_dict(
        {
            "activation_timeout": 2.0,
            "activation_poll_interval": 0.01,
            "models": {
                "m1": {"endpoints": ENDPOINTS, "strategy": strategy},
                "lazy": {
                    "launch": {"command": "true {port}", "expected_start_seconds": 1},
                    "scaling": {"min": 0, "max": 1},
                    "strategy": strategy,
                },
            },
            "debug_headers": debug,
            "conformance_headers": conformance,
            "destination_fallbacks": fallbacks,
            # Opens on one failure and half-opens at once: probes are taken often.
            "breaker": {
                "failure_threshold": 1,
                "success_threshold": 1,
                "base_cooldown": 0.001,
                "max_cooldown": 0.002,
            },
        }
    )
    control_plane = FakeControlPlane(LAZY)
    control_plane.release.set()  # the on-demand model starts at once
    return Router(config, control_plane=control_plane, scrape=False, seed=1)


def request_headers(
    headers: dict[str, str], *, eos: bool, modes: tuple[int, int] | None, subset: list[str] | None
) -> ProcessingRequest:
    values = [HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    message = ProcessingRequest(
        request_headers=HttpHeaders(headers=HeaderMap(headers=values), end_of_stream=eos)
    )
    if modes is not None:
        message.protocol_config.CopyFrom(
            ProtocolConfiguration(request_body_mode=modes[0], response_body_mode=modes[1])
        )
    if subset is not None:
        hint = Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return message


def response_headers(
    status: int, *, upstream: str | None, served: str | None, eos: bool, content_type: str | None
) -> ProcessingRequest:
    headers = {":status": str(status)}
    if upstream:
        headers["x-llmgw-upstream"] = upstream
    if content_type:
        headers["content-type"] = content_type
    values = [HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    message = ProcessingRequest(
        response_headers=HttpHeaders(headers=HeaderMap(headers=values), end_of_stream=eos)
    )
    if served is not None:  # Envoy retried: the endpoint that answered
        metadata = Struct()
        metadata.update({"x-gateway-destination-endpoint-served": served})
        message.metadata_context.filter_metadata["envoy.lb"].CopyFrom(metadata)
    return message


@dataclass
class Stream:
    """A gRPC stream's context for `ExtProcServer.process`: reads its script, then EOF or
    waits for ever (a stream the test cancels); `reset_at`: the write at which Envoy
    resets the stream (grpc.aio cancels the handler there)."""

    script: list[ProcessingRequest]
    hang: bool = False
    reset_at: int | None = None
    written: list[bytes] = field(default_factory=list)
    reads: int = 0
    at_end: asyncio.Event = field(default_factory=asyncio.Event)

    async def read(self) -> object:
        if self.reads < len(self.script):
            self.reads += 1
            await asyncio.sleep(0)  # let the other streams run between messages
            return self.script[self.reads - 1]
        self.at_end.set()
        if not self.hang:
            return grpc.aio.EOF
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def write(self, answer: bytes) -> None:
        if self.reset_at is not None and len(self.written) == self.reset_at:
            raise asyncio.CancelledError
        self.written.append(answer)
        await asyncio.sleep(0)


@st.composite
def streams(draw: st.DrawFn) -> Stream:
    request_mode = draw(st.sampled_from(MODES))
    response_mode = draw(st.sampled_from(MODES[1:]))
    modes = None if request_mode is None or response_mode is None else (request_mode, response_mode)
    model = draw(st.sampled_from(["m1", "m1", "lazy", "nope"]))
    envoy = draw(st.integers(0, 3)) > 0  # else a gateway without `:path` (NGINX Fabric)
    headers: dict[str, str] = {}
    if envoy:
        headers[":method"] = "POST"
        headers[":path"] = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/x"]))
    if draw(st.booleans()):
        headers["x-llmgw-model"] = model
    if draw(st.booleans()):
        headers["x-session-id"] = draw(st.sampled_from(["s1", "s2"]))
    if draw(st.integers(0, 4)) == 0:
        picked = draw(st.lists(st.sampled_from(ADDRESSES), min_size=1, max_size=2))
        headers["test-epp-endpoint-selection"] = ",".join(picked)
    subset = draw(st.none() | st.none() | st.lists(st.sampled_from(ADDRESSES), max_size=3))
    content = draw(st.sampled_from(["hi", "hello " * 50]))
    body = orjson.dumps(
        {
            "model": model,
            "stream": draw(st.booleans()),
            "messages": [{"role": "user", "content": content}],
        }
    )
    if draw(st.booleans()):
        headers["content-length"] = str(len(body))
    headers_end = draw(st.integers(0, 9)) == 0
    script = [request_headers(headers, eos=headers_end, modes=modes, subset=subset)]
    if not headers_end:
        n = draw(st.integers(0, 3))
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), min_size=n, max_size=n)))
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
        ends = draw(st.booleans())
        for i, piece in enumerate(pieces):
            end = ends and i == len(pieces) - 1
            script.append(ProcessingRequest(request_body=HttpBody(body=piece, end_of_stream=end)))
        if draw(st.booleans()):
            script.append(REQUEST_TRAILERS)
    if draw(st.integers(0, 4)) > 0:
        where = draw(st.sampled_from(["none", "upstream", "served", "both"]))
        script.append(
            response_headers(
                draw(st.sampled_from([200, 200, 429, 503, 500, 400, 0])),
                upstream=draw(st.sampled_from(ADDRESSES))
                if where in ("upstream", "both")
                else None,
                served=draw(st.sampled_from(ADDRESSES)) if where in ("served", "both") else None,
                eos=draw(st.integers(0, 5)) == 0,
                content_type=draw(st.sampled_from([None, "text/event-stream", "application/json"])),
            )
        )
        for _ in range(draw(st.integers(0, 3))):
            end = draw(st.booleans())
            script.append(
                ProcessingRequest(response_body=HttpBody(body=b"data: x\n\n", end_of_stream=end))
            )
        if draw(st.booleans()):
            script.append(RESPONSE_TRAILERS)
    if draw(st.integers(0, 6)) == 0:  # a stray second response head
        stray = response_headers(
            draw(st.sampled_from([200, 503])),
            upstream=None,
            served=None,
            eos=False,
            content_type=None,
        )
        script.insert(draw(st.integers(1, len(script))), stray)
    if draw(st.integers(0, 3)) == 0:  # the stream ends early
        script = script[: draw(st.integers(0, len(script)))]
    return Stream(
        script,
        hang=draw(st.integers(0, 2)) == 0,
        reset_at=draw(st.none() | st.none() | st.integers(0, 4)),
    )


async def run(server: object, stream: Stream) -> None:
    task = asyncio.ensure_future(ExtProcServer.process(server, None, stream))  # type: ignore[arg-type]
    if stream.hang:  # cancelled once its script is read (the gateway went away)
        ended = asyncio.ensure_future(stream.at_end.wait())
        await asyncio.wait({task, ended}, return_when=asyncio.FIRST_COMPLETED)
        ended.cancel()
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def left_behind(router: Router) -> list[str]:
    registry = router.registry
    now = registry.clock()
    problems = []
    for s in registry.all_states():
        where = f"{s.endpoint.model}/{s.id}"
        if s.inflight:
            problems.append(f"{where}: inflight {s.inflight}")
        if s.pending_prefill > 1e-9 or s.counted_prefill > 1e-9:
            problems.append(f"{where}: prefill {s.pending_prefill}, {s.counted_prefill}")
        if any(e.open for e in s.prefills) or any(e.open for e in s.blind):
            problems.append(f"{where}: an open prefill entry")
        if not math.isinf(s.busy_until) and s.busy_until > now + 1e-6:
            problems.append(f"{where}: queue {s.busy_until - now:.3f} s of ended requests")
        if s.breaker.probes_inflight:
            problems.append(f"{where}: probes {s.breaker.probes_inflight}")
    activator = router.activator
    assert activator is not None
    for name, machine in activator.machines.items():
        if machine.in_use or machine.waiters:
            problems.append(
                f"activation {name}: in use {machine.in_use}, waiters {machine.waiters}"
            )
    return problems


@pytest.fixture(autouse=True)
def no_hand_off_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    # A gateway without `:path` holds its request to the predicted first token: ended at
    # once here, so that what is left after the streams is left for good.
    monkeypatch.setattr(translate, "_HAND_OFF_MAX_S", 0.0)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    strategy=st.sampled_from(["latency", "chat"]),
    fallbacks=st.booleans(),
    conformance=st.booleans(),
    debug=st.booleans(),
    scripts=st.lists(streams(), min_size=1, max_size=5),
)
def test_random_concurrent_streams_leave_nothing_behind(
    strategy: str, fallbacks: bool, conformance: bool, debug: bool, scripts: list[Stream]
) -> None:
    async def main() -> list[str]:
        router = make_router(strategy, fallbacks=fallbacks, conformance=conformance, debug=debug)
        await router.start()
        try:
            server = types.SimpleNamespace(
                gateway=router.gateway,
                hooks=Hooks(edge="extproc"),
                local_answer=lambda _path: None,
                open_streams=0,
            )
            await asyncio.gather(*(run(server, s) for s in scripts))
            for stream in scripts:
                for answer in stream.written:
                    assert ProcessingResponse.FromString(answer).WhichOneof("response")
            return left_behind(router)
        finally:
            await router.stop()

    problems = asyncio.run(main())
    assert not problems, problems
