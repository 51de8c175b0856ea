"""The grpc.aio server with a real gRPC client: streams, release on abort, health, metrics."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
)

from llmgw.config import load_dict
from llmgw.errors import ConfigError
from llmgw.extproc import server as extproc_server
from llmgw.extproc.server import ExtProcServer, build_parser, main
from llmgw.runtime.controlplanes import StartError
from llmgw.runtime.ports import free_port
from llmgw.runtime.router import ConfigWatcher
from llmgw.testing.extproc import (
    chat_headers,
    make_config,
    request_body,
    request_headers,
    response_headers,
    set_headers,
    wait_for,
)
from llmgw.testing.wait import eventually

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


@pytest.fixture
async def server() -> AsyncIterator[ExtProcServer]:
    srv = ExtProcServer(
        make_config(), host="127.0.0.1", grpc_port=0, health_port=0, metrics_port=0, scrape=False
    )
    await srv.start()
    yield srv
    await srv.stop(1.0)


# Every call has a deadline: a server that never answers fails the test, never hangs CI.
DEADLINE = 10.0


def stream(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamCall:
    method = channel.stream_stream(
        PROCESS,
        request_serializer=ProcessingRequest.SerializeToString,
        response_deserializer=ProcessingResponse.FromString,
    )
    return method(timeout=DEADLINE)


def total_inflight(srv: ExtProcServer) -> int:
    return sum(s.inflight for s in srv.scheduler.registry.states("m1"))


async def test_a_stream_routes_then_releases_when_envoy_closes_it(server: ExtProcServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.ports['grpc']}") as channel:
        call = stream(channel)
        await call.write(request_headers(chat_headers(**{"x-llmgw-model": "m1"})))
        answer = await call.read()
        assert isinstance(answer, ProcessingResponse)
        assert "x-gateway-destination-endpoint" in set_headers(answer)
        assert total_inflight(server) == 1
        await call.write(response_headers(200))
        reply = await call.read()
        assert isinstance(reply, ProcessingResponse)
        assert reply.WhichOneof("response") == "response_headers"
        assert total_inflight(server) == 1
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        await eventually(lambda: total_inflight(server) == 0)


async def test_a_buffered_body_past_any_grpc_margin_gets_the_413_not_a_dead_stream() -> None:
    """A gateway that buffers more than max_body_bytes + 1 MiB (a GIE gateway in BUFFERED
    mode): the body's 413 comes from llmgw, not RESOURCE_EXHAUSTED from gRPC."""
    models = {"m1": {"endpoints": ["127.0.0.1:9100"], "strategy": "ring"}}
    config = load_dict({"models": models, "limits": {"max_body_bytes": 4096}})
    srv = ExtProcServer(config, host="127.0.0.1", grpc_port=0, health_port=None,
                        metrics_port=None, scrape=False)  # fmt: skip
    await srv.start()
    try:
        options = [("grpc.max_send_message_length", 64 << 20)]
        address = f"127.0.0.1:{srv.ports['grpc']}"
        async with grpc.aio.insecure_channel(address, options=options) as channel:
            call = stream(channel)
            await call.write(request_headers(chat_headers()))  # the body is asked for
            assert isinstance(await call.read(), ProcessingResponse)
            await call.write(
                request_body(b'{"model": "m1", "prompt": "' + b"x" * (2 << 20) + b'"}')
            )
            answer = await call.read()
            assert isinstance(answer, ProcessingResponse)
            assert answer.immediate_response.status.code == 413
            call.cancel()
        await eventually(lambda: srv.open_streams == 0)
    finally:
        await srv.stop(1.0)


async def test_cancelled_stream_releases_the_lease(server: ExtProcServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.ports['grpc']}") as channel:
        call = stream(channel)
        await call.write(request_headers(chat_headers(**{"x-llmgw-model": "m1"})))
        await call.read()
        assert total_inflight(server) == 1
        call.cancel()
        await eventually(lambda: total_inflight(server) == 0 and server.open_streams == 0)


class StalledStream:
    """A stream Envoy reset while llmgw stalled (a GC pause, a throttled CPU) past its
    message_timeout: the response headers are read on waking, and writing their answer
    raises what grpc.aio raises there (probed with a real client: the handler task is
    cancelled at that write; a real client cannot order that without a timed stall)."""

    def __init__(self, *messages: ProcessingRequest) -> None:
        self.messages = list(messages)

    async def read(self) -> ProcessingRequest | object:
        return self.messages.pop(0) if self.messages else grpc.aio.EOF

    async def write(self, _answer: bytes) -> None:
        if not self.messages:  # answering the last message: the stream is gone
            raise asyncio.CancelledError

    async def unused(self) -> AsyncIterator[ProcessingRequest]:  # the server reads `read`
        return
        yield


