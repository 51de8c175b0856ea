"""A small async load client for OpenAI-compatible streaming chat: replays a `Workload`.

Why our own and not aiperf (0.13) / inference-perf / locust: the routing benchmark needs,
in one tool, (1) a per-*conversation* session header (`x-session-id: <id>`; aiperf and
inference-perf set static headers for the whole run), (2) multi-turn replay where turn
k+1 is sent only after turn k's response ended plus a think time, with the history
re-sent (aiperf's multi-turn mode does this, but not with a per-conversation header),
(3) byte-identical replay of a seeded workload across a dozen contenders in one run,
and (4) a CPU footprint small enough to share 2 cores with Envoy, the ext_proc server
and 8 simulated engines (aiperf runs a multi-process ZMQ pipeline per run; locust has
no TTFT or SSE notion). So this is ~200 lines on aiohttp: TTFT is measured from the
first SSE chunk whose delta carries non-empty `content` (the role-only first chunk of
vLLM does not count), end-to-end at `[DONE]`/EOF, output tokens from the usage chunk.

    records, wall = await run(url, "m1", workload, mode="open")          # Poisson arrivals
    records, wall = await run(url, "m1", workload, mode="closed", concurrency=32)
    # client-side routing: no router, the client picks the replica of every request
    records, wall = await run(url, "m1", workload, pick_url=ring_picker(replica_urls))
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import orjson

from bench.workloads import Conversation, Workload

SESSION_HEADER = "x-session-id"
CHAT_PATH = "/v1/chat/completions"

# (conversation, turn) -> the full URL to send that request to.
UrlPicker = Callable[[Conversation, int], str]


def ring_picker(replica_urls: list[str]) -> UrlPicker:
    """Client-side consistent hashing: the session id on the Ray-compatible ring (100
    vnodes a replica, mmh3), straight to the replica; no session = a per-request key."""
    from llmgw.hashring import HashRing  # noqa: PLC0415 (only this mode needs mmh3)

    by_id = {u.removeprefix("http://"): u for u in replica_urls}
    ring = HashRing(list(by_id), num_fallback_replicas=0)

    def pick(conv: Conversation, turn: int) -> str:
        key = conv.session_id or f"request-{conv.index}-{turn}"
        return by_id[ring.candidates(key)[0]] + CHAT_PATH

    return pick


def round_robin_picker(replica_urls: list[str]) -> UrlPicker:
    """Client-side round-robin over the replicas, in request order."""
    cycle = itertools.cycle(replica_urls)
    return lambda conv, turn: next(cycle) + CHAT_PATH


@dataclass(slots=True)
class RequestRecord:
    """One request's outcome; times in seconds, `sent_s` from the run start."""

    conversation: int
    turn: int
    session_id: str | None
    sent_s: float
    ttft_s: float | None
    e2e_s: float | None
    status: int
    output_tokens: int
    prompt_chars: int
    replica: str | None = None
    decision: str | None = None
    error: str | None = None
    stream: bool = True
    stopped: bool = False  # the client closed the stream early (`Turn.stop_after`)

    @property
    def ok(self) -> bool:
        first = self.ttft_s is not None or not self.stream  # unstreamed: no first token
        return self.status == 200 and self.error is None and first

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _content_of(data: bytes) -> tuple[bool, int | None]:
    """(chunk carries non-empty content, usage completion tokens if this is the usage chunk)."""
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError:
        return False, None
    usage = event.get("usage")
    completion = usage.get("completion_tokens") if isinstance(usage, dict) else None
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or choice.get("text"):
            return True, completion
    return False, completion


