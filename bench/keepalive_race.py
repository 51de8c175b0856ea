"""Keep-alive races at both edges: a request sent on a connection the other side is closing.

    python bench/keepalive_race.py [--requests 240] [--loops 8] [--idle 0.5]

An HTTP/1.1 server that closes a connection left idle `--idle` s (uvicorn's keep-alive
rule: vLLM and SGLang close after 5 s) and a client that reuses its connection after a
pause drawn within `--jitter` s (15 ms) of that moment: the client's request and the server's close
cross on the wire, and the request is lost unless someone sends it again. `--loops`
clients at once, each on its own connection, `--requests` in all per row.

- **Envoy -> engine** (shape `original-dst`, no retry policy; Envoy's one worker pools
  the upstream connections for all clients, so their pauses time its reuse less exactly):
  the generated config's
  model-server clusters with `limits.upstream_idle_timeout` 1 h (Envoy's default, the
  generated config before session 44) and 0.8x the engine's idle time (the rule now: the
  shipped default is 4 s against the engines' 5 s).
- **client -> `llmgw proxy`**: the proxy as the server that closes idle connections,
  `limits.client_idle_timeout` at `--idle` (as uvicorn's 5 s was against client pools of
  15 s, aiohttp, or 60 s, balancers) and at 75 s (the default now), the client keeping
  its connection longer.

Counts answers that are not a 200 (or a transport error) per row. Prints a table, writes
bench/results/keepalive_race.json.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._tools import format_table, write_results  # noqa: E402
from llmgw.asgi.app import ProxyApp  # noqa: E402
from llmgw.asgi.protocol import guarded  # noqa: E402
from llmgw.asgi.testing import ScriptedUpstream, UpstreamRequest, serve  # noqa: E402
from llmgw.config import Config, load_dict  # noqa: E402
from llmgw.testing.extproc import EnvoyProcess, ExtProcThread, loopback_bootstrap  # noqa: E402

MODEL = "m1"
CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"


async def _engine(
    request: UpstreamRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """`{}` to the chat path, 404 to anything else (llmgw's scrapes)."""
    writer.write(ANSWER if request.target == CHAT else NOT_FOUND)
    await writer.drain()


async def _loops(
    send_factory: Callable[[], httpx.AsyncClient], args: argparse.Namespace
) -> Counter[str]:
    """`--loops` clients, each on its own connection: a request, a pause of `--idle` +-
    `--jitter` s, the next request, ..."""
    requests, loops, pause, jitter = args.requests, args.loops, args.idle, args.jitter
    outcomes: Counter[str] = Counter()
    rng = random.Random(1)
    per_loop = max(1, requests // loops)

    async def one(client: httpx.AsyncClient) -> None:
        for _ in range(per_loop):
            try:
                response = await client.post(CHAT, content=BODY)
                outcomes[str(response.status_code)] += 1
            except httpx.TransportError as exc:
                outcomes[type(exc).__name__] += 1
            await asyncio.sleep(pause + rng.uniform(-jitter, jitter))

    clients = [send_factory() for _ in range(loops)]
    try:
        await asyncio.gather(*(one(c) for c in clients))
    finally:
        for c in clients:
            await c.aclose()
    return outcomes


def _client(base: str) -> Callable[[], httpx.AsyncClient]:
    # One connection a client, kept far longer than any idle limit here; no retries.
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=3600)
    return lambda: httpx.AsyncClient(base_url=base, limits=limits, timeout=10.0)


async def envoy_row(envoy_idle: float, args: argparse.Namespace) -> dict[str, Any]:
    engine = ScriptedUpstream(_engine, keep_alive=args.idle)  # closes idle ones, as uvicorn
    await engine.start()
    config: Config = load_dict(
        {
            "models": {MODEL: {"endpoints": [engine.address]}},
            "limits": {"upstream_idle_timeout": envoy_idle},
        }
    )
    extproc = await asyncio.to_thread(ExtProcThread, config)
    try:
        bootstrap = loopback_bootstrap(
            config, extproc.address, shape="original-dst", message_timeout=5.0, connect_timeout=0.5
        )
        envoy = await asyncio.to_thread(EnvoyProcess, bootstrap)
        try:
            # The client keeps its connection to Envoy; Envoy's to the engine is what races.
            outcomes = await _loops(_client(envoy.url), args)
        finally:
            await asyncio.to_thread(envoy.stop)
    finally:
        await asyncio.to_thread(extproc.stop)
        await engine.stop()
    return _row(
        "Envoy -> engine", f"upstream_idle_timeout {envoy_idle:g} s", outcomes, engine.idle_closes
    )


async def proxy_row(client_idle: float, args: argparse.Namespace) -> dict[str, Any]:
    engine = ScriptedUpstream(_engine)  # the engine is not what races here
    await engine.start()
    config = load_dict(
        {
            "models": {MODEL: {"endpoints": [engine.address]}},
            "limits": {"client_idle_timeout": client_idle},
        }
    )
    app = ProxyApp(config, scrape=False)
    try:
        async with serve(app, http=guarded(config.limits)) as base:
            outcomes = await _loops(_client(base), args)
    finally:
        await engine.stop()
    return _row("client -> proxy", f"client_idle_timeout {client_idle:g} s", outcomes, None)


def _row(edge: str, setting: str, outcomes: Counter[str], closes: int | None) -> dict[str, Any]:
    total = sum(outcomes.values())
    failed = total - outcomes["200"]
    return {
        "edge": edge,
        "setting": setting,
        "requests": total,
        "failed": failed,
        "failed %": round(100 * failed / total, 1) if total else None,
        "kinds": ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()) if k != "200") or "-",
        "engine closes": closes,
    }


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [
        await envoy_row(3600.0, args),
        await envoy_row(args.idle * 0.8, args),
        await proxy_row(args.idle, args),
        await proxy_row(75.0, args),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=240, help="per row")
    parser.add_argument("--loops", type=int, default=8, help="clients at once")
    parser.add_argument("--idle", type=float, default=0.5, help="the closing side's idle limit, s")
    parser.add_argument(
        "--jitter", type=float, default=0.015, help="pauses within this of --idle, s"
    )
    parser.add_argument("--out", default="keepalive_race")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.loops < 1 or not 0 <= args.jitter < args.idle:
        parser.error("--requests and --loops must be >= 1, and 0 <= --jitter < --idle")
    started = time.monotonic()
    rows = asyncio.run(main_async(args))
    print(format_table(rows))
    path = write_results(args.out, {"args": vars(args), "rows": rows})
    print(f"{time.monotonic() - started:.0f} s; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
