"""The cross-check engine (`bench/xsim/engine.py`): vLLM's streaming order, prefix hits
only after prefill, LRU eviction, and the workloads' promised shapes."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from aiohttp.http_exceptions import BadHttpMessage

from bench.loadclient import send_one
from bench.routing import LoadSampler
from bench.workloads import Conversation, Turn
from bench.xsim.engine import (
    Engine,
    EngineParams,
    Request,
    _Http2ProbeFilter,
    _outage,
    block_hashes,
    make_app,
    parse_degrade,
    parse_outage,
    tokenize,
)
from bench.xsim.workloads import SPECS, build
from llmgw.testing.wait import eventually


@contextlib.asynccontextmanager
async def _replica(
    params: EngineParams,
) -> AsyncIterator[tuple[Engine, web.AppRunner, web.TCPSite, int]]:
    """One engine serving on a free port: (engine, runner, site, port)."""
    engine = Engine("r0", params)
    loop_task = asyncio.create_task(engine.run())
    runner = web.AppRunner(make_app(engine, "m1", 0), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield engine, runner, site, runner.addresses[0][1]
    finally:
        loop_task.cancel()
        await runner.cleanup()


async def _serve(params: EngineParams) -> AsyncIterator[tuple[str, Engine]]:
    async with _replica(params) as (engine, _, _, port):
        yield f"http://127.0.0.1:{port}", engine


@pytest.fixture
async def replica() -> AsyncIterator[tuple[str, Engine]]:
    async for pair in _serve(EngineParams(kv_blocks=64)):
        yield pair


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


async def _stream(
    http: aiohttp.ClientSession, url: str, content: str, max_tokens: int, **extra: object
) -> list[str]:
    """Events in arrival order: 'headers', then each data payload."""
    body = {"model": "m1", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "stream": True, **extra}  # fmt: skip
    events = []
    async with http.post(url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200
        events.append("headers")
        async for raw in response.content:
            line = raw.strip()
            if line.startswith(b"data:"):
                events.append(line[5:].strip().decode())
    return events


async def test_streams_like_vllm_and_a_repeated_prompt_hits_the_cache(
    replica: tuple[str, Engine],
) -> None:
    url, _ = replica
    prompt = "alpha beta gamma delta " * 30  # ~120 tokens: several full blocks
    async with aiohttp.ClientSession() as http:
        first = await _stream(http, url, prompt, 5)
        assert first[0] == "headers"
        assert '"role": "assistant"' in first[1] and '"content": " tok"' in first[1]
        assert len(first) == 1 + 5 + 1 and first[-1] == "[DONE]"
        async with http.get(url + "/metrics") as r:
            before = _metric(await r.text(), "vllm:prefix_cache_hits_total")
        assert before == 0
        await _stream(http, url, prompt, 3)
        async with http.get(url + "/metrics") as r:
            text = await r.text()
        assert _metric(text, "vllm:prefix_cache_hits_total") >= 96
        assert _metric(text, "vllm:request_success_total") == 2
        assert "vllm:cache_config_info" not in text  # only with --cache-info


async def test_role_chunk_at_once_comes_alone_before_the_first_token() -> None:
    # `--role-chunk at-once`: as some OpenAI-compatible servers do, a role-only chunk with
    # the headers, before the prefill; the tokens follow without a role.
    async for url, _ in _serve(EngineParams(kv_blocks=64, role_at_once=True)):
        async with aiohttp.ClientSession() as http:
            events = await _stream(http, url, "alpha beta gamma " * 20, 3)
        assert len(events) == 1 + 1 + 3 + 1
        role = json.loads(events[1])["choices"][0]["delta"]
        assert role == {"role": "assistant", "content": ""}
        tokens = [json.loads(e)["choices"][0]["delta"] for e in events[2:-1]]
        assert tokens == [{"content": " tok"}] * 3


async def test_max_completion_tokens_wins_over_max_tokens_as_in_vllm(
    replica: tuple[str, Engine],
) -> None:
    # sglang-router forwards `max_tokens` as `max_completion_tokens`: an engine that read
    # only the old name would answer its requests with the default length.
    url, _ = replica
    async with aiohttp.ClientSession() as http:
        events = await _stream(http, url, "one two three", 2, max_completion_tokens=7)
        assert len(events) == 1 + 7 + 1
        events = await _stream(http, url, "one two three", 4)
        assert len(events) == 1 + 4 + 1


async def test_a_prompt_larger_than_the_cache_is_refused_not_queued_forever(
    replica: tuple[str, Engine],
) -> None:
    url, _ = replica
    body = {"model": "m1", "messages": [{"role": "user", "content": "word " * 2000}]}
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/chat/completions", json=body) as response,
    ):
        assert response.status == 400
        assert "KV cache" in (await response.json())["error"]["message"]


def _request(text: str, max_tokens: int = 16) -> Request:
    tokens = tokenize(text)
    return Request(block_hashes(tokens), len(tokens), max_tokens, 0.0)


def test_blocks_become_hits_only_after_prefill_and_are_evicted_least_recently_used() -> None:
    engine = Engine("r0", EngineParams(kv_blocks=20))
    a, b = _request("aaa " * 96), _request("bbb " * 96)  # 6 full blocks + 1 for decode each
    assert engine._try_admit(a)
    again = _request("aaa " * 96)
    assert engine._try_admit(again) and again.cached == 0  # a has not prefilled yet
    engine._release(again)
    engine._publish_prefix(a)
    engine._release(a)
    assert engine._try_admit(b)
    engine._publish_prefix(b)
    engine._release(b)
    hit = _request("aaa " * 96)
    assert engine._try_admit(hit) and hit.cached == 95  # all but the last token
    engine._publish_prefix(hit)
    engine._release(hit)
    # 20 blocks hold a's and b's 6 each; a third prompt evicts b's, the least recent.
    assert engine._try_admit(_request("ccc " * 96, max_tokens=80))
    assert engine._try_admit(later := _request("aaa " * 96)) and later.cached == 95


def test_a_released_prompts_tail_is_evicted_before_its_head() -> None:
    """Blocks were freed head first, so one eviction took block 0 and broke the whole
    chain's hits, its other blocks left cached and useless; vLLM (and llmgw/sim) free
    the tail first. (found by a review helper)"""
    engine = Engine("r0", EngineParams(kv_blocks=6))
    a = _request("abc " * 64, max_tokens=1)  # 4 full blocks, 5 with its answer
    assert a.prompt == 64 and len(a.hashes) == 4
    assert engine._try_admit(a)
    engine._publish_prefix(a)
    engine._release(a)
    b = _request("xyz " * 32, max_tokens=1)  # 3 blocks, 2 free: evicts one of a's
    assert engine._try_admit(b)
    engine._release(b)
    again = _request("abc " * 64, max_tokens=1)
    assert engine._try_admit(again) and again.cached == 48  # a's first 3 blocks


def test_tokens_are_not_four_characters() -> None:
    text = "conversation about a considerably longer sentence, with punctuation."
    assert len(text) / len(tokenize(text)) < 3.5


@pytest.mark.parametrize("name", sorted(SPECS))
def test_workloads_are_seeded(name: str) -> None:
    assert build(name, 1).fingerprint() == build(name, 1).fingerprint()
    assert build(name, 1).fingerprint() != build(name, 2).fingerprint()
    assert build(name, 1).requests >= 150


async def test_an_unstreamed_turn_is_sent_and_timed_whole(replica: tuple[str, Engine]) -> None:
    """`chat-unstreamed`'s batch clients: `"stream": false`, so an end-to-end time but no
    TTFT, and still a success (the summaries time TTFT over the streamed requests)."""
    url, _ = replica
    turns = (Turn("hello there", "", 6, 0.0, stream=False), Turn("again", "", 3, 0.0))
    conv = Conversation(0, None, 0.0, "", turns)
    async with aiohttp.ClientSession() as http:
        whole = await send_one(http, url + "/v1/chat/completions", "m1", conv, 0, 0.0)
        streamed = await send_one(http, url + "/v1/chat/completions", "m1", conv, 1, 0.0)
    assert whole.ok and whole.ttft_s is None and whole.e2e_s is not None
    assert whole.output_tokens == 6 and not whole.stream
    assert streamed.ok and streamed.ttft_s is not None and streamed.output_tokens == 3
    unstreamed = [t for c in build("chat-unstreamed", 1).conversations for t in c.turns]
    share = sum(not t.stream for t in unstreamed) / len(unstreamed)
    assert 0.25 < share < 0.55


def test_bursty_workloads_keep_the_mean_rate_but_clump_their_starts() -> None:
    """`chat-bursty` / `shared-bursty`: the Poisson twin's rate, but clumped starts (a scrape
    interval sees several new sessions at once): gaps vary far more than a Poisson
    process's (coefficient of variation 1)."""
    for bursty, steady in (("chat-bursty", "chat-moderate"), ("shared-bursty", "shared-system")):
        stats = {}
        for name in (bursty, steady):
            count, gaps = 0, []
            for seed in (1, 2, 3):
                starts = [c.start_s for c in build(name, seed).conversations]
                count += len(starts)
                gaps += [b - a for a, b in itertools.pairwise(starts)]
            stats[name] = (count, statistics.pstdev(gaps) / statistics.fmean(gaps))
        assert 0.75 < stats[bursty][0] / stats[steady][0] < 1.33  # about the same mean rate
        assert stats[steady][1] < 1.3
        assert stats[bursty][1] > 2.0