async def send_one(
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    conv: Conversation,
    turn: int,
    t0: float,
    *,
    session_header: str = SESSION_HEADER,
    timeout_s: float = 60.0,
) -> RequestRecord:
    spec = conv.turns[turn]
    messages = conv.messages(turn)
    payload: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": spec.max_tokens}
    if spec.stream:
        payload |= {"stream": True, "stream_options": {"include_usage": True}}
    body = orjson.dumps(payload)
    headers = {"content-type": "application/json"}
    if conv.session_id is not None:
        headers[session_header] = conv.session_id
    start = time.perf_counter()
    record = RequestRecord(
        conversation=conv.index,
        turn=turn,
        session_id=conv.session_id,
        sent_s=start - t0,
        ttft_s=None,
        e2e_s=None,
        status=0,
        output_tokens=0,
        prompt_chars=sum(len(m["content"]) for m in messages),
        stream=spec.stream,
    )
    chunks = 0
    done = False
    try:
        async with asyncio.timeout(timeout_s):
            async with http.post(url, data=body, headers=headers) as response:
                record.status = response.status
                record.replica = response.headers.get("x-sim-replica")
                record.decision = response.headers.get("x-llmgw-decision")
                if response.status != 200:
                    record.error = (await response.read())[:200].decode("utf-8", "replace")
                    return record
                if not spec.stream:
                    answer = orjson.loads(await response.read())
                    record.e2e_s = time.perf_counter() - start
                    record.output_tokens = int(
                        (answer.get("usage") or {}).get("completion_tokens", 0)
                    )
                    return record
                async for raw in response.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    has_content, usage_tokens = _content_of(data)
                    if has_content:
                        chunks += 1
                        if record.ttft_s is None:
                            record.ttft_s = time.perf_counter() - start
                        if spec.stop_after is not None and chunks >= spec.stop_after:
                            record.stopped = True
                            response.close()  # drop the connection, as a browser tab does
                            break
                    if usage_tokens is not None:
                        record.output_tokens = usage_tokens
        record.e2e_s = time.perf_counter() - start
        if not record.output_tokens:
            record.output_tokens = chunks
        if record.ttft_s is None:
            record.error = "no content chunk"
        elif not (done or record.stopped):
            # A stream cut before `data: [DONE]` (an engine or a router that dropped the
            # connection mid-answer) is a failure, not a short answer.
            record.error = f"stream ended without [DONE] after {chunks} content chunks"
    except TimeoutError:
        record.error = f"timeout after {timeout_s} s"
    except (aiohttp.ClientError, orjson.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:200]
    return record


async def _play(
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    conv: Conversation,
    t0: float,
    out: list[RequestRecord],
    *,
    wait_for_start: bool,
    session_header: str,
    timeout_s: float,
    pick_url: UrlPicker | None = None,
) -> None:
    if wait_for_start:
        delay = conv.start_s - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
    for turn in range(len(conv.turns)):
        target = pick_url(conv, turn) if pick_url is not None else url
        record = await send_one(
            http, target, model, conv, turn, t0, session_header=session_header, timeout_s=timeout_s
        )
        out.append(record)
        think = conv.turns[turn].think_s
        if think > 0 and turn + 1 < len(conv.turns):
            await asyncio.sleep(think)


async def run(
    url: str,
    model: str,
    workload: Workload,
    *,
    mode: str = "open",
    concurrency: int = 32,
    session_header: str = SESSION_HEADER,
    timeout_s: float = 60.0,
    pick_url: UrlPicker | None = None,
) -> tuple[list[RequestRecord], float]:
    """Replay `workload` against `url` (a /v1/chat/completions URL).

    mode "open": every conversation starts at its `start_s` (Poisson arrivals), however
    slow the server is. mode "closed": `concurrency` conversations at a time, the next
    starting when one ends. `pick_url` routes on the client (then `url` is unused).
    Returns (records, wall seconds of the whole run).
    """
    if mode not in ("open", "closed"):
        raise ValueError(f"mode must be 'open' or 'closed', got {mode!r}")
    records: list[RequestRecord] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False, ttl_dns_cache=None)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, auto_decompress=False
    ) as http:
        t0 = time.perf_counter()
        if mode == "open":
            await asyncio.gather(
                *(
                    _play(
                        http,
                        url,
                        model,
                        conv,
                        t0,
                        records,
                        wait_for_start=True,
                        session_header=session_header,
                        timeout_s=timeout_s,
                        pick_url=pick_url,
                    )
                    for conv in workload.conversations
                )
            )
        else:
            queue: asyncio.Queue[Conversation] = asyncio.Queue()
            for conv in workload.conversations:
                queue.put_nowait(conv)

            async def worker() -> None:
                while True:
                    try:
                        conv = queue.get_nowait()
                    except asyncio.QueueEmpty:
                        return
                    await _play(
                        http,
                        url,
                        model,
                        conv,
                        t0,
                        records,
                        wait_for_start=False,
                        session_header=session_header,
                        timeout_s=timeout_s,
                        pick_url=pick_url,
                    )

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return records, wall
