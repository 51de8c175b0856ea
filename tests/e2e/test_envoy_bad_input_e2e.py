"""Through the real Envoy: TLS to ext_proc both ways, and the bad-input table of the README
(each case a clear status within 1 s, an OpenAI-shaped JSON error, inflight 0 after)."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import httpx
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmgw.extproc.envoyconfig import main as envoyconfig_main
from llmgw.extproc.tls import ServerTls
from llmgw.runtime.ports import free_port
from llmgw.sim import ThreadedFleet
from llmgw.testing.extproc import (
    EnvoyProcess,
    ExtProcThread,
    Stack,
    StackFactory,
    fleet_config,
    loopback_bootstrap,
    wait_for,
)
from llmgw.testing.rawhttp import read_http_message

JSON = {"content-type": "application/json"}  # engines (vLLM) refuse bodies sent as anything else

pytestmark = pytest.mark.e2e

LIMIT = 1 << 20  # limits.max_body_bytes in these tests (1 MiB)
CHAT = "/v1/chat/completions"


def chat_body(size: int) -> bytes:
    """A valid chat request of about `size` bytes."""
    pad = "x" * max(0, size - 80)
    return json.dumps({"model": "m1", "messages": [{"role": "user", "content": pad}]}).encode()


@pytest.mark.parametrize("shape", ["original-dst", "override-host"])
@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plaintext"])
def test_chat_through_envoy_with_and_without_tls_to_ext_proc(
    stack: StackFactory, shape: str, tls: bool
) -> None:
    s = stack(shape, tls=tls)
    r = httpx.post(s.url + CHAT, content=chat_body(100), headers=JSON, timeout=10)
    assert r.status_code == 200, r.text
    picked = r.headers["x-llmgw-decision"].split()[0].removeprefix("endpoint=")  # llmgw chose
    assert s.replica_index[picked] == int(r.headers["x-sim-replica"])
    assert (s.extproc.server.tls is not None) is tls


def test_envoy_verifies_the_ext_proc_certificate_with_extproc_ca(
    sim_fleet: ThreadedFleet, envoy_path: str, tmp_path: Path
) -> None:
    """`--extproc-ca`: the right CA routes; another CA fails closed (5xx), never plaintext."""
    pair, stranger = ServerTls.self_signed_pair(), ServerTls.self_signed_pair()
    (tmp_path / "ca.pem").write_bytes(pair.cert_pem)
    (tmp_path / "other.pem").write_bytes(stranger.cert_pem)
    config = fleet_config(sim_fleet)
    extproc = ExtProcThread(config, tls=pair)
    try:
        for ca, expected in (("ca.pem", 200), ("other.pem", 500)):
            bootstrap = loopback_bootstrap(
                config,
                extproc.address,
                shape="original-dst",
                extproc_ca=str(tmp_path / ca),
            )
            with EnvoyProcess(bootstrap) as envoy:
                r = httpx.post(envoy.url + CHAT, content=chat_body(100), headers=JSON, timeout=10)
                assert r.status_code == expected, (ca, r.status_code, r.text)
    finally:
        extproc.stop()


def test_the_commands_defaults_talk_tls_and_answer_gie_health_names(
    sim_fleet: ThreadedFleet, envoy_path: str, tmp_path: Path
) -> None:
    """`llmgw extproc` (self-signed TLS by default) behind `llmgw envoy-config` (TLS by
    default), as the README runs them; GIE's probe names on the gRPC health port."""
    config = tmp_path / "llmgw.yaml"
    endpoints = [f"127.0.0.1:{p}" for p in sim_fleet.ports]
    config.write_text(yaml.safe_dump({"models": {"m1": {"endpoints": endpoints}}}))
    ready, grpc_port = tmp_path / "ready.json", free_port()
    command = [sys.executable, "-m", "llmgw.cli", "extproc", "--config", str(config)]
    command += ["--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--grpc-health-port", "0"]
    command += ["--health-port", "0", "--metrics-port", "0", "--ready-file", str(ready)]
    command += ["--log-level", "warning"]
    process = subprocess.Popen(command)
    try:
        wait_for(ready.exists, 20, "llmgw extproc ready")
        ports = json.loads(ready.read_text())
        envoy_yaml, listen, admin = tmp_path / "envoy.yaml", free_port(), free_port()
        argv = ["--config", str(config), "--shape", "override-host", "--out", str(envoy_yaml)]
        argv += ["--listen", f"127.0.0.1:{listen}", "--admin", f"127.0.0.1:{admin}"]
        assert envoyconfig_main([*argv, "--extproc", f"127.0.0.1:{grpc_port}"]) == 0
        with EnvoyProcess(yaml.safe_load(envoy_yaml.read_text())) as envoy:
            r = httpx.post(envoy.url + CHAT, content=chat_body(100), headers=JSON, timeout=10)
            assert r.status_code == 200, r.text
        with grpc.insecure_channel(f"127.0.0.1:{ports['grpc_health']}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("liveness", "readiness", "inference-extension"):
                answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
    finally:
        process.terminate()
        process.wait(15)


def _raw_status(stack: Stack, head: bytes, body: bytes) -> tuple[int, bytes, float]:
    """Send the request on a raw socket (the body from a thread, so a response that comes
    before the body is read is seen at once); (status, body, seconds to the status line)."""
    port = int(stack.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        started = time.monotonic()
        sock.sendall(head)

        def send_body() -> None:
            # Envoy may answer and close before the whole body is sent (413): expected.
            with contextlib.suppress(OSError):
                sock.sendall(body)

        writer = threading.Thread(target=send_body, daemon=True)
        writer.start()
        head, rest = read_http_message(sock)
        elapsed = time.monotonic() - started
        status = int(head.split(b" ", 2)[1]) if head else 0
        writer.join(5)
        return status, rest, elapsed


def _post(stack: Stack, body: bytes, extra_headers: dict[str, str] | None = None) -> bytes:
    head = (
        f"POST {CHAT} HTTP/1.1\r\nhost: llm\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
    )
    head += "".join(f"{k}: {v}\r\n" for k, v in (extra_headers or {}).items())
    return (head + "\r\n").encode()


def _answer(stack: Stack, data: bytes) -> tuple[bytes, dict[str, Any]]:
    """Raw bytes in; (status line, JSON error) out, reading to Envoy's close (past the
    `100 Continue` Envoy sends itself to a request that expects one)."""
    port = int(stack.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    answer = answer.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    return head.split(b"\r\n", 1)[0], json.loads(body)["error"] if body else {}


def _headers(count: int) -> dict[str, str]:
    return {f"x-extra-{i}": "v" for i in range(count)}


NESTED = b'{"model": "m1", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
BAD_UTF8 = b'{"model": "m1", "messages": [{"role": "user", "content": "\xff\xfe"}]}'

# name -> (body, extra headers, expected status, expected error code)
CASES: dict[str, tuple[Callable[[], bytes], dict[str, str], int, str]] = {
    "body 1.05 MB": (lambda: chat_body(1_050_000), {}, 413, "body_too_large"),
    "body 2 MB": (lambda: chat_body(2_000_000), {}, 413, "body_too_large"),
    "body 10 MB": (lambda: chat_body(10_000_000), {}, 413, "body_too_large"),
    "100 headers": (lambda: chat_body(100), _headers(100), 431, "headers_too_large"),
    "1,000 headers": (lambda: chat_body(100), _headers(1000), 431, "headers_too_large"),
    "nested JSON": (lambda: NESTED, {}, 400, "invalid_request"),
    "bad UTF-8": (lambda: BAD_UTF8, {}, 400, "invalid_request"),
}


@pytest.mark.parametrize("shape", ["original-dst", "override-host"])
def test_bad_input_gets_a_clear_status_and_json_error_at_once(
    stack: StackFactory, sim_fleet: ThreadedFleet, shape: str
) -> None:
    s = stack(shape, config=fleet_config(sim_fleet, limits={"max_body_bytes": LIMIT}))
    failures = []
    for name, (make_body, headers, status, code) in CASES.items():
        body = make_body()
        got, payload, elapsed = _raw_status(s, _post(s, body, headers), body)
        error = json.loads(payload)["error"] if payload.startswith(b"{") else {}
        if got != status or error.get("code") != code or elapsed > 1.0:
            failures.append(f"{name}: {got} {payload[:120]!r} in {elapsed:.2f}s")
        wait_for(lambda: sum(s.extproc.inflight().values()) == 0, 5, f"inflight 0 after {name}")
    assert not failures, "\n".join(failures)
    # A request at the header limit (85 from the client, 90 with Envoy's own) still passes.
    body = chat_body(100)
    status, _, _ = _raw_status(s, _post(s, body, _headers(85 - 3)), body)
    assert status == 200


def _decisions(stack: Stack) -> float:
    text = stack.extproc.server.telemetry.render()[0].decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("llmgw_decisions_total{")
    )


def test_client_abort_mid_body_never_reaches_ext_proc(stack: StackFactory) -> None:
    s = stack("override-host")
    port = int(s.url.rsplit(":", 1)[1])
    body = chat_body(200_000)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(_post(s, body))
        sock.sendall(body[: len(body) // 2])  # then hang up with half the body sent
    r = httpx.post(s.url + CHAT, content=chat_body(100), headers=JSON, timeout=10)
    assert r.status_code == 200
    # The buffer filter held the aborted request: only the good one was decided.
    assert _decisions(s) == 1
    wait_for(lambda: sum(s.extproc.inflight().values()) == 0, 5, "inflight 0 after abort")


def test_a_stalled_head_gets_408_and_a_wrong_method_405_in_json(
    stack: StackFactory, sim_fleet: ThreadedFleet
) -> None:
    """The proxy's head deadline and method check hold behind Envoy too (its
    `request_headers_timeout` from `limits.client_header_timeout`, ext_proc's 405)."""
    s = stack("original-dst", config=fleet_config(sim_fleet, limits={"client_header_timeout": 0.5}))
    line, error = _answer(s, f"POST {CHAT} HTTP/1.1\r\nhost: llm\r\nx-half".encode())
    assert line.startswith(b"HTTP/1.1 408") and error["code"] == "request_timeout", line
    wrong = httpx.get(s.url + CHAT, timeout=10)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["code"] == "method_not_allowed"
    assert _decisions(s) == 0


def _h2_post(port: int, body: bytes, *, trailers: bool) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/2 (prior knowledge) POST, optionally ending in trailers, as gRPC-style
    clients send them (httpx cannot send trailers)."""
    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
    )
    conn.initiate_connection()
    stream = conn.get_next_available_stream_id()
    head = [(":method", "POST"), (":path", CHAT), (":scheme", "http"), (":authority", "llm")]
    conn.send_headers(stream, [*head, ("content-type", "application/json")])
    if body:
        conn.send_data(stream, body, end_stream=not trailers)
    if trailers:
        conn.send_headers(stream, [("x-checksum", "1")], end_stream=True)
    headers: dict[str, str] = {}
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(conn.data_to_send())
        ended = False
        while not ended and (chunk := sock.recv(65536)):
            for event in conn.receive_data(chunk):
                if isinstance(event, h2.events.ResponseReceived):
                    headers = {str(k): str(v) for k, v in event.headers}
                elif isinstance(event, h2.events.DataReceived):
                    data += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, stream)
                ended |= isinstance(event, h2.events.StreamEnded | h2.events.StreamReset)
            sock.sendall(conn.data_to_send())
    return int(headers.get(":status", 0)), headers, data


@pytest.mark.parametrize("body_mode", ["override", "buffered", "gie"])
def test_http2_requests_with_trailers_are_routed_or_refused_by_llmgw(
    stack: StackFactory, body_mode: str
) -> None:
    """Trailers end the body without end_of_stream. A body they end used to pass unrouted
    through llmgw's own mode (to the fallback route); trailers after no body, unrouted in
    the buffered modes, reached the engine for its own 400."""
    s = stack("original-dst", body_mode=body_mode)
    port = int(s.url.rsplit(":", 1)[1])
    status, headers, data = _h2_post(port, chat_body(300), trailers=True)
    assert status == 200, data[:200]
    picked = headers["x-llmgw-decision"].split()[0].removeprefix("endpoint=")
    assert s.replica_index[picked] == int(headers["x-sim-replica"])
    status, _, data = _h2_post(port, b"", trailers=True)
    assert status == 400
    assert json.loads(data)["error"]["code"] == "invalid_request", data[:200]
    assert _decisions(s) == 1
    wait_for(lambda: sum(s.extproc.inflight().values()) == 0, 5, "inflight 0 after both")


MALFORMED = {
    "garbage request line": (b"GARBAGE\r\n\r\n", b"400"),
    "content-length and chunked": (
        f"POST {CHAT} HTTP/1.1\r\nhost: llm\r\ncontent-length: 5\r\n"
        "transfer-encoding: chunked\r\n\r\n0\r\n\r\n".encode(),
        b"400",
    ),
    "HTTP/1.0": (f"POST {CHAT} HTTP/1.0\r\ncontent-length: 2\r\n\r\n{{}}".encode(), b"426"),
}


@pytest.mark.parametrize("shape", ["original-dst", "override-host"])
def test_envoys_own_replies_to_malformed_requests_reach_the_client_in_json(
    stack: StackFactory, shape: str
) -> None:
    """With ext_proc in the chain, these replies waited for an ext_proc answer to their
    response headers and the connection closed first: the client got nothing."""
    s = stack(shape)
    for name, (data, status) in MALFORMED.items():
        line, error = _answer(s, data)
        assert line.split(b" ")[1] == status, (name, line)
        assert error["code"] == "invalid_request" and error["message"], (name, error)
    assert _decisions(s) == 0


def test_a_dead_endpoint_and_a_stopped_ext_proc_are_json_errors(
    stack: StackFactory, sim_fleet: ThreadedFleet
) -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    config = fleet_config(sim_fleet, models={"m1": {"endpoints": [dead], "strategy": "ring"}})
    s = stack("original-dst", config=config)
    r = httpx.post(s.url + CHAT, content=chat_body(100), headers=JSON, timeout=10)
    assert r.status_code == 503 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == "upstream_unreachable", r.text
    assert "connect" in r.json()["error"]["message"]
    s.extproc.stop()
    r = httpx.post(s.url + CHAT, content=chat_body(100), headers=JSON, timeout=10)
    assert r.status_code == 500 and r.json()["error"]["code"] == "router_unavailable", r.text


def test_a_request_routed_at_the_headers_still_reports_its_outcome(
    stack: StackFactory, sim_fleet: ThreadedFleet
) -> None:
    """llmgw's own mode leaves response headers off in Envoy's config; the headers answer
    of a request it routes turns them on (the debug header is set in that answer)."""
    s = stack("original-dst", config=fleet_config(sim_fleet, strategy="ring"))
    r = httpx.post(s.url + CHAT, content=chat_body(100), headers={**JSON, "x-llmgw-model": "m1"})
    assert r.status_code == 200, r.text
    picked = r.headers["x-llmgw-decision"].split()[0].removeprefix("endpoint=")
    assert s.replica_index[picked] == int(r.headers["x-sim-replica"])
    assert "x-llmgw-upstream" not in r.headers  # stripped in the response headers answer
    wait_for(lambda: sum(s.extproc.inflight().values()) == 0, 5, "inflight 0")


@pytest.mark.parametrize("expect", [False, True], ids=["plain", "expect 100-continue"])
def test_a_declared_body_over_the_limit_is_413_before_any_of_it_is_sent(
    stack: StackFactory, sim_fleet: ThreadedFleet, expect: bool
) -> None:
    """As the proxy does. The buffer filter alone reads up to the limit first: an upload
    declared at 10 MB sent 1 MB before its 413, and one that has sent nothing yet (after
    Envoy's own 100 Continue, here) got no answer."""
    s = stack("original-dst", config=fleet_config(sim_fleet, limits={"max_body_bytes": LIMIT}))
    head = _post(s, b"", {"expect": "100-continue"} if expect else None)
    head = head.replace(b"content-length: 0", b"content-length: %d" % (10 * LIMIT))
    line, error = _answer(s, head)  # and none of the body
    assert line.startswith(b"HTTP/1.1 413") and error["code"] == "body_too_large", line
    assert _decisions(s) == 0
