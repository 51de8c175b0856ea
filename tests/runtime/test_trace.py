"""The decision trace: what a line holds (never prompt text), sampling, rotation, both edges."""

from __future__ import annotations

import errno
import io
import json
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

import llmgw.runtime.trace as trace_module
from llmgw.asgi.app import ProxyApp
from llmgw.asgi.testing import address_of, serve
from llmgw.cli.replay_trace import read_trace
from llmgw.config import Config, TraceSpec, load_dict
from llmgw.extproc.translate import Exchange
from llmgw.gateway import Gateway
from llmgw.lifecycle import Hooks, Lifecycle
from llmgw.registry import FULL_SCRAPES, Registry
from llmgw.runtime.router import workers_problem
from llmgw.runtime.trace import (
    RotatingFile,
    TraceWriter,
    close_trace,
    session_hash,
    trace_problem,
    traced,
)
from llmgw.scheduling.scheduler import Scheduler
from llmgw.sim import SimFleet
from llmgw.testing.extproc import (
    chat_headers,
    parse,
    request_body,
    request_headers,
    response_headers,
    response_trailers,
)
from llmgw.testing.wait import eventually
from llmgw.types import EngineMetrics

JSON = {"content-type": "application/json"}  # engines (vLLM) refuse bodies sent as anything else

SECRET = "the-launch-code-is-PURPLE-ELEPHANT-4242 "
SESSION = "alice@example.com"


def config(addresses: list[str], **trace: Any) -> Config:
    return load_dict(
        {
            "models": {"m1": {"endpoints": addresses, "strategy": "latency"}},
            "trace": trace,
        }
    )


def body(turn: int) -> bytes:
    content = SECRET * 40 + f" turn {turn}"  # ~1,600 characters: several 64-token blocks
    message = {"role": "user", "content": content}
    return orjson.dumps({"model": "m1", "stream": True, "messages": [message]})


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_no_prompt_text(path: Path) -> None:
    for file in path.parent.iterdir():
        raw = file.read_bytes()
        for needle in (b"PURPLE-ELEPHANT", b"launch-code", SESSION.encode(), b"turn "):
            assert needle not in raw, (file, needle)


@pytest.fixture
def tracing() -> Iterator[Callable[[Config, str], Hooks]]:
    """`traced(Hooks(edge), config.trace)`, closed at the end of the test."""
    made: list[Hooks] = []

    def make(cfg: Config, edge: str = "test") -> Hooks:
        made.append(traced(Hooks(edge), cfg.trace))
        return made[-1]

    yield make
    for hooks in made:
        close_trace(hooks)


def run_lifecycle(gateway: Gateway, hooks: Hooks, turn: int, status: int = 200) -> None:
    lifecycle = Lifecycle(gateway, hooks)
    headers = {"x-session-id": SESSION}
    lifecycle.route(headers, "/v1/chat/completions", body(turn))
    lifecycle.first_byte()
    lifecycle.response(status)
    lifecycle.finish()


def test_a_trace_line_has_shape_decision_and_outcome_but_no_prompt_text(
    tmp_path: Path, tracing: Callable[[Config, str], Hooks]
) -> None:
    path = tmp_path / "trace.jsonl"
    cfg = config(["10.0.0.1:8000", "10.0.0.2:8000"], path=str(path))
    gateway = Gateway(Scheduler(cfg, seed=1))
    hooks = tracing(cfg, "test")
    for turn in range(3):
        run_lifecycle(gateway, hooks, turn, status=200 if turn < 2 else 503)
    close_trace(hooks)  # flushes
    records = lines(path)
    assert len(records) == 3
    first = records[0]
    assert first["model"] == "m1" and first["edge"] == "test"
    assert first["session"] == session_hash(SESSION) != SESSION
    assert first["prompt_tokens"] > 300
    assert len(first["blocks"]) == first["prompt_tokens"] // 64
    # The same leading text gives the same leading block hashes: a replay sees the sharing.
    assert records[1]["blocks"][:5] == first["blocks"][:5]
    assert first["decision"]["endpoint"] in first["decision"]["totals"]
    assert first["decision"]["predicted_ttft_ms"] > 0
    assert first["outcome"]["status"] == 200 and first["outcome"]["outcome"] == "success"
    assert first["outcome"]["ttft_ms"] is not None and first["outcome"]["duration_ms"] > 0
    assert records[2]["outcome"]["outcome"] == "backpressure"
    assert_no_prompt_text(path)