@pytest.mark.parametrize(("status", "outcome"), [(200, "cancelled"), (500, "failure")])
async def test_a_stream_reset_before_the_response_headers_answer_is_not_a_success(
    server: ExtProcServer, status: int, outcome: str
) -> None:
    """Envoy gave up on the response headers' answer (the client got its 504) and reset the
    stream; it was counted as the status it carried, 200: `success`. An engine's failure
    still reaches the breaker (found by a review helper)."""
    chat = request_headers(chat_headers(**{"x-llmgw-model": "m1"}))
    stalled = StalledStream(chat, response_headers(status))
    with pytest.raises(asyncio.CancelledError):
        await server.process(stalled.unused(), stalled)
    assert total_inflight(server) == 0 and server.open_streams == 0
    metrics = server.telemetry.render()[0].decode()
    assert f'llmgw_requests_total{{model="m1",outcome="{outcome}"}} 1.0' in metrics
    assert 'outcome="success"' not in metrics


class ClosedByReset(StalledStream):
    """How Envoy ends a stream once nothing is left to process (its ext_proc client's close:
    a half-close, then a reset): the answers all written, grpc cancels the task waiting in
    `read`, most often before it sees the end of the stream."""

    async def read(self) -> ProcessingRequest | object:
        if self.messages:
            return self.messages.pop(0)
        raise asyncio.CancelledError

    async def write(self, _answer: bytes) -> None:
        return None


async def test_a_stream_envoy_closes_after_the_last_answer_keeps_the_answers_outcome(
    server: ExtProcServer,
) -> None:
    """Through a real Envoy 1.40 without response bodies, 53 of 60 whole 200s were counted
    `cancelled` (no success for the breaker, no first token counted for the engine), as if
    Envoy had reset the stream before an answer (found by a review helper)."""
    chat = request_headers(chat_headers(**{"x-llmgw-model": "m1"}))
    closed = ClosedByReset(chat, response_headers(200))
    with pytest.raises(asyncio.CancelledError):
        await server.process(closed.unused(), closed)
    assert total_inflight(server) == 0 and server.open_streams == 0
    metrics = server.telemetry.render()[0].decode()
    assert 'llmgw_requests_total{model="m1",outcome="success"} 1.0' in metrics
    assert 'outcome="cancelled"' not in metrics


