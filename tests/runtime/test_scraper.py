from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from llmgw import promtext
from llmgw.config import endpoints_of, load_dict
from llmgw.discovery import join
from llmgw.registry import Registry
from llmgw.runtime import scraper as scraper_module
from llmgw.runtime.httpget import HttpGetError, KeepAliveGetter
from llmgw.runtime.scraper import Scraper, Target
from llmgw.testing.wait import eventually
from llmgw.types import Endpoint

VLLM_PAGE = """# HELP vllm:num_requests_waiting waiting
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{model}"}} {waiting}
vllm:num_requests_running{{engine="0",model_name="{model}"}} 2.0
vllm:kv_cache_usage_perc{{engine="0",model_name="{model}"}} 0.25
"""


@dataclass
class FakeServer:
    """Answers GET /metrics with whatever `respond` returns (raw HTTP bytes, or None = hang)."""

    respond: Callable[[], bytes | None]
    connections: int = 0
    closed: int = 0  # connections the scraper closed (or the server ended)
    requests: int = 0
    paths: list[str] = field(default_factory=list)  # each request's target
    hang: asyncio.Event = field(default_factory=asyncio.Event)
    port: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.paths.append(head.split(b" ", 2)[1].decode())
                self.requests += 1
                data = self.respond()
                if data is None:
                    await self.hang.wait()
                    return
                writer.write(data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed += 1
            writer.close()


def ok(body: str, *, chunked: bool = False) -> bytes:
    raw = body.encode()
    if chunked:
        half = len(raw) // 2
        chunks = b"".join(
            f"{len(c):x}\r\n".encode() + c + b"\r\n" for c in (raw[:half], raw[half:])
        )
        return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(raw), raw)


@pytest.fixture
async def server() -> AsyncIterator[FakeServer]:
    fake = FakeServer(respond=lambda: ok(VLLM_PAGE.format(model="m", waiting=3)))
    srv = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    fake.port = srv.sockets[0].getsockname()[1]
    async with srv:
        yield fake
        fake.hang.set()
        srv.close()


def make_scraper(
    port: int, interval: float | None = None, **extra: object
) -> tuple[Scraper, Registry]:
    scrape: dict[str, float] = {"timeout": 0.3}
    if interval is not None:
        scrape["interval"] = interval
    config = load_dict(
        {"models": {"m": {"endpoints": [f"127.0.0.1:{port}"], **extra}}, "scrape": scrape}
    )
    registry = Registry()
    registry.set_endpoints("m", endpoints_of("m", config.models["m"]))
    return Scraper(config, registry), registry


async def test_scrape_feeds_registry_and_reuses_the_connection(server: FakeServer) -> None:
    scraper, registry = make_scraper(server.port)
    await scraper.scrape_once()
    await scraper.scrape_once()
    state = registry.states("m")[0]
    assert state.metrics is not None
    assert (state.metrics.waiting, state.metrics.running, state.metrics.kv_usage) == (3, 2, 0.25)
    assert server.requests == 2 and server.connections == 1
    await scraper.stop()


async def test_chunked_responses_are_read(server: FakeServer) -> None:
    server.respond = lambda: ok(VLLM_PAGE.format(model="m", waiting=7), chunked=True)
    scraper, registry = make_scraper(server.port)
    await scraper.scrape_once()
    assert registry.states("m")[0].metrics is not None
    assert registry.states("m")[0].metrics.waiting == 7  # type: ignore[union-attr]
    await scraper.stop()