def test_agent_workloads_grow_long_contexts_fast_and_differ_only_in_the_session_header() -> None:
    """`agent-loop`: short tool calls, long tool results, sub-second tool time, so each
    conversation's prompt passes thousands of tokens within seconds; `agent-anonymous` is
    the same traffic without the session header."""
    loop, anonymous = build("agent-loop", 1), build("agent-anonymous", 1)
    assert len(loop.conversations) == len(anonymous.conversations)
    finals = []
    for a, b in zip(loop.conversations, anonymous.conversations, strict=True):
        assert a.session_id is not None and b.session_id is None
        last = len(a.turns) - 1
        assert a.messages(last) == b.messages(last) and a.start_s == b.start_s
        assert all(t.max_tokens <= 80 and t.think_s <= 0.4 for t in a.turns)
        finals.append(len(tokenize(" ".join(m["content"] for m in a.messages(last)))))
    assert statistics.median(finals) > 5000


def test_chat_docs_mixes_unstreamed_long_documents_into_the_chat() -> None:
    """`chat-docs`: the chat keeps its sessions and streams; the documents are single,
    unstreamed, sessionless requests of thousands of tokens, each its own text."""
    workload = build("chat-docs", 1)
    docs = [c for c in workload.conversations if c.session_id is None]
    chats = [c for c in workload.conversations if c.session_id is not None]
    assert len(docs) >= 8 and len(chats) > 3 * len(docs)
    assert all(len(c.turns) == 1 and not c.turns[0].stream for c in docs)
    assert all(t.stream for c in chats for t in c.turns)
    sizes = [len(tokenize(c.system)) for c in docs]
    assert min(sizes) >= 3000 and len({c.system for c in docs}) == len(docs)
    starts = [c.start_s for c in workload.conversations]
    assert starts == sorted(starts)