async def ngf_shim(port: int, headers: dict[str, str], body: bytes) -> list[ProcessingResponse]:
    """What NGINX Gateway Fabric's shim (cmd/gateway/endpoint_picker.go) sends per request:
    the client's headers lower-cased in `value`, no pseudo-headers, no protocol_config; the
    whole body with end_of_stream; then it closes its side and reads answers until EOF."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = stream(channel)
        values = [HeaderValue(key=k.lower(), value=v) for k, v in headers.items()]
        await call.write(
            ProcessingRequest(request_headers=HttpHeaders(headers=HeaderMap(headers=values)))
        )
        await call.write(ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=True)))
        await call.done_writing()
        answers = []
        while (answer := await call.read()) is not grpc.aio.EOF:
            assert isinstance(answer, ProcessingResponse)
            answers.append(answer)
        return answers


async def test_nginx_gateway_fabrics_sequence_gets_the_endpoint_in_the_headers_answer(
    server: ExtProcServer,
) -> None:
    """NGF sends no `:path` and takes the endpoint only from a request_headers answer: llmgw
    read path "/" and answered 400 without reading the body (found by a review helper)."""
    payload = b'{"model": "m1", "messages": [{"role": "user", "content": "hello"}]}'
    headers = {"Content-Type": "application/json", "Content-Length": str(len(payload)),
               "User-Agent": "OpenAI/Python 1.0", "Accept": "application/json"}  # fmt: skip
    port = server.ports["grpc"]
    assert port is not None
    answers = await ngf_shim(port, headers, payload)
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    endpoint = set_headers(answers[0])["x-gateway-destination-endpoint"]
    assert endpoint.startswith("127.0.0.1:91")
    # NGF reports no response: the lease ends with the stream, as no verdict.
    await eventually(lambda: total_inflight(server) == 0)
    metrics = server.telemetry.render()[0].decode()
    assert 'outcome="unknown"} 1.0' in metrics and 'outcome="cancelled"' not in metrics


async def test_grpc_health_and_http_probes_follow_draining(server: ExtProcServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.ports['grpc']}") as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        assert await check(b"", timeout=DEADLINE) == b"\x08\x01"
        name = b"envoy.service.ext_proc.v3.ExternalProcessor"
        assert await check(b"\x0a" + bytes([len(name)]) + name) == b"\x08\x01"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await check(b"\x0a\x03foo")
        assert info.value.code() is grpc.StatusCode.NOT_FOUND
        async with aiohttp.ClientSession() as http:
            base = f"http://127.0.0.1:{server.ports['health']}"
            async with http.get(base + "/healthz") as r:
                assert r.status == 200
            async with http.get(base + "/readyz") as r:
                assert r.status == 200
            server.begin_drain()
            async with http.get(base + "/readyz") as r:
                assert r.status == 503
            async with http.get(base + "/healthz") as r:
                assert r.status == 200
        assert await check(b"", timeout=DEADLINE) == b"\x08\x02"


async def test_metrics_endpoint_serves_prometheus_text(server: ExtProcServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.ports['grpc']}") as channel:
        call = stream(channel)
        await call.write(request_headers(chat_headers(**{"x-llmgw-model": "m1"})))
        await call.read()
        await call.done_writing()
        await call.read()
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{server.ports['metrics']}/metrics") as r,
    ):
        text = await r.text()
    assert r.status == 200
    assert "llmgw_decisions_total" in text
    assert "llmgw_inflight" in text


async def test_stop_lets_open_streams_finish_within_grace() -> None:
    srv = ExtProcServer(
        make_config(),
        host="127.0.0.1",
        grpc_port=0,
        health_port=None,
        metrics_port=None,
        scrape=False,
    )
    await srv.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.ports['grpc']}") as channel:
        call = stream(channel)
        await call.write(request_headers(chat_headers(**{"x-llmgw-model": "m1"})))
        await call.read()
        stopping = asyncio.create_task(srv.stop(5.0))
        await eventually(lambda: srv.draining)
        await call.write(response_headers(200, end_of_stream=True))
        assert (await call.read()).WhichOneof("response") == "response_headers"
        await call.done_writing()
        await asyncio.wait_for(stopping, 5.0)
    assert total_inflight(srv) == 0


def test_parser_defaults_are_the_documented_ports() -> None:
    args = build_parser().parse_args(["--config", "x.yaml"])
    ports = (args.grpc_port, args.grpc_health_port, args.health_port, args.metrics_port)
    assert ports == (9002, 9003, 9004, 9090)
    assert not args.plaintext and args.tls_cert is None  # TLS (self-signed) by default


@pytest.mark.parametrize("workers", [1, 2])
def test_cli_serves_then_drains_on_sigterm(tmp_path: Path, workers: int) -> None:
    config = tmp_path / "llmgw.yaml"
    config.write_text("models:\n  m1:\n    endpoints: ['127.0.0.1:9100']\n    strategy: ring\n")
    ready = tmp_path / "ready.json"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmgw.cli",
            "extproc",
            "--config",
            str(config),
            "--host",
            "127.0.0.1",
            "--grpc-port",
            "0" if workers == 1 else str(free_port()),
            "--grpc-health-port",
            "0",
            "--health-port",
            "0",
            "--metrics-port",
            "0",
            "--no-scrape",
            "--ready-file",
            str(ready),
            "--workers",
            str(workers),
            "--log-level",
            "warning",
        ]
    )
    try:
        wait_for(ready.exists, 20, "ready file")
        ports = json.loads(ready.read_text())
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['health']}/readyz", timeout=5) as r:
            assert r.status == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


PORT_FLAGS = {
    "grpc": "--grpc-port",
    "grpc_health": "--grpc-health-port",
    "health": "--health-port",
    "metrics": "--metrics-port",
}


def bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize("taken", sorted(PORT_FLAGS))
async def test_a_port_in_use_is_a_start_error_naming_it_and_nothing_stays_open(
    taken: str,
) -> None:
    """A port in use was a RuntimeError or OSError, and what had started before it (the
    gRPC servers, the router) kept running (found by a review helper)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        ports = {name: port if name == taken else 0 for name in PORT_FLAGS}
        srv = ExtProcServer(
            make_config(),
            host="127.0.0.1",
            grpc_port=ports["grpc"],
            grpc_health_port=ports["grpc_health"],
            health_port=ports["health"],
            metrics_port=ports["metrics"],
            scrape=False,
        )
        flag = PORT_FLAGS[taken]
        with pytest.raises(StartError, match=rf"cannot listen on 127\.0\.0\.1:{port} \({flag}\)"):
            await srv.start()
    opened = [n for name, n in srv.ports.items() if name != taken and n]
    assert [n for n in opened if not bindable(n)] == []  # closed again
    assert not srv.router._started and srv._health_refresh is None