@pytest.mark.parametrize(
    ("response", "needle"),
    [
        (b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n", "HTTP 500"),
        (ok("this is not prometheus text\n"), "vllm:num_requests_waiting"),
        (b"garbage\r\n\r\n", "bad status line"),
        (None, "timeout"),
    ],
    ids=["http-500", "garbage-page", "garbage-http", "hang"],
)
async def test_failed_scrape_marks_stale_and_never_trips_the_breaker(
    server: FakeServer, response: bytes | None, needle: str
) -> None:
    server.respond = lambda: response
    scraper, registry = make_scraper(server.port)
    await scraper.scrape_once()
    state = registry.states("m")[0]
    assert state.metrics is None
    assert state.scrape_error is not None and needle in state.scrape_error
    assert state.breaker.state.value == "closed"
    assert scraper.errors[f"127.0.0.1:{server.port}"] == 1
    await scraper.stop()


async def test_page_for_another_model_marks_model_not_served(server: FakeServer) -> None:
    server.respond = lambda: ok(VLLM_PAGE.format(model="other", waiting=1))
    scraper, registry = make_scraper(server.port)
    await scraper.scrape_once()
    assert registry.states("m")[0].serves_model is False
    await scraper.stop()


@pytest.mark.parametrize("model", ["m", "other"])
def test_a_page_is_read_once_whether_or_not_it_has_the_model(
    monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    """A page without the model's series was read twice, the second time to tell whether
    it served other models: twice the event loop's time on an 8 MB page (found by a review
    helper)."""
    reads: list[int] = []
    iter_samples = promtext.iter_samples

    def counted(text: str, names: Collection[str] | None = None) -> Iterator[promtext.Sample]:
        reads.append(len(text))
        return iter_samples(text, names)

    monkeypatch.setattr(promtext, "iter_samples", counted)
    scraper, registry = make_scraper(1)
    address = registry.states("m")[0].id
    assert scraper.ingest(
        address, scraper.targets()[address], VLLM_PAGE.format(model=model, waiting=1)
    ) is (model == "m")
    assert registry.states("m")[0].serves_model is (model == "m")
    assert len(reads) == 1


async def test_served_name_and_metric_overrides(server: FakeServer) -> None:
    page = 'q{model_name="served"} 4\nr{model_name="served"} 1\nkv{model_name="served"} 0.5\n'
    server.respond = lambda: ok(page)
    scraper, registry = make_scraper(
        server.port,
        served_name="served",
        metrics={"waiting": "q", "running": "r", "kv_usage": "kv"},
    )
    await scraper.scrape_once()
    m = registry.states("m")[0].metrics
    assert m is not None and (m.waiting, m.running, m.kv_usage) == (4, 1, 0.5)
    await scraper.stop()


async def test_background_loop_scrapes_repeatedly(server: FakeServer) -> None:
    scraper, registry = make_scraper(server.port, interval=0.01)
    await scraper.start()
    async with asyncio.timeout(5):
        while server.requests < 3:
            await asyncio.sleep(0.01)  # polling a condition under a deadline, not synchronisation
    await scraper.stop()
    assert registry.states("m")[0].metrics is not None


async def test_an_endpoint_that_leaves_has_its_connection_closed(server: FakeServer) -> None:
    """Pods come and go under new IPs: a departed address's kept-alive connection must go
    with it (they were kept, half-closed once the engine timed them out: an fd each)."""
    scraper, registry = make_scraper(server.port, interval=0.01)
    await scraper.start()
    try:
        await eventually(lambda: server.requests >= 1)
        assert server.closed == 0
        registry.set_endpoints("m", [])
        await eventually(lambda: server.closed == 1)
        assert scraper._getters == {}
        await eventually(lambda: not scraper.scrapes)  # its per-address counts went too
    finally:
        await scraper.stop()


async def test_getter_reports_connection_refused() -> None:
    srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    srv.close()
    await srv.wait_closed()
    getter = KeepAliveGetter("127.0.0.1", port)
    with pytest.raises(HttpGetError):
        await getter.get("/metrics")


async def test_a_body_ended_by_the_servers_close_is_read_to_the_end() -> None:
    """No length, not chunked (HTTP/1.0 servers, `http.server` simulators): one read took
    only what had arrived, and a page sent in two writes was cut."""
    body = b"".join(b'vllm:num_requests_waiting{pad="%d"} 0\n' % i for i in range(2000))
    half = asyncio.Event()
    release = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\n" + body[:1000])
        await writer.drain()
        half.set()
        await release.wait()
        writer.write(body[1000:])
        await writer.drain()
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    async with srv:
        getter = KeepAliveGetter("127.0.0.1", port)
        got = asyncio.create_task(getter.get("/metrics"))
        await eventually(half.is_set)  # the client has the first part (the cut took it)
        release.set()
        status, page = await asyncio.wait_for(got, 5)
        await getter.close()
    assert (status, len(page)) == (200, len(body))


def test_an_ipv6_hosts_header_is_bracketed() -> None:
    assert join("::1", 8000) == "[::1]:8000"
    assert join("10.0.0.1", 8000) == "10.0.0.1:8000"


@pytest.mark.parametrize(
    ("extra", "path"),
    [
        ({}, "/metrics"),
        ({"engine": "trtllm"}, "/prometheus/metrics"),  # trtllm-serve's /metrics is JSON
        ({"metrics": {"path": "/stats/prometheus"}}, "/stats/prometheus"),
    ],
)
async def test_each_engine_is_scraped_where_it_serves_prometheus_text(
    server: FakeServer, extra: dict[str, object], path: str
) -> None:
    scraper, _ = make_scraper(server.port, None, **extra)
    await scraper.scrape_once()
    await scraper.stop()
    assert server.paths == [path]


async def test_an_http_1_0_exporter_is_scraped_every_time() -> None:
    """prometheus_client's own `start_http_server` answers HTTP/1.0 with a length and closes:
    the getter kept the connection, so every second scrape failed on the closed socket and
    a healthy engine's metrics went stale (found by a review helper)."""
    exporter = CollectorRegistry()
    for name, value in (
        ("vllm:num_requests_waiting", 1.0),
        ("vllm:num_requests_running", 2.0),
        ("vllm:kv_cache_usage_perc", 0.5),
    ):
        Gauge(name, name, ["model_name"], registry=exporter).labels("m").set(value)
    http, thread = start_http_server(0, addr="127.0.0.1", registry=exporter)
    try:
        scraper, registry = make_scraper(http.server_port)
        for _ in range(4):
            await scraper.scrape_once()
        state = registry.states("m")[0]
        address = f"127.0.0.1:{http.server_port}"
        assert (scraper.scrapes[address], scraper.errors[address]) == (4, 0), state.scrape_error
        assert state.scrape_error is None
        await scraper.stop()
    finally:
        http.shutdown()
        http.server_close()
        thread.join(5)


async def test_an_http_1_0_answer_that_asks_for_keep_alive_keeps_the_connection() -> None:
    """HTTP/1.0 closes after each answer unless it says `Connection: keep-alive`."""
    page = ok(VLLM_PAGE.format(model="m", waiting=1)).replace(
        b"HTTP/1.1 200 OK\r\n", b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\n"
    )
    fake = FakeServer(respond=lambda: page)
    srv = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    async with srv:
        getter = KeepAliveGetter("127.0.0.1", srv.sockets[0].getsockname()[1])
        for _ in range(3):
            assert (await getter.get("/metrics"))[0] == 200
        await getter.close()
        fake.hang.set()
    assert (fake.requests, fake.connections) == (3, 1)


async def test_an_idle_connection_the_engine_closed_is_not_a_failed_scrape() -> None:
    """uvicorn (vLLM, SGLang, trtllm-serve) closes a kept-alive connection idle for 5 s: with
    `scrape.interval` past that, the getter wrote the next request on it, and every second
    scrape failed (found by a review helper)."""
    page = ok(VLLM_PAGE.format(model="m", waiting=1))
    fake = FakeServer(respond=lambda: page)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        fake.connections += 1
        await reader.readuntil(b"\r\n\r\n")
        fake.requests += 1
        writer.write(page)  # HTTP/1.1, kept alive ... until idle too long
        await writer.drain()
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with srv:
        getter = KeepAliveGetter("127.0.0.1", srv.sockets[0].getsockname()[1])
        assert (await getter.get("/metrics"))[0] == 200
        reader = getter._reader
        assert reader is not None
        await eventually(reader.at_eof)  # the engine's close reached this side
        assert (await getter.get("/metrics"))[0] == 200
        await getter.close()
    assert (fake.requests, fake.connections) == (2, 2)


async def test_a_reused_connection_closed_as_the_request_arrives_is_retried_once() -> None:
    """The engine's idle close crossing the next request (its FIN not yet read): the reused
    connection ends before any byte of an answer; the getter asks once more on a new
    connection. A new connection that ends so is an error (found by a review helper)."""
    page = ok(VLLM_PAGE.format(model="m", waiting=1))
    fake = FakeServer(respond=lambda: page)
    answer_first_only = True

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        fake.connections += 1
        try:
            await reader.readuntil(b"\r\n\r\n")
            fake.requests += 1
            if answer_first_only:
                writer.write(page)
                await writer.drain()
                await reader.readuntil(b"\r\n\r\n")  # the next request: closed unanswered
                fake.requests += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with srv:
        getter = KeepAliveGetter("127.0.0.1", srv.sockets[0].getsockname()[1])
        assert (await getter.get("/metrics"))[0] == 200
        assert (await getter.get("/metrics"))[0] == 200  # conn 1 ends: asked again on conn 2
        assert (fake.requests, fake.connections) == (3, 2)
        answer_first_only = False
        await getter.close()
        with pytest.raises(HttpGetError, match="IncompleteReadError"):
            await getter.get("/metrics")  # a fresh connection: no second try
        assert (fake.requests, fake.connections) == (4, 3)


@pytest.mark.parametrize("overrides", [False, True], ids=["built-in", "metric-overrides"])
async def test_one_scrape_round_walks_the_endpoints_a_bounded_number_of_times(
    monkeypatch: pytest.MonkeyPatch, overrides: bool
) -> None:
    """Each address's loop recomputes `Scraper.targets()` (a walk over every endpoint of
    every model, building a Target, and with `metrics:` overrides a new MetricContract, per
    endpoint) before each of its scrapes: N loops x N endpoints per interval. At 256
    endpoints with overrides that held the event loop ~290 ms at a time (p50 lag of a 10 ms
    timer) and only ~30 % of the scrapes happened; with the targets cached per registry
    version, 7 ms. One round of N scrapes should cost O(N) target work, not O(N^2)."""
    n = 64
    endpoints = [f"10.0.{i // 250}.{i % 250}:8000" for i in range(n)]
    spec: dict[str, object] = {"endpoints": endpoints}
    if overrides:
        spec["metrics"] = {"kv_usage": "vllm:kv_cache_usage_perc"}
    config = load_dict({"models": {"m": spec}, "scrape": {"interval": 30.0, "timeout": 1.0}})
    registry = Registry()
    registry.set_endpoints("m", [Endpoint(e, "m") for e in endpoints])
    scraped: set[str] = set()
    everyone = asyncio.Event()

    async def fake_scrape(self: Scraper, address: str, targets: list[Target]) -> None:
        scraped.add(address)
        if len(scraped) == n:
            everyone.set()

    monkeypatch.setattr(scraper_module.Scraper, "scrape_address", fake_scrape)
    built = 0

    def counting_target(*args: Any, **kwargs: Any) -> Target:
        nonlocal built
        built += 1
        return Target(*args, **kwargs)

    monkeypatch.setattr(scraper_module, "Target", counting_target)
    scraper = Scraper(config, registry)
    try:
        await scraper.start()
        await asyncio.wait_for(everyone.wait(), 10)
        walked = built
    finally:
        await scraper.stop()
    # Starting the loops walks the endpoints once; one scrape each may walk them a few
    # times more in all, not once per address.
    assert walked <= 4 * n, f"{walked} scrape targets built for one round of {n} scrapes"