def test_mixed_tenants_carries_chat_retrieval_and_agents_at_once() -> None:
    """`mixed-tenants`: chat sessions, sessionless retrieval over shared documents and agent
    sessions interleave in one arrival order, each application's traffic in every third of
    the window, with distinct session ids."""
    workload = build("mixed-tenants", 1)
    convs = workload.conversations
    assert [c.index for c in convs] == list(range(len(convs)))
    assert [c.start_s for c in convs] == sorted(c.start_s for c in convs)
    kinds = {
        "chat": [c for c in convs if (c.session_id or "").startswith("chat-")],
        "agent": [c for c in convs if (c.session_id or "").startswith("agent-")],
        "rag": [c for c in convs if c.session_id is None],
    }
    assert len(kinds["rag"]) > len(kinds["chat"]) > len(kinds["agent"]) >= 5
    assert len(kinds["chat"]) + len(kinds["agent"]) + len(kinds["rag"]) == len(convs)
    window = SPECS["mixed-tenants"].window_s
    for part in kinds.values():
        assert {int(3 * c.start_s // window) for c in part} == {0, 1, 2}
    assert all(len(c.turns) == 1 for c in kinds["rag"])
    assert len({c.system for c in kinds["rag"]}) < len(kinds["rag"]) / 3  # documents repeat
    ids = [c.session_id for c in convs if c.session_id is not None]
    assert len(ids) == len(set(ids))


def test_chat_surge_climbs_from_half_to_two_and_a_half_times_the_moderate_rate() -> None:
    """`chat-surge`: new conversations arrive ever faster; over three seeds the last fifth
    of the window brings about 3x the first fifth's, and about as many as the
    moderate rate would over the window in all (the mean of 0.5x and 2.5x is 1.5x)."""
    window = SPECS["chat-surge"].window_s
    first = last = total = moderate = 0
    for seed in (1, 2, 3):
        starts = [c.start_s for c in build("chat-surge", seed).conversations]
        first += sum(t < window / 5 for t in starts)
        last += sum(t >= 4 * window / 5 for t in starts)
        total += len(starts)
        moderate += len(build("chat-moderate", seed).conversations)
    assert last > 2.2 * first  # 3.3x expected (rates 1.1 and 3.7 a second there)
    assert 1.2 < total / moderate < 1.8


def test_a_degraded_replica_is_slow_only_inside_its_window() -> None:
    params = EngineParams(slow_factor=3.0, slow_from=10.0, slow_until=30.0)
    engine = Engine("r1", params)
    t0 = engine.reset_at
    assert [engine.degraded(t0 + s) for s in (0.0, 9.9, 10.0, 29.9, 30.0)] == [
        False, False, True, True, False,
    ]  # fmt: skip
    assert parse_degrade("1:10:30:3") == {1: (10.0, 30.0, 3.0)}
    for bad in ("1:10:30", "1:30:10:3", "-1:0:1:2", "1:0:1:0", "1:0:1:2,1:2:3:2"):
        with pytest.raises(ValueError, match="--degrade"):
            parse_degrade(bad)
    assert SPECS["chat-degraded"].degrade is not None
    assert max(parse_degrade(SPECS["chat-degraded"].degrade)) < 4  # a replica of the 4


def test_long_answers_chat_streams_answers_of_hundreds_of_tokens() -> None:
    workload = build("chat-long-answers", seed=1)
    turns = [t for c in workload.conversations for t in c.turns]
    assert all(c.session_id is not None for c in workload.conversations)
    assert all(t.stream and 150 <= t.max_tokens <= 450 for t in turns)
    short = build("chat-moderate", seed=1)
    assert max(t.max_tokens for c in short.conversations for t in c.turns) <= 48


def test_mixed_gpu_fleets_have_two_replicas_slower_for_good() -> None:
    for name in ("chat-mixed-gpu", "shared-mixed-gpu"):
        spec = SPECS[name].degrade
        assert spec is not None
        slow = parse_degrade(spec)
        assert sorted(slow) == [2, 3]
        for replica, (start, until, factor) in slow.items():
            engine = Engine(f"r{replica}", EngineParams(slow_factor=factor, slow_from=start,
                                                        slow_until=until))  # fmt: skip
            assert factor == 2.0 and engine.degraded(engine.reset_at + 1e6)
        assert build(name, seed=1).conversations  # a workload of its own name


def test_rag_shares_prefixes_at_two_depths() -> None:
    """`rag-shared`: requests of one document share its app's prompt and the document;
    requests of two documents of one app share the app's prompt only."""
    workload = build("rag-shared", 1)
    assert all(c.session_id is None and len(c.turns) == 1 for c in workload.conversations)
    by_system: dict[str, int] = {}
    for c in workload.conversations:
        by_system[c.system] = by_system.get(c.system, 0) + 1
    counts = sorted(by_system.values(), reverse=True)
    assert len(counts) > 20 and counts[0] > 4 * counts[len(counts) // 2]  # Zipf: a hot head
    apps = {s.split("\n\n", 1)[0] for s in by_system}
    assert len(apps) == 4
    questions = [c.turns[0].user for c in workload.conversations]
    assert len(set(questions)) == len(questions)


async def test_a_client_that_stops_reading_aborts_its_request(replica: tuple[str, Engine]) -> None:
    """`chat-stop`: the client closes the stream after `stop_after` tokens; the engine drops
    the request (batch slot and blocks freed, an abort counted, as vLLM does) instead of
    decoding an answer nobody reads, and serves the next request as before."""
    url, engine = replica
    turns = (Turn("hello there", "", 300, 0.0, stop_after=3), Turn("again", "", 4, 0.0))
    conv = Conversation(0, None, 0.0, "", turns)
    async with aiohttp.ClientSession() as http:
        stopped = await send_one(http, url + "/v1/chat/completions", "m1", conv, 0, 0.0)
        assert stopped.ok and stopped.stopped and stopped.output_tokens == 3
        await eventually(lambda: not engine.running and engine.counters["abort"] == 1)
        assert engine.counters["generation"] < 300 and engine.private_blocks == 0
        whole = await send_one(http, url + "/v1/chat/completions", "m1", conv, 1, 0.0)
        async with http.get(url + "/metrics") as response:
            text = await response.text()
    assert whole.ok and not whole.stopped and whole.output_tokens == 4
    assert 'finished_reason="abort"} 1' in text and engine.counters["success"] == 1


def test_stop_chat_stops_two_in_five_turns_early() -> None:
    workload = build("chat-stop", seed=1)
    turns = [t for c in workload.conversations for t in c.turns]
    stopped = [t for t in turns if t.stop_after is not None]
    assert all(t.stream and 150 <= t.max_tokens <= 450 for t in turns)
    assert 0.3 < len(stopped) / len(turns) < 0.5
    assert all(3 <= t.stop_after <= 40 for t in stopped if t.stop_after is not None)
    others = [t for c in build("chat-long-answers", seed=1).conversations for t in c.turns]
    assert all(t.stop_after is None for t in others)


async def test_an_outage_cuts_refuses_then_restarts_empty() -> None:
    """`--outage`: at FROM the replica's streams are cut and its port refuses connections;
    at UNTIL it serves again with an empty cache and its counters from zero (a restarted
    vLLM's /metrics)."""
    async with _replica(EngineParams(kv_blocks=64)) as (engine, runner, site, port):
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        outage = asyncio.create_task(_outage(runner, site, engine, port, 0.0, 3.0))
        prompt = " ".join(f"word{i}" for i in range(120))  # several blocks: can hit the cache
        body = {"model": "m1", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 700, "stream": True}  # fmt: skip
        try:
            async with aiohttp.ClientSession() as http:
                short = {**body, "max_tokens": 2, "stream": False}
                for _ in range(2):
                    async with http.post(url, json=short) as response:
                        assert response.status == 200
                assert engine.counters["success"] == 2 and engine.counters["hits"] > 0
                with pytest.raises(aiohttp.ClientPayloadError):
                    async with http.post(url, json=body) as response:
                        await response.content.readline()  # streaming: the first chunk is here
                        engine.armed_at = time.monotonic()  # what /admin/reset does
                        await response.read()
                assert not engine.running and engine.counters == dict.fromkeys(engine.counters, 0)
                with pytest.raises(aiohttp.ClientConnectorError):
                    await http.post(url, json=short)
                statuses: list[int] = []

                async def served() -> bool:
                    with contextlib.suppress(aiohttp.ClientConnectorError):
                        async with http.post(url, json=short) as response:
                            statuses.append(response.status)
                    return bool(statuses)

                deadline = time.monotonic() + 10
                while not await served():
                    assert time.monotonic() < deadline, "the replica never came back"
                    await asyncio.sleep(0.05)  # polling a port, with a deadline
                assert statuses == [200] and engine.counters["success"] == 1
                assert engine.counters["hits"] == 0  # empty cache: the same prompt missed
        finally:
            outage.cancel()
    with pytest.raises(ValueError, match="--outage"):
        parse_outage("1:5:inf")
    assert parse_outage(SPECS["chat-crash"].outage or "") == (1, 10.0, 25.0)


@pytest.mark.parametrize("published", ["full", "minimal", "none"])
async def test_routers_see_what_the_engine_publishes_the_bench_sees_all(published: str) -> None:
    """`--metrics`: `/metrics` is what a router scrapes (everything, gauges only, or a 404);
    `/xsim/metrics` gives the bench every counter whatever the engine publishes."""
    async for url, _ in _serve(EngineParams(kv_blocks=64, metrics=published)):
        async with aiohttp.ClientSession() as http:
            await _stream(http, url, "some words to count", 3)
            async with http.get(url + "/metrics") as response:
                status, text = response.status, await response.text()
            async with http.get(url + "/xsim/metrics") as response:
                full = await response.text()
        assert status == (404 if published == "none" else 200)
        assert ("vllm:num_requests_running{" in text) == (published != "none")
        assert ("vllm:generation_tokens_total{" in text) == (published == "full")
        assert _metric(full, "vllm:generation_tokens_total") == 3


async def test_the_load_sampler_sees_a_restart_and_a_dead_replica(
    replica: tuple[str, Engine],
) -> None:
    """bench/routing.py's sampler: a replica whose counters go down restarted (its counts
    are then from zero, not a delta); one that does not answer is idle, not a lost sample."""
    url, engine = replica
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    sampler = LoadSampler([url, dead], "/xsim/metrics", interval=0.01)
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as http:
        await _stream(http, url, "count these words please", 4)
        task = asyncio.create_task(sampler.run(http, stop))
        await eventually(lambda: len(sampler.samples) >= 2)
        assert not sampler.restarted and all(s[1][1] == 0 for s in sampler.samples)
        engine.crash()
        await eventually(lambda: sampler.restarted)
        stop.set()
        await task


def test_http2_preface_traceback_is_dropped_and_other_errors_kept() -> None:
    probe = logging.makeLogRecord(
        {
            "msg": "Error handling request",
            "exc_info": (BadHttpMessage, BadHttpMessage("Pause on PRI/Upgrade"), None),
        }
    )
    other = logging.makeLogRecord(
        {
            "msg": "Error handling request",
            "exc_info": (BadHttpMessage, BadHttpMessage("bad header"), None),
        }
    )
    crash = logging.makeLogRecord(
        {"msg": "Error handling request", "exc_info": (ValueError, ValueError("PRI"), None)}
    )
    keep = _Http2ProbeFilter()
    assert [keep.filter(r) for r in (probe, other, crash)] == [False, True, True]
