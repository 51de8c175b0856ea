"""A second engine simulator, written apart from `llmgw/sim/`, for cross-checking routers.

llmgw's default strategy was once tuned to its own simulator and then lost on someone
else's. This module models a vLLM-like engine from what vLLM documents, with its own
choices wherever `llmgw/sim/` made one, so a ranking that holds on both is less likely to
be an artefact of either:

- **Tokens**: a word-piece stand-in, not 4 characters a token. Text splits into words and
  punctuation; a word is one token per 3 characters or part (`"conversation"` = 4), so
  the workloads' text runs ~3 characters a token. llmgw estimates 4 and must convert.
  Chat requests are rendered with a role-marker template first.
- **Scheduler** (vLLM v1-like): one loop per replica. A step's token budget
  (`--max-batched-tokens`, 1,024) first goes to running decodes (one token each), then
  to chunked prefills, running ones first, then waiting requests admitted FCFS while the
  batch has a free slot (`--max-seqs`, 12) and the KV cache can hold the prompt and its
  `max_tokens` (reserved at admission; a request that does not fit waits, head of line:
  no preemption). Step time = 8 ms + 50 us x prefill tokens in the step + 0.9 ms x
  sequences decoding. So an idle replica prefills 2,000 uncached tokens in ~2 steps (~116
  ms), and a full batch of 12 decodes at ~19 ms a token.
- **Prefix cache**: 16-token blocks, hash-chained over the token pieces. Blocks become
  hits for other requests only once their prefill has run (not at admission). Blocks no
  running request holds stay cached and are evicted least recently used when space is
  needed. As in vLLM, at most `prompt - 1` tokens hit (the last token is recomputed).
  Capacity `--kv-blocks`; the engine says it only with `--cache-info`.
- **HTTP**: headers at once (like vLLM), then the first SSE chunk (role and first token
  together) at the end of the step that finishes the prefill, one chunk per token.
  `--role-chunk at-once` sends a role-only chunk (`content: ""`) with the headers instead,
  as some OpenAI-compatible servers and simulators do: the first chunk is then no token.
- **Metrics**: vLLM v1 names; histograms for TTFT, e2e, queue and prefill time and
  inter-token latency, no per-request computed-token or inference-time histograms;
  `--metrics minimal` publishes only running, waiting and KV usage, `--metrics none`
  nothing (`/metrics` answers 404, as engines and simulators without Prometheus do). The
  bench reads the full set at `/xsim/metrics` whatever `--metrics` says.
- **Clients and faults**: a streaming request whose client disconnects is aborted (its
  slot and blocks freed, `finished_reason="abort"` counted), as vLLM does. `--degrade`
  makes a replica's steps slower for a while; `--outage` kills a replica for a while (port
  refused, streams cut) and restarts it empty, counters from zero.

    python -m bench.xsim.engine --replicas 4 --base-port 18600 --kv-blocks 1500

prints `READY url url ...` once every replica listens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import re
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

BLOCK = 16
_PIECES = re.compile(r"\w+|[^\w\s]")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


def tokenize(text: str) -> list[str]:
    """Word pieces: each word split into 3-character pieces, punctuation one each."""
    out: list[str] = []
    for word in _PIECES.findall(text):
        if len(word) <= 3:
            out.append(word)
        else:
            out.extend(word[i : i + 3] for i in range(0, len(word), 3))
    return out


def render_chat(messages: list[dict[str, Any]]) -> str:
    parts = [f"<|{m.get('role', 'user')}|>\n{m.get('content') or ''}<|end|>\n" for m in messages]
    return "".join(parts) + "<|assistant|>\n"


def block_hashes(tokens: list[str]) -> list[int]:
    out: list[int] = []
    parent = 0
    for i in range(0, len(tokens) - BLOCK + 1, BLOCK):
        parent = hash((parent, tuple(tokens[i : i + BLOCK])))
        out.append(parent)
    return out


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str, labels: str) -> list[str]:
        counts = self.counts or [0] * len(self.buckets)
        out = [
            f'{name}_bucket{{{labels},le="{edge}"}} {c}'
            for edge, c in zip(self.buckets, counts, strict=True)
        ]
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.n}')
        out.append(f"{name}_sum{{{labels}}} {self.total}")
        out.append(f"{name}_count{{{labels}}} {self.n}")
        return out


CUT = -1  # on a request's queue when its engine crashed: its handler ends at once


@dataclass
class Request:
    hashes: list[int]
    prompt: int
    max_tokens: int
    arrived: float
    out: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)  # tokens, CUT, None
    cached: int = 0  # tokens hit at admission
    done_prefill: int = 0  # of the tokens to compute
    generated: int = 0
    held: list[int] = field(default_factory=list)  # cached block hashes it references
    private: int = 0  # blocks it holds that are not (yet) in the cache
    admitted: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0
    # The client went away (`Engine.abort`): dropped at the next step, like vLLM's abort.
    aborted: bool = False

    @property
    def to_compute(self) -> int:
        return self.prompt - self.cached

    @property
    def finished(self) -> bool:
        return self.generated >= self.max_tokens


@dataclass(frozen=True)
class EngineParams:
    kv_blocks: int = 1500
    max_seqs: int = 12
    max_batched_tokens: int = 1024
    step_s: float = 0.008
    prefill_s_per_token: float = 50e-6
    decode_s_per_seq: float = 0.0009
    metrics: str = "full"
    cache_info: bool = False
    role_at_once: bool = False  # a role-only chunk with the headers (`--role-chunk at-once`)
    # Degraded (`--degrade`): every step takes `slow_factor` x as long from `slow_from` to
    # `slow_until` seconds after the last reset (a throttled GPU, a noisy neighbour).
    slow_factor: float = 1.0
    slow_from: float = 0.0
    slow_until: float = 0.0


class Engine:
    def __init__(self, name: str, params: EngineParams) -> None:
        self.name = name
        self.p = params
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.wake = asyncio.Event()
        self.armed_at: float | None = None  # last /admin/reset (a crash resets, not this)
        self.reset()

    def reset(self) -> None:
        self.reset_at = time.monotonic()
        self.cache: dict[int, int] = {}  # hash -> references by running requests
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, LRU first
        self.private_blocks = 0
        self.counters = {
            "prompt": 0, "generation": 0, "queries": 0, "hits": 0, "success": 0, "abort": 0,
        }  # fmt: skip
        self.hist = {
            "time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
            "e2e_request_latency_seconds": Histogram(LATENCY_BUCKETS),
            "request_queue_time_seconds": Histogram(LATENCY_BUCKETS),
            "request_prefill_time_seconds": Histogram(LATENCY_BUCKETS),
            "inter_token_latency_seconds": Histogram(ITL_BUCKETS),
        }

    # -- KV cache ----------------------------------------------------------------------------

    def _free(self) -> int:
        return self.p.kv_blocks - len(self.cache) - self.private_blocks

    def _make_room(self, blocks: int) -> bool:
        if self._free() + len(self.evictable) < blocks:
            return False
        while self._free() < blocks:
            victim, _ = self.evictable.popitem(last=False)
            del self.cache[victim]
        return True

    def _try_admit(self, r: Request) -> bool:
        hit = 0
        for h in r.hashes:
            if h not in self.cache:
                break
            hit += 1
        hit_tokens = min(hit * BLOCK, r.prompt - 1)
        hit = hit_tokens // BLOCK
        need = -(-(r.prompt + r.max_tokens) // BLOCK) - hit
        # Referencing an evictable hit block takes it off the LRU list, so it can't pay
        # for the new blocks: count those out first.
        protected = sum(1 for h in r.hashes[:hit] if h in self.evictable)
        if self._free() + len(self.evictable) - protected < need:
            return False
        for h in r.hashes[:hit]:
            self.cache[h] += 1
            self.evictable.pop(h, None)
        if not self._make_room(need):  # cannot fail after the check above
            raise RuntimeError("KV accounting")
        r.held = list(r.hashes[:hit])
        r.private = need
        self.private_blocks += need
        r.cached = hit_tokens
        self.counters["queries"] += r.prompt
        self.counters["hits"] += hit_tokens
        self.counters["prompt"] += r.prompt
        return True

    def _publish_prefix(self, r: Request) -> None:
        """Prefill done: its full prompt blocks become hits for others."""
        for h in r.hashes[len(r.held) :]:
            if h in self.cache:
                self.cache[h] += 1
                self.evictable.pop(h, None)
            else:
                if r.private == 0:
                    break
                self.cache[h] = 1
                r.private -= 1
                self.private_blocks -= 1
            r.held.append(h)

    def _release(self, r: Request) -> None:
        # Tail first onto the LRU list, so a prompt's tail is evicted before its head (as
        # vLLM frees blocks): eviction shortens a cached prefix instead of breaking it.
        for h in reversed(r.held):
            refs = self.cache[h] - 1
            self.cache[h] = refs
            if refs == 0:
                self.evictable[h] = None
        self.private_blocks -= r.private
        r.held, r.private = [], 0

    # -- the loop ----------------------------------------------------------------------------

    def submit(self, r: Request) -> None:
        self.waiting.append(r)
        self.wake.set()

    def abort(self, r: Request) -> None:
        """The client closed the connection: the request leaves before the next step (its
        blocks freed, its prefix kept as evictable), as vLLM aborts a disconnected request."""
        if not r.finished and not r.aborted:
            r.aborted = True
            self.wake.set()

    def crash(self) -> None:
        """The process died (`--outage`): every request is cut, and the replica comes back
        as a restarted vLLM does: empty cache, every counter and histogram from zero."""
        for r in [*self.waiting, *self.running]:
            r.aborted = True
            r.out.put_nowait(CUT)
        self.waiting.clear()
        self.running = []
        self.reset()

    def _drop_aborted(self) -> None:
        gone = sum(1 for r in self.waiting if r.aborted)
        if gone:
            self.waiting = deque(r for r in self.waiting if not r.aborted)
            self.counters["abort"] += gone
        for r in [r for r in self.running if r.aborted]:
            self.running.remove(r)
            self._release(r)
            self.counters["abort"] += 1

    async def run(self) -> None:
        while True:
            if not self.running and not self.waiting:
                self.wake.clear()
                await self.wake.wait()
            self._drop_aborted()
            if not self.running and not self.waiting:
                continue
            budget = self.p.max_batched_tokens
            decoding = [r for r in self.running if r.done_prefill >= r.to_compute]
            budget -= len(decoding)
            plan: list[tuple[Request, int]] = []
            for r in self.running:
                if r.done_prefill < r.to_compute and budget > 0:
                    n = min(budget, r.to_compute - r.done_prefill)
                    plan.append((r, n))
                    budget -= n
            now = time.monotonic()
            while self.waiting and len(self.running) < self.p.max_seqs and budget > 0:
                head = self.waiting[0]
                if not self._try_admit(head):
                    break
                self.waiting.popleft()
                head.admitted = now
                self.hist["request_queue_time_seconds"].observe(now - head.arrived)
                self.running.append(head)
                n = min(budget, head.to_compute)
                plan.append((head, n))
                budget -= n
            prefill_tokens = sum(n for _, n in plan)
            step = (
                self.p.step_s
                + self.p.prefill_s_per_token * prefill_tokens
                + self.p.decode_s_per_seq * len(decoding)
            )
            if self.p.slow_factor != 1.0 and self.degraded(now):
                step *= self.p.slow_factor
            await asyncio.sleep(step)
            now = time.monotonic()
            for r, n in plan:
                if r.aborted:  # went away during the step: dropped before the next
                    continue
                r.done_prefill += n
                if r.done_prefill >= r.to_compute:  # first token at the end of this step
                    self._publish_prefix(r)
                    self._emit(r, now)
                    self.hist["time_to_first_token_seconds"].observe(now - r.arrived)
                    self.hist["request_prefill_time_seconds"].observe(now - r.admitted)
            for r in decoding:
                if not r.aborted:
                    self._emit(r, now)
            finished = [r for r in self.running if r.finished and not r.aborted]
            for r in finished:
                self.running.remove(r)
                self._release(r)
                self.counters["success"] += 1
                self.hist["e2e_request_latency_seconds"].observe(now - r.arrived)
                r.out.put_nowait(None)

    def degraded(self, now: float) -> bool:
        return self.p.slow_from <= now - self.reset_at < self.p.slow_until

    def _emit(self, r: Request, now: float) -> None:
        if r.generated:
            self.hist["inter_token_latency_seconds"].observe(now - r.last_token)
        else:
            r.first_token = now
        r.last_token = now
        r.generated += 1
        self.counters["generation"] += 1
        r.out.put_nowait(r.generated)

    # -- metrics -----------------------------------------------------------------------------

    def metrics(self, model: str, full: bool = False) -> str:
        """What the engine publishes (`--metrics`); everything with `full` (the bench's)."""
        labels = f'engine="0",model_name="{model}"'
        used = len(self.cache) - len(self.evictable) + self.private_blocks
        lines = [
            f"vllm:num_requests_running{{{labels}}} {len(self.running)}",
            f"vllm:num_requests_waiting{{{labels}}} {len(self.waiting)}",
            f"vllm:kv_cache_usage_perc{{{labels}}} {used / self.p.kv_blocks}",
        ]
        if self.p.metrics == "minimal" and not full:
            return "\n".join(lines) + "\n"
        c = self.counters
        lines += [
            f"vllm:prompt_tokens_total{{{labels}}} {c['prompt']}",
            f"vllm:generation_tokens_total{{{labels}}} {c['generation']}",
            f"vllm:prefix_cache_queries_total{{{labels}}} {c['queries']}",
            f"vllm:prefix_cache_hits_total{{{labels}}} {c['hits']}",
            f'vllm:request_success_total{{{labels},finished_reason="length"}} {c["success"]}',
            f'vllm:request_success_total{{{labels},finished_reason="abort"}} {c["abort"]}',
        ]
        for name, hist in self.hist.items():
            lines += hist.lines("vllm:" + name, labels)
        if self.p.cache_info:
            lines.append(
                f'vllm:cache_config_info{{block_size="{BLOCK}",engine="0",'
                f'num_gpu_blocks="{self.p.kv_blocks}"}} 1.0'
            )
        return "\n".join(lines) + "\n"


# -- HTTP ------------------------------------------------------------------------------------


def _chunk(rid: str, model: str, content: str | None, role: bool, finish: str | None) -> bytes:
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    body = {
        "id": rid, "object": "chat.completion.chunk", "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }  # fmt: skip
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def make_app(engine: Engine, model: str, index: int) -> web.Application:
    counter = iter(range(1 << 62))

    async def completions(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": {"message": "body is not JSON"}}, status=400)
        if body.get("model") not in (model, None):
            return web.json_response({"error": {"message": "unknown model"}}, status=404)
        text = render_chat(body["messages"]) if "messages" in body else str(body.get("prompt", ""))
        tokens = tokenize(text)
        # vLLM reads OpenAI's newer name first (sglang-router rewrites to it).
        max_tokens = max(1, int(body.get("max_completion_tokens") or body.get("max_tokens") or 16))
        if -(-(len(tokens) + max_tokens) // BLOCK) > engine.p.kv_blocks:
            message = f"prompt of {len(tokens)} tokens + max_tokens does not fit the KV cache"
            return web.json_response({"error": {"message": message}}, status=400)
        r = Request(block_hashes(tokens), len(tokens), max_tokens, time.monotonic())
        engine.submit(r)
        rid = f"cmpl-{index}-{next(counter)}"
        if not body.get("stream"):
            while (n := await r.out.get()) is not None:
                if n == CUT:  # crashed: the connection is gone already
                    return web.Response(status=500)
            return web.json_response(
                {
                    "id": rid, "object": "chat.completion", "model": model,
                    "choices": [{"index": 0, "message": {"role": "assistant",
                                 "content": " tok" * max_tokens}, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": r.prompt, "completion_tokens": max_tokens,
                              "total_tokens": r.prompt + max_tokens},
                },
                headers={"x-sim-replica": str(index)},
            )  # fmt: skip
        response = web.StreamResponse(
            headers={"content-type": "text/event-stream", "x-sim-replica": str(index)}
        )
        try:
            await response.prepare(request)  # headers now, before any token (like vLLM)
            role_at_once = engine.p.role_at_once
            if role_at_once:
                await response.write(_chunk(rid, model, "", True, None))
            while (n := await r.out.get()) is not None:
                if n == CUT:
                    return response
                finish = "length" if n >= max_tokens else None
                role = n == 1 and not role_at_once
                await response.write(_chunk(rid, model, " tok", role, finish))
        except ConnectionResetError:  # a write to a closed connection: the client has gone
            return response
        finally:
            engine.abort(r)  # no-op once finished
        usage = {"prompt_tokens": r.prompt, "completion_tokens": r.generated,
                 "total_tokens": r.prompt + r.generated}  # fmt: skip
        options = body.get("stream_options") or {}
        if options.get("include_usage"):
            tail = {"id": rid, "object": "chat.completion.chunk", "model": model,
                    "choices": [], "usage": usage}  # fmt: skip
            await response.write(b"data: " + json.dumps(tail).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def metrics(_: web.Request) -> web.Response:
        if engine.p.metrics == "none":
            return web.Response(status=404, text="no metrics here\n")
        return web.Response(text=engine.metrics(model), content_type="text/plain")

    async def bench_metrics(_: web.Request) -> web.Response:
        return web.Response(text=engine.metrics(model, full=True), content_type="text/plain")

    async def reset(_: web.Request) -> web.Response:
        if engine.running or engine.waiting:
            return web.json_response({"error": {"message": "busy"}}, status=409)
        engine.reset()
        engine.armed_at = engine.reset_at  # the outage clock (`--outage`) starts here
        return web.json_response({"reset": True})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/xsim/metrics", bench_metrics)
    app.router.add_post("/admin/reset", reset)
    return app


def parse_degrade(spec: str) -> dict[int, tuple[float, float, float]]:
    """`REPLICA:FROM:UNTIL:FACTOR[,...]` (seconds after each reset; UNTIL may be `inf`: for
    good) -> each replica's (FROM, UNTIL, FACTOR)."""
    out: dict[int, tuple[float, float, float]] = {}
    for one in spec.split(","):
        parts = one.split(":")
        if len(parts) != 4:
            raise ValueError(f"--degrade wants REPLICA:FROM:UNTIL:FACTOR, got {one!r}")
        replica, start, until, factor = int(parts[0]), *(float(p) for p in parts[1:])
        if replica < 0 or not 0 <= start < until or factor <= 0:
            raise ValueError(f"--degrade {one!r}: want replica >= 0, 0 <= FROM < UNTIL, FACTOR > 0")
        if replica in out:
            raise ValueError(f"--degrade {spec!r}: replica {replica} named twice")
        out[replica] = (start, until, factor)
    return out


def parse_outage(spec: str) -> tuple[int, float, float]:
    """`REPLICA:FROM:UNTIL` (seconds after each /admin/reset) -> (REPLICA, FROM, UNTIL)."""
    parts = spec.split(":")
    if len(parts) != 3:
        raise ValueError(f"--outage wants REPLICA:FROM:UNTIL, got {spec!r}")
    replica, start, until = int(parts[0]), float(parts[1]), float(parts[2])
    if replica < 0 or not 0 <= start < until < math.inf:
        raise ValueError(f"--outage {spec!r}: want replica >= 0, 0 <= FROM < UNTIL < inf")
    return replica, start, until


TICK_S = 0.02  # how often an outage's clock is read (the simulator's clock, not a sync)


async def _outage(runner: web.AppRunner, site: web.TCPSite, engine: Engine,
                  port: int, start: float, until: float) -> None:  # fmt: skip
    """From FROM to UNTIL seconds after each /admin/reset the replica is dead: its port
    refuses connections, open connections drop, requests in flight are cut; then it
    restarts empty (`Engine.crash`)."""
    down = False
    while True:
        await asyncio.sleep(TICK_S)
        since = None if engine.armed_at is None else time.monotonic() - engine.armed_at
        should = since is not None and start <= since < until
        if should and not down:
            await site.stop()
            assert runner.server is not None
            for connection in list(runner.server.connections):
                connection.force_close()
            engine.crash()
            down = True
        elif down and not should:
            site = web.TCPSite(runner, "127.0.0.1", port)
            await site.start()
            down = False


class _Http2ProbeFilter(logging.Filter):
    """Drops aiohttp's traceback for an HTTP/2 connection preface (`PRI * HTTP/2.0`):
    sglang-router tries one on each engine and falls back to HTTP/1.1 on the 400, as it
    does on vLLM's server; the traceback per connection buried the bench's table."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, BadHttpMessage) and "PRI" in str(exc))


async def serve(
    replicas: int,
    base_port: int,
    model: str,
    params: EngineParams,
    degrade: str | None = None,
    outage: str | None = None,
) -> None:
    logging.getLogger("aiohttp.server").addFilter(_Http2ProbeFilter())
    runners: list[web.AppRunner] = []
    tasks: list[asyncio.Task[None]] = []
    urls: list[str] = []
    slow = parse_degrade(degrade) if degrade else {}
    dead = parse_outage(outage) if outage else None
    if dead is not None and dead[0] >= replicas:
        raise ValueError(f"--outage names replica {dead[0]} of {replicas} (they count from 0)")
    for i in range(replicas):
        own = params
        if i in slow:
            start, until, factor = slow[i]
            own = replace(params, slow_from=start, slow_until=until, slow_factor=factor)
        engine = Engine(f"r{i}", own)
        tasks.append(asyncio.create_task(engine.run()))
        runner = web.AppRunner(make_app(engine, model, i), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", base_port + i)
        await site.start()
        if dead is not None and dead[0] == i:
            tasks.append(asyncio.create_task(_outage(runner, site, engine, base_port + i,
                                                     dead[1], dead[2])))  # fmt: skip
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{base_port + i}")
    print("READY " + " ".join(urls), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for runner in runners:
            await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="independent vLLM-like engine simulator")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--base-port", type=int, required=True)
    parser.add_argument("--model", default="m1")
    parser.add_argument("--kv-blocks", type=int, default=EngineParams.kv_blocks)
    parser.add_argument("--max-seqs", type=int, default=EngineParams.max_seqs)
    parser.add_argument("--max-batched-tokens", type=int, default=EngineParams.max_batched_tokens)
    parser.add_argument("--metrics", choices=("full", "minimal", "none"), default="full")
    parser.add_argument("--cache-info", action="store_true")
    parser.add_argument(
        "--role-chunk",
        choices=("with-token", "at-once"),
        default="with-token",
        help="the chat stream's role chunk: with the first token (vLLM), or alone at once",
    )
    parser.add_argument(
        "--degrade",
        help="REPLICA:FROM:UNTIL:FACTOR[,...]: that replica's steps x FACTOR in the window",
    )
    parser.add_argument(
        "--outage",
        help="REPLICA:FROM:UNTIL: that replica is dead in the window, then restarts empty",
    )
    args = parser.parse_args(argv)
    params = EngineParams(
        kv_blocks=args.kv_blocks,
        max_seqs=args.max_seqs,
        max_batched_tokens=args.max_batched_tokens,
        metrics=args.metrics,
        cache_info=args.cache_info,
        role_at_once=args.role_chunk == "at-once",
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(
            serve(args.replicas, args.base_port, args.model, params, args.degrade, args.outage)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