def test_cli_port_in_use_is_one_line_and_exit_3(tmp_path: Path) -> None:
    """`llmgw extproc` printed a traceback (two with the health port: the gRPC server it left
    running) and no line of its own (found by a review helper)."""
    config = tmp_path / "llmgw.yaml"
    config.write_text("models:\n  m1:\n    endpoints: ['127.0.0.1:9100']\n    strategy: ring\n")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run(
            [
                *(sys.executable, "-m", "llmgw.cli", "extproc", "--config", str(config)),
                *("--host", "127.0.0.1", "--plaintext", "--no-scrape", "--grpc-port", "0"),
                *("--grpc-health-port", "0", "--health-port", str(port), "--metrics-port", "0"),
            ],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    assert done.returncode == 3, done.stderr[-1500:]
    assert "Traceback" not in done.stderr, done.stderr[-1500:]
    line = f"llmgw extproc: cannot start: cannot listen on 127.0.0.1:{port} (--health-port)"
    assert line in done.stderr


def test_an_unknown_log_level_is_a_usage_error_as_on_the_proxy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--log-level verbose` crashed with a ValueError traceback from logging (the proxy
    refused it with a usage error). Found by a review helper."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--config", "x.yaml", "--log-level", "verbose"])
    assert info.value.code == 2
    assert "invalid choice: 'verbose'" in capsys.readouterr().err


NAMED = {  # each names an endpoint by host: behind Envoy, every request for it is a 503
    "static": {"endpoints": ["localhost:9100"]},
    "launched": {
        "launch": {"command": "vllm serve m --port {port}", "host": "localhost"},
        "scaling": {"min": 0, "max": 1},
    },
}
NAMED_PHRASE = {
    "static": "endpoint localhost:9100: behind Envoy, endpoints must be IP addresses",
    "launched": "models.m1.launch.host 'localhost': behind Envoy, endpoints must be IP addresses",
}


@pytest.mark.parametrize("kind", sorted(NAMED))
def test_a_host_name_endpoint_is_refused_at_start_as_envoy_config_refuses_it(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """original-dst's envoy.yaml lists no endpoints, so `envoy-config` never saw them and the
    server served a name (or an on-demand model's `launch.host: localhost`) that Envoy then
    answered with 503 on every request (found by a review helper)."""

    def served(*_: object) -> None:
        raise AssertionError("served a config naming an endpoint by host")

    monkeypatch.setattr(extproc_server, "_run_worker", served)
    path = tmp_path / "llmgw.yaml"
    path.write_text(json.dumps({"models": {"m1": NAMED[kind]}}))
    assert main(["--config", str(path), "--plaintext"]) == 2
    assert NAMED_PHRASE[kind] in capsys.readouterr().err
    with pytest.raises(ConfigError, match="behind Envoy"):
        ExtProcServer(load_dict({"models": {"m1": NAMED[kind]}}), scrape=False)


@pytest.mark.parametrize("kind", sorted(NAMED))
async def test_a_reload_naming_an_endpoint_by_host_is_rejected_and_the_old_config_kept(
    kind: str, tmp_path: Path, server: ExtProcServer
) -> None:
    """A reload took a host-name endpoint (no envoy-config run to refuse it): every request
    for the model was then Envoy's 503 (found by a review helper)."""
    before = server.config
    with pytest.raises(ConfigError) as info:
        server.reload(load_dict({"models": {"m1": NAMED[kind]}}))
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith(NAMED_PHRASE[kind])
    assert server.config is before
    path = tmp_path / "llmgw.yaml"
    path.write_text(json.dumps({"models": {"m1": NAMED[kind]}}))
    watcher = ConfigWatcher(path, server.reload, interval=0)
    assert watcher.reload() is False and watcher.rejected == 1  # logged, old config kept
    assert server.config is before
