"""gRPC health with GIE's service names on the health port, and TLS on the ext_proc port."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import orjson
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmgw.errors import ConfigError
from llmgw.extproc.server import ExtProcServer, build_parser, server_tls
from llmgw.extproc.tls import ServerTls
from llmgw.runtime.controlplanes import StartError
from llmgw.runtime.health import readiness
from llmgw.testing.extproc import make_config
from llmgw.testing.net import ipv6_loopback
from llmgw.testing.wait import eventually

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"


async def start(**options: object) -> ExtProcServer:
    options.setdefault("config", make_config())
    options.setdefault("host", "127.0.0.1")
    srv = ExtProcServer(
        grpc_port=0,
        grpc_health_port=0,
        metrics_port=None,
        scrape=False,
        **{"health_port": None, **options},  # type: ignore[arg-type]
    )
    await srv.start()
    return srv


@pytest.fixture
async def server() -> AsyncIterator[ExtProcServer]:
    srv = await start()
    yield srv
    await srv.stop(1.0)


async def check(port: int | None, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        answer = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return int(answer.status)


async def test_health_port_answers_gie_service_names(server: ExtProcServer) -> None:
    port = server.ports["grpc_health"]
    for service in ("liveness", "readiness", "inference-extension", "", EXT_PROC):
        assert await check(port, service) == SERVING, service
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await check(port, "no-such-service")
    assert info.value.code() is grpc.StatusCode.NOT_FOUND
    assert "liveness" in (info.value.details() or "")  # says which names exist


async def test_list_reports_every_name(server: ExtProcServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.ports['grpc_health']}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        server.begin_drain()
        answer = await stub.List(health_pb2.HealthListRequest(), timeout=5)
    statuses = {name: status.status for name, status in answer.statuses.items()}
    assert statuses == {
        "liveness": SERVING,
        "readiness": NOT_SERVING,
        "inference-extension": NOT_SERVING,
        "": NOT_SERVING,
        EXT_PROC: NOT_SERVING,
    }


async def test_draining_fails_readiness_names_but_not_liveness(server: ExtProcServer) -> None:
    port = server.ports["grpc_health"]
    server.begin_drain()
    assert await check(port, "liveness") == SERVING  # like /healthz: alive while draining
    for service in ("readiness", "inference-extension", ""):
        assert await check(port, service) == NOT_SERVING, service
    assert await check(server.ports["grpc"], "") == NOT_SERVING  # the ext_proc port's own


async def test_readiness_stays_serving_when_no_endpoint_is_available() -> None:
    """Every endpoint's breaker open: the router stays in its Service (it answers a clear
    503), and /readyz's body says no model is routable."""
    srv = await start()
    try:
        registry = srv.router.registry
        now = registry.clock()
        for state in registry.states("m1"):
            for _ in range(50):
                state.breaker.record(False, now)
        assert not any(s.breaker.available(now) for s in registry.states("m1"))
        assert await check(srv.ports["grpc_health"], "readiness") == SERVING
        assert await check(srv.ports["grpc_health"], "liveness") == SERVING
        assert await check(srv.ports["grpc"], EXT_PROC) == SERVING
        ready, body = readiness(srv.router, started=True, draining=False)
        assert ready and orjson.loads(body)["routable"] is False
    finally:
        await srv.stop(1.0)


async def test_a_failed_start_closes_the_health_port_it_opened() -> None:
    """Discovery refused (RBAC) after the probe port opened: nothing stays listening."""
    srv = ExtProcServer(
        make_config(), host="127.0.0.1", grpc_port=0, grpc_health_port=0, health_port=None,
        metrics_port=None, scrape=False,
    )  # fmt: skip

    async def refused() -> None:
        raise StartError("RBAC: may not list endpointslices")

    srv.router.start = refused  # type: ignore[method-assign]
    with pytest.raises(StartError):
        await srv.start()
    port = srv.ports["grpc_health"]
    assert port
    with pytest.raises(grpc.aio.AioRpcError):
        await check(port, "liveness")


