"""Thousands of concurrent streams through the embedded proxy (a peer Python router is known
to fall over above ~1k): 2,000 streamed requests held open at once, all complete."""

from __future__ import annotations

import asyncio
import resource
import time
from typing import Any

import aiohttp
import pytest

from llmgw.sim.fleet import spawn

from .conftest import SpawnFn

pytestmark = pytest.mark.slow

STREAMS = 2000


def raise_fd_limit(wanted: int) -> None:
    """Children (the proxy, the sims) inherit it: each stream costs 2-3 descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 3 * STREAMS:
        pytest.skip(f"cannot raise the fd limit to {3 * STREAMS}")


async def drive(url: str) -> dict[str, Any]:
    stats: dict[str, int] = {"ok": 0, "failed": 0, "open": 0, "peak_open": 0}
    all_open = asyncio.Event()
    errors: list[str] = []

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        body = {
            "model": "m1",
            "messages": [{"role": "user", "content": f"stream {i}"}],
            "stream": True,
            "max_tokens": 6,
        }
        try:
            async with session.post(
                url + "/v1/chat/completions", json=body, headers={"x-session-id": f"c{i}"}
            ) as r:
                first = await r.content.readany()
                stats["open"] += 1
                stats["peak_open"] = max(stats["peak_open"], stats["open"])
                if stats["open"] >= STREAMS:
                    all_open.set()
                rest = await r.read()
                stats["open"] -= 1
                complete = r.status == 200 and (first + rest).rstrip().endswith(b"[DONE]")
        except (aiohttp.ClientError, TimeoutError) as exc:
            errors.append(repr(exc))
            complete = False
        stats["ok" if complete else "failed"] += 1

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(one(session, i) for i in range(STREAMS)))
    return {**stats, "errors": len(errors), "first_error": errors[0] if errors else None}


def test_2000_concurrent_streams_through_the_proxy_all_complete(spawn_proxy: SpawnFn) -> None:
    raise_fd_limit(16384)
    sim_args = ["--replicas", "4", "--base-port", "0", "--time-scale", "1", "--seed", "1"]
    # Slow enough that every stream is still open when the last one starts.
    sim_args += ["--decode-ms", "400", "--decode-batch-factor", "0", "--max-num-seqs", "4096"]
    sim_args += ["--max-queue", "8192", "--kv-blocks", "1000000"]
    with spawn(sim_args) as sim:
        proxy = spawn_proxy(
            {
                "models": {
                    "m1": {
                        "endpoints": [u.removeprefix("http://") for u in sim.urls],
                        "strategy": "chat",
                    }
                },
                "limits": {"upstream_max_connections": 2048},
            },
            log_level="warning",
        )
        started = time.monotonic()
        stats = asyncio.run(drive(proxy.url("http")))
        elapsed = time.monotonic() - started
        assert proxy.process.poll() is None, proxy.log()  # still alive
    assert stats["ok"] == STREAMS, (stats, proxy.log()[-2000:])
    assert stats["peak_open"] >= STREAMS * 0.9, stats  # really concurrent
    assert elapsed < 60
