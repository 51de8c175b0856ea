"""bench/routing.py's llmgw contenders: the config they run is one llmgw loads, with the
decision trace where `--trace` asks for it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import sys
import types
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import routing
from bench.loadclient import CHAT_PATH, RequestRecord, send_one
from bench.routing import (
    HEAT_MAX,
    _ttfts,
    above_best,
    all_contenders,
    body_mode_contenders,
    heat_cells,
    llmgw_config,
    pool,
    pooled_text,
    records_file,
    reset_all,
    select_contenders,
    summarize,
    table,
    try_contenders,
)
from bench.workloads import Conversation, Turn
from bench.xsim.engine import Engine, EngineParams, Request, block_hashes, make_app, tokenize
from llmgw.config import load_dict


def test_trace_goes_where_asked_and_nowhere_otherwise(tmp_path: Path) -> None:
    upstreams = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    traced = load_dict(llmgw_config(upstreams, "latency", tmp_path / "envoy-latency.jsonl"))
    assert traced.trace.path == str(tmp_path / "envoy-latency.jsonl")
    assert [e.address for e in traced.models["m1"].endpoints] == ["127.0.0.1:1", "127.0.0.1:2"]
    assert load_dict(llmgw_config(upstreams, None)).trace.path is None


def test_envoy_contenders_use_the_default_body_mode_unless_named() -> None:
    envoy = [c for c in all_contenders() if c.edge == "envoy"]
    assert envoy and all(c.body_mode == "override" for c in envoy)


def _record(tokens: int) -> RequestRecord:
    return RequestRecord(0, 0, None, 0.0, 0.01, 0.1, 200, tokens, 10)


def test_summaries_count_a_restarted_replica_from_zero_and_unread_tokens() -> None:
    """Counter deltas per replica; a replica whose counters went down restarted during the
    run: counted from zero (Prometheus' increase()), and unread tokens become unknown."""
    names = ("vllm:request_success_total", "vllm:generation_tokens_total")
    before = [dict.fromkeys(names, 10.0), dict.fromkeys(names, 50.0)]
    steady = [
        dict(zip(names, (14.0, 90.0), strict=True)),
        dict(zip(names, (52.0, 70.0), strict=True)),
    ]
    summary = summarize([_record(40), _record(20)], 1.0, before, steady, [])
    assert summary["served_per_replica"] == [4, 2] and not summary["restarted"]
    assert summary["unread_tokens"] == 0.4  # 60 read of 100 generated
    restarted = [steady[0], dict(zip(names, (3.0, 30.0), strict=True))]
    summary = summarize([_record(40), _record(20)], 1.0, before, restarted, [])
    assert summary["served_per_replica"] == [4, 3] and summary["restarted"]
    assert summary["unread_tokens"] is None


@contextlib.asynccontextmanager
async def _serving(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_reset_refuses_to_go_on_with_a_replica_still_busy_at_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past the 60 s drain deadline reset_all posted /admin/reset anyway, the xsim engine
    answered 409 and kept its cache and queue, and the next contender ran on them.
    (found by a review helper)"""
    engine = Engine("r0", EngineParams(kv_blocks=64))
    warm = Request(block_hashes(tokenize("alpha beta " * 80)), 160, 1, 0.0)
    assert engine._try_admit(warm)
    engine._publish_prefix(warm)
    engine._release(warm)
    engine.submit(Request(block_hashes(tokenize("leftover")), 3, 1, 0.0))  # still queued
    clock = itertools.count(0.0, 100.0)  # each reading 100 s later: the deadline passes
    monkeypatch.setattr(routing, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    async with _serving(make_app(engine, "m1", 0)) as url, aiohttp.ClientSession() as http:
        with pytest.raises(RuntimeError, match=r"still busy after 60 s: .* 1 request"):
            await reset_all(http, [url], "/xsim/metrics")
    assert engine.cache  # untouched: the contender is skipped, not measured on it


async def test_reset_refuses_to_go_on_when_a_replica_refuses_the_reset() -> None:
    """reset_all read /admin/reset's answer and went on whatever it was. (found by a
    review helper)"""

    async def idle(_: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running{} 0\n")

    async def refuse(_: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "busy"}}, status=409)

    app = web.Application()
    app.router.add_get("/metrics", idle)
    app.router.add_post("/admin/reset", refuse)
    async with _serving(app) as url, aiohttp.ClientSession() as http:
        with pytest.raises(RuntimeError, match=r"/admin/reset answered 409: .*busy"):
            await reset_all(http, [url])


def test_a_counter_missing_after_a_restart_counts_from_zero() -> None:
    """A replica that restarted and does not publish a counter yet (vLLM's per-label series
    appear with their first sample): its delta read `after[key]`, a KeyError that ended the
    run. (found by a review helper)"""
    before = [{"vllm:request_success_total": 10.0, "vllm:prefix_cache_queries_total": 50.0}]
    after = [{"vllm:request_success_total": 3.0}]
    summary = summarize([_record(20)], 1.0, before, after, [])
    assert summary["restarted"] and summary["served_per_replica"] == [3]
    assert summary["prefix_hit_rate"] is None  # no queries since the restart


def test_a_request_whose_first_token_came_keeps_its_ttft_and_counts_as_an_error() -> None:
    """A stream that failed or timed out after its first token was censored to +inf in
    the TTFT percentiles, as if no token had come. (found by a review helper)"""
    late = RequestRecord(0, 0, None, 0.0, 0.05, None, 200, 1, 10, error="timeout after 1 s")
    never = RequestRecord(1, 0, None, 0.0, None, None, 0, 0, 10, error="timeout after 1 s")
    ttfts, failed = _ttfts([_record(5), late, never])
    assert ttfts == [0.01, 0.05, math.inf] and failed == 1
    summary = summarize([_record(5), late, never], 1.0, [], [], [])
    assert summary["errors"] == 2 and summary["ttft_failed"] == 1


async def test_a_stream_cut_after_its_first_token_keeps_the_ttft_measured() -> None:
    """The same through the load client: the first chunk comes, then the stream stalls
    past the client's timeout. (found by a review helper)"""
    stall = asyncio.Event()  # never set: the answer stalls after its first chunk

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "x"}}]}
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await stall.wait()
        return response

    app = web.Application()
    app.router.add_post(CHAT_PATH, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    conv = Conversation(0, "s", 0.0, "", (Turn("hi", "", 100, 0.0),))
    try:
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{runner.addresses[0][1]}{CHAT_PATH}"
            loop = asyncio.get_running_loop()
            record = await send_one(http, url, "m1", conv, 0, loop.time(), timeout_s=0.3)
    finally:
        stall.set()  # the handler ends, so the server shuts down at once
        await runner.cleanup()
    assert record.ttft_s is not None and record.error is not None and not record.ok
    assert _ttfts([record]) == ([record.ttft_s], 0)


def test_pooled_requests_count_the_unstreamed_ones(tmp_path: Path) -> None:
    """pool's `requests` was streamed answers + errors: every unstreamed request that
    succeeded (chat-docs, chat-unstreamed) was missing. (found by a review helper)"""
    ring = next(c for c in all_contenders() if c.name == "client:ring")
    records = [_record(5) for _ in range(6)]
    records += [
        RequestRecord(k, 0, None, 0.0, None, 1.0, 200, 9, 10, stream=False) for k in range(4)
    ]
    records.append(RequestRecord(0, 1, None, 0.0, None, None, 503, 0, 10, stream=False))
    (tmp_path / "s1").mkdir()
    lines = "".join(json.dumps(r.to_json()) + "\n" for r in records)
    records_file(tmp_path / "s1", ring.name, "cell").write_text(lines)
    pooled = pool(tmp_path, [1], ["cell"], [ring])["cell"][ring.name]
    assert pooled["requests"] == 11 and pooled["errors"] == 1


def test_seeds_pool_each_cells_requests_and_mark_only_a_loss_in_every_seed(
    tmp_path: Path,
) -> None:
    names = ["client:ring", "client:round-robin", "vllm-router:cache_aware"]
    names += ["vllm-router:consistent_hash", "sglang-router:cache_aware"]
    ring, rr, slow, once, partial = (
        next(c for c in all_contenders() if c.name == n) for n in names
    )

    def write(seed: int, contender: str, ttfts: list[float | None]) -> None:
        folder = tmp_path / f"s{seed}"
        folder.mkdir(exist_ok=True)
        records = [
            RequestRecord(k, 0, None, 0.0, t, 1.0, 200 if t is not None else 503, 5, 10)
            for k, t in enumerate(ttfts)
        ]
        lines = (json.dumps(r.to_json()) for r in records)
        records_file(folder, contender, "cell").write_text("\n".join(lines) + "\n")

    def spread(start: float) -> list[float | None]:
        return [start + k / 2000 for k in range(100)]  # start .. start + 0.0495 s

    for seed in (1, 2):
        write(seed, ring.name, spread(0.1))
        write(seed, rr.name, [*spread(0.101), None])  # 1 ms slower, one request failed
        write(seed, slow.name, spread(0.5))  # 5x, in both seeds
        write(seed, once.name, spread(0.9 if seed == 1 else 0.05))  # slow in one seed only
    write(1, partial.name, spread(0.01))  # seed 2's records missing: left out
    (gie,) = body_mode_contenders(["gie"])  # a `/` in its name (crashed the s43 grid)
    for seed in (1, 2):
        write(seed, gie.name, spread(0.1))
    contenders = [ring, rr, slow, once, partial, gie]
    everything = pool(tmp_path, [1, 2], ["cell"], contenders)
    pooled = everything["cell"]
    assert partial.name not in pooled
    assert pooled[gie.name]["requests"] == 200
    assert pooled[ring.name]["ttft_p90_ms"] == 144.5  # rank 180 of 200 pooled
    assert pooled[ring.name]["seed_p90_ms"] == [144.5, 144.5]
    assert pooled[rr.name]["requests"] == 202 and pooled[rr.name]["errors"] == 2
    lo, hi = pooled[ring.name]["ttft_p90_ci_ms"]
    assert lo < 144.5 < hi
    assert not above_best(pooled[ring.name], pooled)
    assert not above_best(pooled[rr.name], pooled)  # 1.007x: inside the best's interval
    assert not pooled[rr.name]["loss"]
    assert above_best(pooled[slow.name], pooled) and pooled[slow.name]["loss"]
    # Far above in the pooled interval, but faster than the best in seed 2: no finding.
    assert above_best(pooled[once.name], pooled) and not pooled[once.name]["loss"]
    text = pooled_text(everything, [1, 2], contenders)
    marked = [line.split()[0] for line in text.splitlines() if line.rstrip().endswith("*")]
    assert marked == [slow.name]


def test_a_p90_that_fell_on_failures_reads_fail_not_not_run(tmp_path: Path) -> None:
    """With more than a tenth of its requests failed a contender's p90 is +inf (written
    None): its ratio read `-`, what tables use for 'not run', and the heat map left its
    cell blank. The worst result looked like a missing one. (found by a review helper)"""
    by_name = {c.name: c for c in all_contenders()}
    ring, rr, absent = (
        by_name["client:ring"],
        by_name["client:round-robin"],
        by_name["asgi:default"],
    )
    good = [_record(5) for _ in range(10)]
    timeout = RequestRecord(0, 0, None, 0.0, None, None, 0, 0, 10, error="timeout after 1 s")
    (tmp_path / "s1").mkdir()
    for c, rows in ((ring, good), (rr, good[:7] + [timeout] * 3)):
        lines = "".join(json.dumps(r.to_json()) + "\n" for r in rows)
        records_file(tmp_path / "s1", c.name, "cell").write_text(lines)
    pooled = pool(tmp_path, [1], ["cell"], [ring, rr])
    assert pooled["cell"][rr.name]["ttft_p90_ms"] is None
    text = pooled_text(pooled, [1], [ring, rr, absent])
    ratios = dict(line.split() for line in text.split("\n\n")[0].splitlines()[3:])
    assert ratios == {ring.name: "1.0", rr.name: "fail", absent.name: "-"}
    # One run's table and summary: the same summaries through summarize.
    runs = {
        ring.name: summarize(good, 1.0, [], [], []),
        rr.name: summarize(good[:7] + [timeout] * 3, 1.0, [], [], []),
    }
    shown = table(runs).splitlines()[-1].split()
    assert shown[0] == rr.name and shown[2] == "fail" and shown[-1] == "fail"  # p90, p90/best
    _, names, values, labels = heat_cells({"cell": runs})
    assert names == [ring.name, rr.name]
    assert labels == [["1.00"], ["fail"]] and values[1][0] == HEAT_MAX


def test_try_specs_name_their_edge_and_a_malformed_one_is_a_usage_error() -> None:
    parser = argparse.ArgumentParser()
    strategy = {"scorers": {"latency": {"params": {"step_phase": False}}}}
    tried = try_contenders(parser, [f"x={json.dumps(strategy)}", f"asgi:y={json.dumps(strategy)}"])
    assert [(c.name, c.edge, c.strategy) for c in tried] == [
        ("envoy:x", "envoy", strategy),
        ("asgi:y", "asgi", strategy),
    ]
    # Each one's config is one llmgw loads, with the param reaching the model's strategy.
    spec = load_dict(llmgw_config(["http://127.0.0.1:1"], tried[1].strategy)).models["m1"]
    assert not isinstance(spec.strategy, str)
    assert spec.strategy.scorers["latency"].params == {"step_phase": False}
    # Malformed, or a built-in contender's name (asgi:default, envoy:latency).
    for bad in ("x", "x={", "x=[1]", "vllm:x={}", "asgi:={}", "asgi:default={}", "latency={}"):
        with pytest.raises(SystemExit):
            try_contenders(parser, [bad])
    with pytest.raises(SystemExit):  # the same name twice
        try_contenders(parser, ["x={}", "envoy:x={}"])


def test_only_may_name_a_body_mode_contender_and_extras_run_once() -> None:
    parser = argparse.ArgumentParser()
    every = all_contenders()

    def chosen(only: str | None, modes: list[str]) -> list[str]:
        args = argparse.Namespace(only=only, quick=False, tries=[], body_modes=modes)
        return [c.name for c in select_contenders(parser, args, every)]

    assert chosen("asgi:default,envoy:latency/gie", ["gie"]) == [
        "asgi:default",
        "envoy:latency/gie",
    ]
    assert chosen("asgi:default", ["gie"]) == ["asgi:default", "envoy:latency/gie"]
    with pytest.raises(SystemExit, match="unknown contenders: envoy:latency/gie"):
        chosen("envoy:latency/gie", [])  # not asked for with --body-mode
