"""On-demand activation end to end: real Envoy + ext_proc, and the ASGI proxy.

The local control plane starts simulated engines (`python -m llmgw.sim`) as processes.
"""

from __future__ import annotations

import asyncio
import shlex
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest

from llmgw.asgi.app import ProxyApp
from llmgw.asgi.testing import serve
from llmgw.config import Config, load_dict
from llmgw.testing.extproc import EnvoyProcess, ExtProcThread, loopback_bootstrap

pytestmark = pytest.mark.e2e

SIM = f"{shlex.quote(sys.executable)} -m llmgw.sim --port {{port}} --model {{model}} --decode-ms 50"


def make_config(
    *,
    activation_timeout: float = 30,
    idle_timeout: float = 600,
    start_delay: float = 0,
    **top_level: Any,
) -> Config:
    command = SIM if not start_delay else f"sh -c 'sleep {start_delay}; exec {SIM}'"
    return load_dict(
        {
            **top_level,
            "activation_timeout": activation_timeout,
            "activation_poll_interval": 0.05,
            "models": {
                **top_level.get("models", {}),
                "lazy": {
                    "launch": {"command": command, "expected_start_seconds": 5},
                    "scaling": {
                        "min": 0,
                        "max": 1,
                        "idle_timeout": idle_timeout,
                        "start_timeout": 30,
                    },
                },
                "off": {"launch": {"command": "false {port}"}, "scaling": {"min": 0, "max": 0}},
            },
        }
    )


@dataclass
class Edge:
    url: str
    status: Callable[[], dict[str, Any]]  # models_status()["lazy"], read on the edge's loop


@asynccontextmanager
async def envoy_edge(config: Config) -> AsyncIterator[Edge]:
    extproc = ExtProcThread(config, scrape=False)
    try:
        router = extproc.server.router
        assert router is not None
        with EnvoyProcess(
            loopback_bootstrap(
                config,
                extproc.address,
                message_timeout=60.0,
            )
        ) as envoy:
            yield Edge(envoy.url, lambda: extproc.call(lambda: router.models_status()["lazy"]))
    finally:
        extproc.stop()


@asynccontextmanager
async def proxy_edge(config: Config) -> AsyncIterator[Edge]:
    app = ProxyApp(config, scrape=False)
    async with serve(app) as url:
        yield Edge(url, lambda: app.router.models_status()["lazy"])


EDGES = {"envoy": envoy_edge, "proxy": proxy_edge}


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **extra,
    }


async def wait_state(edge: Edge, state: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while edge.status()["state"] != state:
        assert time.monotonic() < deadline, f"model never reached {state}: {edge.status()}"
        await asyncio.sleep(0.05)  # polling the router's state under a deadline


@pytest.fixture(params=sorted(EDGES))
def edge_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_twenty_cold_requests_wait_and_cause_one_start(edge_name: str) -> None:
    async with EDGES[edge_name](make_config()) as edge, httpx.AsyncClient(timeout=60) as client:
        replies = await asyncio.gather(
            *(client.post(f"{edge.url}/v1/chat/completions", json=chat("lazy")) for _ in range(20))
        )
        assert [r.status_code for r in replies] == [200] * 20
        assert edge.status()["starts"] == 1


async def test_short_timeout_is_503_retry_after_and_the_start_completes(edge_name: str) -> None:
    config = make_config(activation_timeout=0.3, start_delay=1.5)
    async with EDGES[edge_name](config) as edge, httpx.AsyncClient(timeout=60) as client:
        first = await client.post(f"{edge.url}/v1/chat/completions", json=chat("lazy"))
        assert first.status_code == 503
        assert 1 <= int(first.headers["retry-after"]) <= 60
        assert orjson.loads(first.content)["error"]["code"] == "model_loading"
        await wait_state(edge, "idle")
        second = await client.post(f"{edge.url}/v1/chat/completions", json=chat("lazy"))
        assert second.status_code == 200
        assert edge.status()["starts"] == 1


async def test_a_start_longer_than_upstream_read_timeout_is_waited_for_through_envoy() -> None:
    """The stream is silent while llmgw waits for the start: the route's idle timeout,
    upstream_read_timeout (600 s, here 1 s), ended it with Envoy's 504 although Envoy would
    wait message_timeout for llmgw's answer (found by a review helper)."""
    config = make_config(
        start_delay=2,
        limits={"upstream_read_timeout": 1.0},
        models={"m": {"endpoints": ["127.0.0.1:9"]}},  # the arrival route: its pool's
    )
    async with envoy_edge(config) as edge, httpx.AsyncClient(timeout=30) as client:
        reply = await client.post(f"{edge.url}/v1/chat/completions", json=chat("lazy"))
        assert reply.status_code == 200, reply.text


async def test_unknown_is_404_and_disabled_is_503_without_a_start(edge_name: str) -> None:
    async with EDGES[edge_name](make_config()) as edge, httpx.AsyncClient(timeout=30) as client:
        unknown = await client.post(f"{edge.url}/v1/chat/completions", json=chat("nope"))
        assert unknown.status_code == 404
        assert orjson.loads(unknown.content)["error"]["code"] == "model_not_found"
        disabled = await client.post(f"{edge.url}/v1/chat/completions", json=chat("off"))
        assert disabled.status_code == 503
        assert disabled.headers["x-should-retry"] == "false"
        assert orjson.loads(disabled.content)["error"]["code"] == "model_disabled"
        assert edge.status()["starts"] == 0


async def test_stream_outlives_idle_timeout_then_model_stops_and_restarts(edge_name: str) -> None:
    async with (
        EDGES[edge_name](make_config(idle_timeout=0.3)) as edge,
        httpx.AsyncClient(timeout=60) as client,
    ):
        body = chat("lazy", stream=True, max_tokens=30)  # 30 tokens x 50 ms: longer than idle
        async with client.stream("POST", f"{edge.url}/v1/chat/completions", json=body) as reply:
            assert reply.status_code == 200
            text = "".join([chunk async for chunk in reply.aiter_text()])
        assert text.rstrip().endswith("data: [DONE]")
        assert text.count("data: ") >= 31
        assert edge.status()["stops"] == 0  # never stopped under a running stream
        await wait_state(edge, "off")
        again = await client.post(f"{edge.url}/v1/chat/completions", json=chat("lazy"))
        assert again.status_code == 200
        assert edge.status()["starts"] == 2