def test_refused_requests_and_sample_zero_write_nothing(
    tmp_path: Path, tracing: Callable[[Config, str], Hooks]
) -> None:
    path = tmp_path / "trace.jsonl"
    cfg = config(["10.0.0.1:8000"], path=str(path), sample=0.0)
    gateway = Gateway(Scheduler(cfg, seed=1))
    hooks = tracing(cfg, "test")
    run_lifecycle(gateway, hooks, 0)
    refused = Lifecycle(gateway, hooks)
    refused.route({}, "/v1/chat/completions", b"not json")
    refused.finish()
    close_trace(hooks)
    assert not path.exists()


def test_sampling_writes_about_the_configured_share(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    cfg = config(["10.0.0.1:8000"])
    gateway = Gateway(Scheduler(cfg, seed=1))
    writer = TraceWriter(TraceSpec(path=str(path), sample=0.25), "test", rng=random.Random(5))
    hooks = Hooks("test", finished=writer)
    for turn in range(400):
        run_lifecycle(gateway, hooks, turn)
    writer.close()
    assert 70 <= len(lines(path)) <= 130
    assert writer.written == len(lines(path))


def test_the_trace_rotates_by_size_and_keeps_the_configured_backups(
    tmp_path: Path, tracing: Callable[[Config, str], Hooks]
) -> None:
    path = tmp_path / "trace.jsonl"
    cfg = config(["10.0.0.1:8000"], path=str(path), max_bytes=8192, backups=2)
    gateway = Gateway(Scheduler(cfg, seed=1))
    hooks = tracing(cfg, "test")
    for turn in range(60):  # ~1.3 KB a line: many rotations
        run_lifecycle(gateway, hooks, turn)
    close_trace(hooks)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["trace.jsonl", "trace.jsonl.1", "trace.jsonl.2"]
    assert all((tmp_path / n).stat().st_size <= 8192 for n in names)
    assert_no_prompt_text(path)


def test_the_extproc_edge_writes_the_trace(
    tmp_path: Path, tracing: Callable[[Config, str], Hooks]
) -> None:
    path = tmp_path / "trace.jsonl"
    cfg = config(["10.0.0.1:8000", "10.0.0.2:8000"], path=str(path))
    gateway = Gateway(Scheduler(cfg, seed=1))
    hooks = tracing(cfg, "extproc")
    exchange = Exchange(gateway, hooks)
    headers = chat_headers(**{"x-session-id": SESSION, "content-type": "application/json"})
    parse(exchange.handle(request_headers(headers)))
    parse(exchange.handle(request_body(body(0))))
    parse(exchange.handle(response_headers(200)))
    exchange.handle(response_trailers())
    exchange.close()
    close_trace(hooks)
    (record,) = lines(path)
    assert record["edge"] == "extproc" and record["outcome"]["status"] == 200
    assert_no_prompt_text(path)


async def test_the_proxy_writes_the_trace_with_observed_ttft(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    async with SimFleet(replicas=2, model="m1", time_scale=0, seed=3) as fleet:
        cfg = config([address_of(u) for u in fleet.urls], path=str(path))
        app = ProxyApp(cfg, scrape=False)
        async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
            for turn in range(4):
                reply = await client.post(
                    "/v1/chat/completions",
                    content=body(turn),
                    headers={**JSON, "x-session-id": SESSION},
                )
                assert reply.status_code == 200
    records = lines(path)
    assert len(records) == 4
    assert all(r["edge"] == "asgi" and r["outcome"]["ttft_ms"] is not None for r in records)
    assert_no_prompt_text(path)


@pytest.mark.parametrize("field", [{"sample": 1.5}, {"max_bytes": 10}, {"backups": 0}])
def test_bad_trace_settings_name_the_field(field: dict[str, Any]) -> None:
    from llmgw.errors import ConfigError  # noqa: PLC0415

    with pytest.raises(ConfigError, match=f"trace.{next(iter(field))}"):
        config(["10.0.0.1:8000"], path="x.jsonl", **field)


def test_workers_must_not_share_one_trace_file(tmp_path: Path) -> None:
    shared = TraceSpec(path=str(tmp_path / "t.jsonl"))
    assert trace_problem(shared, 1) is None
    assert "{pid}" in (trace_problem(shared, 2) or "")
    per_process = TraceSpec(path=str(tmp_path / "t.{pid}.jsonl"))
    assert trace_problem(per_process, 4) is None
    writer = TraceWriter(per_process, "test")
    gateway = Gateway(Scheduler(config(["10.0.0.1:8000"]), seed=1))
    run_lifecycle(gateway, Hooks("test", finished=writer), 0)
    writer.close()
    assert (tmp_path / f"t.{os.getpid()}.jsonl").exists()


def test_a_trace_directory_that_is_missing_is_refused_at_start(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    problem = trace_problem(TraceSpec(path=str(missing / "t.jsonl")), 1)
    assert problem is not None and str(missing) in problem and "does not exist" in problem
    assert "exist" in (workers_problem(config(["10.0.0.1:8000"], path=str(missing / "t")), 1) or "")
    assert "is a directory" in (trace_problem(TraceSpec(path=str(tmp_path)), 1) or "")


def test_a_trace_write_error_loses_the_line_not_the_answer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The directory went away after start (a volume unmounted, a full disk): the response
    ends as it would have, the line is counted lost, the stream's counters come back."""
    folder = tmp_path / "traces"
    folder.mkdir()
    cfg = config(["10.0.0.1:8000", "10.0.0.2:8000"], path=str(folder / "trace.jsonl"))
    gateway = Gateway(Scheduler(cfg, seed=1))
    writer = TraceWriter(cfg.trace, "extproc")
    hooks = Hooks("extproc", finished=writer, dispatched=writer.dispatched)
    folder.rmdir()
    for turn in range(2):
        exchange = Exchange(gateway, hooks)
        headers = chat_headers(**{"x-session-id": SESSION, "content-type": "application/json"})
        parse(exchange.handle(request_headers(headers)))
        parse(exchange.handle(request_body(body(turn))))
        parse(exchange.handle(response_headers(200)))
        assert parse(exchange.handle(response_trailers())) is not None
        exchange.close()
    assert writer.lost == 2 and writer.written == 0
    assert sum(s.inflight for s in gateway.scheduler.registry.states("m1")) == 0
    assert [r.levelname for r in caplog.records if r.name == "llmgw.trace"] == ["WARNING"]
    folder.mkdir()  # back: the next line is written
    run_lifecycle(gateway, hooks, 2)
    writer.close()
    assert writer.written == 1 and len(lines(folder / "trace.jsonl")) == 1


class Disk:
    """Files the trace module opens fail their writes (ENOSPC) while `full`."""

    def __init__(self) -> None:
        self.full = False

    def open(self, path: Any, mode: str = "r", buffering: int = -1, **_: Any) -> Any:
        disk = self

        class Raw(io.FileIO):
            def write(self, data: Any) -> int:
                if disk.full:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return super().write(data)

        return io.BufferedWriter(Raw(path, mode.replace("b", "")), buffer_size=buffering)


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> Disk:
    fake = Disk()
    monkeypatch.setattr(trace_module, "open", fake.open, raising=False)
    return fake


def exchange_with(gateway: Gateway, hooks: Hooks, content: str) -> None:
    exchange = Exchange(gateway, hooks)
    headers = chat_headers(**{"x-session-id": SESSION, "content-type": "application/json"})
    request = orjson.dumps({"model": "m1", "messages": [{"role": "user", "content": content}]})
    parse(exchange.handle(request_headers(headers)))
    parse(exchange.handle(request_body(request)))
    parse(exchange.handle(response_headers(200)))
    assert parse(exchange.handle(response_trailers())) is not None
    exchange.close()


def test_a_full_disk_at_rotation_loses_lines_not_answers(tmp_path: Path, disk: Disk) -> None:
    """Closing the old file at rotation failed (its buffer could not be flushed) and the
    writer kept the closed file: the next line that did not rotate raised ValueError out of
    the request's `finished` hook (found by a review helper)."""
    path = tmp_path / "trace.jsonl"
    cfg = config(["10.0.0.1:8000"], path=str(path), max_bytes=4096, backups=1)
    gateway = Gateway(Scheduler(cfg, seed=1))
    writer = TraceWriter(cfg.trace, "extproc")
    hooks = Hooks("extproc", finished=writer, dispatched=writer.dispatched)
    disk.full = True
    exchange_with(gateway, hooks, "hi")  # a ~1 KB line, buffered
    assert (writer.lost, writer.written) == (0, 1)
    exchange_with(gateway, hooks, "a long document. " * 2500)  # ~3.5 KB: rotates, close fails
    assert (writer.lost, writer.written) == (2, 0)  # the buffered line went with it
    exchange_with(gateway, hooks, "hi again")  # under max_bytes: no rotation, file reopened
    assert (writer.lost, writer.written) == (2, 1)
    disk.full = False
    writer.close()
    assert [r["outcome"]["status"] for r in lines(path)] == [200]


def test_a_full_disk_at_close_counts_the_buffered_lines_lost(tmp_path: Path, disk: Disk) -> None:
    """Server stop on a full disk: the buffered lines are lost and counted, close does not
    raise (found by a review helper)."""
    path = tmp_path / "trace.jsonl"
    cfg = config(["10.0.0.1:8000"], path=str(path))
    gateway = Gateway(Scheduler(cfg, seed=1))
    writer = TraceWriter(cfg.trace, "extproc")
    hooks = Hooks("extproc", finished=writer, dispatched=writer.dispatched)
    exchange_with(gateway, hooks, "hi")
    exchange_with(gateway, hooks, "hi again")
    disk.full = True
    writer.close()
    assert (writer.lost, writer.written) == (2, 0)
    assert path.read_bytes() == b""


def test_a_rotating_file_reopens_after_a_failed_rotation(tmp_path: Path, disk: Disk) -> None:
    """A failed close kept the closed file object: every later write raised ValueError
    (found by a review helper)."""
    file = RotatingFile(tmp_path / "t.jsonl", max_bytes=100, backups=1)
    file.write(b"x" * 60 + b"\n")
    disk.full = True
    with pytest.raises(OSError):
        file.write(b"y" * 60 + b"\n")  # rotation: closing flushes -> ENOSPC
    assert file.dropped == 1  # the x line
    disk.full = False  # space is back
    file.write(b"z" * 10 + b"\n")
    file.close()
    assert (tmp_path / "t.jsonl").read_bytes() == b"z" * 10 + b"\n"


async def test_a_buffered_line_reaches_the_file_within_a_second_even_when_traffic_stops(
    tmp_path: Path,
) -> None:
    """`llmgw replay` on a live trace, or a crash after a burst: an idle server must not keep
    its last lines in the buffer until the next request."""
    path = tmp_path / "t.jsonl"
    file = RotatingFile(path, max_bytes=1 << 20, backups=1)
    try:
        file.write(b'{"first": 1}\n')
        file.write(b'{"then": "silence"}\n')
        await eventually(lambda: path.read_bytes().count(b"\n") == 2, timeout=3.0)
    finally:
        file.close()


def test_a_trace_line_carries_the_latency_terms_and_the_fleet_speed_the_router_measured(
    tmp_path: Path, tracing: Callable[[Config, str], Hooks]
) -> None:
    path = tmp_path / "trace.jsonl"
    cfg = config(["10.0.0.1:8000", "10.0.0.2:8000"], path=str(path))
    scheduler = Scheduler(cfg, seed=1)
    for state in scheduler.registry.states("m1"):  # as if engines published 200 us, 8 ms
        state.calibration.prefill.add(0.02, 100.0)
        state.calibration.step.add(0.08, 10.0)
        state.calibration.net.add(0.002, 100.0)  # net of the step each prefill shared: 20 us
    hooks = tracing(cfg, "test")
    run_lifecycle(Gateway(scheduler), hooks, 0)
    close_trace(hooks)
    (record,) = lines(path)
    decision = record["decision"]
    assert set(decision["terms"]) == set(decision["totals"])  # [queue, prefill, step] ms
    chosen = decision["terms"][decision["endpoint"]]
    assert chosen[1] == pytest.approx(0.2 * decision["prefill_tokens"], rel=1e-3)
    assert record["fleet"]["prefill_us_per_token"] == pytest.approx(200.0)
    assert record["fleet"]["step_ms"] == pytest.approx(8.0)
    # What the pick saw, taken at dispatch: its time, the engines (never scraped here:
    # stale, null), and the costs the latency scorer used for it.
    assert record["t"] <= record["t_pick"] <= record["t"] + record["outcome"]["duration_ms"] / 1e3
    assert record["engines"] == dict.fromkeys(decision["totals"])
    assert record["costs"]["prefill_us_per_token"] == pytest.approx(200.0)
    # ... all of them: a replay prices a sessionless prompt at the net cost as this pick did.
    assert record["costs"]["marginal_us_per_token"] == pytest.approx(20.0)
    assert record["costs"]["observed_us_per_token"] is None  # no first tokens seen yet
    assert record["costs"]["engine_tokens"] == 1.0
    assert "marginal_us_per_token" not in record["fleet"]  # the speed alone there
    assert record["slowdowns"] == {}  # no endpoint priced slower than the fastest


def test_a_trace_line_times_the_pick_first_token_and_end_on_the_routers_own_clock(
    tmp_path: Path, tracing: Callable[[Config, str], Hooks]
) -> None:
    # A replay orders first tokens and ends against picks by these: the wall-clock anchors
    # of `t_pick` and the edge's durations jitter by µs-ms, and the latency scorer's
    # margins are µs (1 in ~40 demo replays diverged by them).
    path = tmp_path / "trace.jsonl"
    cfg = config(["10.0.0.1:8000", "10.0.0.2:8000"], path=str(path))
    now = [5.0]
    gateway = Gateway(Scheduler(cfg, Registry(clock=lambda: now[0]), seed=1))
    hooks = tracing(cfg, "test")
    for seen in (True, False):
        now[0] += 1.0
        lifecycle = Lifecycle(gateway, hooks)
        lifecycle.route({"x-session-id": SESSION}, "/v1/chat/completions", body(0))
        now[0] += 0.02
        if seen:  # an edge without body events never calls it
            lifecycle.first_byte()
        lifecycle.response(200)
        now[0] += 0.08
        lifecycle.finish()
    close_trace(hooks)
    seen_line, unseen_line = lines(path)
    assert seen_line["clock"] == pytest.approx({"pick": 6.0, "first": 6.02, "end": 6.1})
    # A first token inferred at the end is not one the edge saw: no time for it.
    assert unseen_line["clock"] == pytest.approx({"pick": 7.1, "first": None, "end": 7.2})


def test_a_trace_line_names_where_the_pick_knew_the_batch_size_and_the_slower_replicas(
    tmp_path: Path, tracing: Callable[[Config, str], Hooks]
) -> None:
    """Both engines scraped fresh; the first was seen at its peak with requests waiting
    often enough for that peak to count as its batch (the latency queue then counts this
    request against it), the second runs 2x slower. The line lists both, and a replay
    reads them back."""
    path = tmp_path / "trace.jsonl"
    addresses = ["10.0.0.1:8000", "10.0.0.2:8000"]
    cfg = config(addresses, path=str(path))
    scheduler = Scheduler(cfg, seed=1)
    registry = scheduler.registry
    for _ in range(FULL_SCRAPES + 1):  # (a peak counts from its first scrape at 8)
        registry.record_scrape(
            "m1", addresses[0], EngineMetrics(waiting=2, running=8, kv_usage=0.5)
        )
        registry.record_scrape(
            "m1", addresses[1], EngineMetrics(waiting=0, running=8, kv_usage=0.5)
        )
    # ... and the second engine runs 2x slower (its step and its prefill per token).
    for address, step in zip(addresses, (0.02, 0.04), strict=True):
        s = registry.get("m1", address)
        assert s is not None
        s.calibration.floor = step
        s.calibration.prefill_long.add(step / 200, 10_000)
    hooks = tracing(cfg, "test")
    run_lifecycle(Gateway(scheduler), hooks, 0)
    close_trace(hooks)
    (record,) = lines(path)
    assert record["batches"] == [addresses[0]]
    assert record["slowdowns"] == {addresses[1]: pytest.approx(2.0)}
    assert record["engines"][addresses[0]][:2] == [2, 8]
    (arrival,) = read_trace([path], decode_ms=20.0, output_tokens=None)
    assert arrival.batches == frozenset({addresses[0]})
    assert arrival.slowdowns is not None
    assert dict(arrival.slowdowns) == {addresses[1]: pytest.approx(2.0)}


@pytest.mark.parametrize("publishing", [True, False])
def test_a_trace_line_carries_the_step_phase_the_pick_read(
    tmp_path: Path, tracing: Callable[[Config, str], Hooks], publishing: bool
) -> None:
    """Seconds since the edge last relayed a token from each endpoint, at the pick (those
    within a few seconds), where the pick read them (its engines publish their step); null
    where it did not. A mirrored replay reads the phase exactly where the recorded router
    did: its own calibration may measure the step sooner (4 of 30 runs of the e2e replay
    test diverged from the 16th pick on)."""
    path = tmp_path / "trace.jsonl"
    addresses = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
    cfg = config(addresses, path=str(path))
    now = [50.0]
    scheduler = Scheduler(cfg, Registry(clock=lambda: now[0]), seed=1)
    registry = scheduler.registry
    for address, age in zip(addresses, (0.012, 60.0), strict=False):  # the third: never
        s = registry.get("m1", address)
        assert s is not None
        s.token_at = now[0] - age
        if publishing:
            s.calibration.step.add(0.2, 10.0)  # 20 ms steps
    hooks = tracing(cfg, "test")
    run_lifecycle(Gateway(scheduler), hooks, 0)
    close_trace(hooks)
    (record,) = lines(path)
    (arrival,) = read_trace([path], decode_ms=20.0, output_tokens=None)
    if not publishing:
        assert record["tokens"] is None and arrival.tokens is None
        return
    assert record["tokens"] == {addresses[0]: pytest.approx(0.012)}
    assert arrival.tokens is not None
    assert dict(arrival.tokens) == {addresses[0]: pytest.approx(0.012)}