async def test_watch_on_the_probe_port_agrees_with_check_while_the_router_starts() -> None:
    """The probe port serves while the router starts (discovery waits for its first list):
    Check said liveness SERVING, readiness NOT_SERVING, but Watch said SERVICE_UNKNOWN for
    both until the start was over (found by a review helper)."""
    srv = ExtProcServer(
        make_config(), host="127.0.0.1", grpc_port=0, grpc_health_port=0, health_port=None,
        metrics_port=None, scrape=False,
    )  # fmt: skip
    release = asyncio.Event()
    real_start = srv.router.start

    async def slow_start() -> None:  # Kubernetes discovery waiting for its first list
        await release.wait()
        await real_start()

    srv.router.start = slow_start  # type: ignore[method-assign]
    start = asyncio.create_task(srv.start())
    try:
        await eventually(lambda: bool(srv.ports.get("grpc_health")))
        port = srv.ports["grpc_health"]
        assert await check(port, "liveness") == SERVING
        assert await check(port, "readiness") == NOT_SERVING
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            live = stub.Watch(health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
            ready = stub.Watch(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
            assert (await live.read()).status == SERVING
            assert (await ready.read()).status == NOT_SERVING
            release.set()
            assert (await ready.read()).status == SERVING  # the start is over
            live.cancel()
            ready.cancel()
    finally:
        release.set()
        await start
        await srv.stop(1.0)


async def test_watch_streams_see_the_drain(server: ExtProcServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.ports['grpc_health']}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service="readiness"))
        first = await asyncio.wait_for(watch.read(), 5)
        assert first.status == SERVING
        server.begin_drain()
        second = await asyncio.wait_for(watch.read(), 5)
        assert second.status == NOT_SERVING
        watch.cancel()


async def test_self_signed_tls_serves_ext_proc_and_refuses_plaintext_clients() -> None:
    tls = ServerTls.self_signed_pair()
    srv = await start(tls=tls)
    try:
        target = f"127.0.0.1:{srv.ports['grpc']}"
        credentials = grpc.ssl_channel_credentials(root_certificates=tls.cert_pem)
        async with grpc.aio.secure_channel(target, credentials) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            answer = await stub.Check(health_pb2.HealthCheckRequest(service=EXT_PROC), timeout=5)
            assert answer.status == SERVING
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await check(srv.ports["grpc"], "")
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        await srv.stop(1.0)


def test_tls_files_are_read_and_bad_files_are_named(tmp_path: Path) -> None:
    pair = ServerTls.self_signed_pair()
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(pair.cert_pem)
    key.write_bytes(pair.key_pem)
    loaded = ServerTls.from_files(str(cert), str(key))
    assert loaded.cert_pem == pair.cert_pem and not loaded.self_signed
    with pytest.raises(ConfigError, match=r"(?s)--tls-key.*cannot read"):
        ServerTls.from_files(str(cert), str(tmp_path / "missing.key"))
    (tmp_path / "junk").write_text("not a certificate")
    with pytest.raises(ConfigError, match=r"(?s)--tls-cert.*not a PEM file"):
        ServerTls.from_files(str(tmp_path / "junk"), str(key))


def test_a_key_that_is_not_the_certificates_is_a_config_error(tmp_path: Path) -> None:
    """gRPC accepts any PEM pair and fails only at bind: "Failed to bind to address", a
    traceback that reads as a port conflict, instead of naming the files (exit code 2)."""
    one, other = ServerTls.self_signed_pair(), ServerTls.self_signed_pair()
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(one.cert_pem)
    key.write_bytes(other.key_pem)
    with pytest.raises(ConfigError, match=r"(?s)--tls-key.*not the private key of"):
        ServerTls.from_files(str(cert), str(key))
    # The flags swapped: a PEM file each, but neither where it belongs.
    key.write_bytes(one.key_pem)
    with pytest.raises(ConfigError, match=r"(?s)--tls-cert.*no PEM certificate"):
        ServerTls.from_files(str(key), str(cert))


def test_tls_flags_default_to_self_signed_and_reject_contradictions() -> None:
    parse = build_parser().parse_args
    default = server_tls(parse(["--config", "x"]))
    assert default is not None and default.self_signed
    assert server_tls(parse(["--config", "x", "--plaintext"])) is None
    with pytest.raises(ConfigError, match="go together"):
        server_tls(parse(["--config", "x", "--tls-cert", "a.pem"]))
    with pytest.raises(ConfigError, match="cannot be combined"):
        server_tls(parse(["--config", "x", "--plaintext", "--tls-cert", "a", "--tls-key", "b"]))


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback")
@pytest.mark.parametrize("host", ["::1", "[::1]"])
async def test_the_server_listens_on_an_ipv6_host_written_bare_or_bracketed(host: str) -> None:
    """`--host` binds every port; on an IPv6 cluster the kubelet probes 9003 and gateways
    dial 9002 at the pod's IPv6 address. Bare, gRPC read `::1:0` as a host name; bracketed,
    aiohttp could not resolve `[::1]`: no spelling started (found by a review helper)."""
    srv = await start(host=host, health_port=0)
    try:
        async with grpc.aio.insecure_channel(f"[::1]:{srv.ports['grpc_health']}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            answer = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))
        assert answer.status == SERVING
        reader, writer = await asyncio.open_connection("::1", srv.ports["health"])
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        head = await reader.readline()
        writer.close()
        assert head.startswith(b"HTTP/1.1 200"), head
    finally:
        await srv.stop(1.0)
