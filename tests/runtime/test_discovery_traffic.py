"""Discovery under live traffic: the embedded proxy (real HTTP) in front of simulated
engines that stand for pods, the fake API server listing them as a Service's slices."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
from kubernetes import client

from llmgw.asgi.app import ProxyApp
from llmgw.asgi.testing import (
    MODEL,
    ScriptedUpstream,
    held_stream,
    serve,
)
from llmgw.config import Config, load_dict
from llmgw.runtime.kube.discovery import Discovery
from llmgw.runtime.router import Router
from llmgw.sim import SimFleet
from llmgw.testing.fake_k8s import FakeKubernetes
from llmgw.testing.traffic import SessionTraffic, served_by
from llmgw.testing.wait import eventually

JSON = {"content-type": "application/json"}  # engines (vLLM) refuse bodies sent as anything else

NS = "models"
CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}]})


def service_config() -> Config:
    return load_dict(
        {
            "debug_headers": True,
            "scrape": {"interval": 0.05},
            "models": {
                MODEL: {
                    "discovery": {"service": {"namespace": NS, "name": "vllm"}},
                    "strategy": "ring",
                }
            },
        }
    )


@contextlib.asynccontextmanager
async def proxy_on(kube: FakeKubernetes, config: Config) -> AsyncIterator[tuple[Router, str]]:
    api: Any = client.ApiClient(client.Configuration(host=kube.host))
    discovery = Discovery(config, api_client=api, backoff=(0.02, 0.1))
    router = Router(config, discovery=discovery)
    try:
        async with serve(ProxyApp(config, router=router)) as base:
            yield router, base
    finally:
        api.close()


async def test_scale_2_to_4_to_1_under_session_traffic_fails_nothing_and_moves_only_moved_sessions(
    tmp_path: Any,
) -> None:
    async with (
        SimFleet(replicas=4, model=MODEL, time_scale=0, seed=3) as fleet,
        FakeKubernetes() as kube,
    ):
        pods = [f"127.0.0.1:{p}" for p in fleet.ports]
        kube.add_deployment("vllm", namespace=NS, pod_ports=fleet.ports, replicas=2)
        async with (
            proxy_on(kube, service_config()) as (router, base),
            httpx.AsyncClient(base_url=base, timeout=10.0) as http,
        ):
            registry = router.registry

            def routed() -> set[str]:
                return {s.id for s in registry.states(MODEL)}

            await eventually(lambda: routed() == set(pods[:2]))
            traffic = SessionTraffic(http, [f"session-{i}" for i in range(48)], BODY)
            workers = [asyncio.create_task(traffic.worker(i, 4)) for i in range(4)]
            try:
                two = await traffic.round()
                assert set(two.values()) == set(pods[:2])
                kube.scale("vllm", 4, namespace=NS)
                await eventually(lambda: routed() == set(pods))
                await eventually(lambda: registry.warming(MODEL) == 0)  # first scrapes
                four = await traffic.round()
                moved = [s for s in four if four[s] != two[s]]
                assert moved and all(four[s] in pods[2:] for s in moved), (two, four)
                kube.scale("vllm", 1, namespace=NS)
                await eventually(lambda: routed() == {pods[0]} and not registry.draining(MODEL))
                for replica in fleet.replicas[1:]:  # their pods are gone: nothing listens
                    await replica.stop()
                one = await traffic.round()
                assert set(one.values()) == {pods[0]}
                status = router.models_status()[MODEL]["discovery"]
                assert isinstance(status, dict) and status["endpoints"] == [pods[0]]
            finally:
                traffic.stop()
                await asyncio.gather(*workers)
            assert traffic.failures == [], traffic.failures[:5]
            assert traffic.sent > 3 * 48


async def test_a_pod_turning_not_ready_then_terminating_finishes_its_stream_and_gets_no_new_requests() -> (
    None
):
    release = asyncio.Event()

    upstream = await ScriptedUpstream(held_stream(release, CHAT)).start()
    port_a = int(upstream.address.rsplit(":", 1)[1])
    try:
        async with (
            SimFleet(replicas=1, model=MODEL, time_scale=0, seed=3) as fleet,
            FakeKubernetes() as kube,
        ):
            a, b = upstream.address, f"127.0.0.1:{fleet.ports[0]}"
            kube.add_deployment(
                "vllm", namespace=NS, pod_ports=[port_a, fleet.ports[0]], replicas=2
            )
            config = service_config()
            async with (
                proxy_on(kube, config) as (router, base),
                httpx.AsyncClient(base_url=base, timeout=10.0) as http,
            ):
                registry = router.registry
                await eventually(lambda: len(registry.states(MODEL)) == 2)
                ring = router.scheduler.routers[MODEL].ring_for(registry.states(MODEL))
                session = next(
                    s for s in (f"s{i}" for i in range(1000)) if ring.candidates(s)[0] == a
                )
                stream_body = orjson.dumps(
                    {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}]}
                )
                async with http.stream(
                    "POST", CHAT, content=stream_body, headers={**JSON, "x-session-id": session}
                ) as reply:
                    chunks = reply.aiter_raw()
                    first = await anext(chunks)
                    assert b"content" in first and served_by(reply) == a
                    kube.mark("vllm", port_a, ready=False, namespace=NS)
                    await eventually(lambda: registry.get(MODEL, a) is None)
                    kube.mark("vllm", port_a, ready=False, terminating=True, namespace=NS)
                    for _ in range(5):  # the same session: now on the other pod
                        again = await http.post(
                            CHAT, content=BODY, headers={**JSON, "x-session-id": session}
                        )
                        assert again.status_code == 200 and served_by(again) == b
                    assert [r.target for r in upstream.requests].count(CHAT) == 1
                    [draining] = registry.draining(MODEL)
                    assert draining.id == a and draining.inflight == 1
                    release.set()
                    rest = b"".join([chunk_ async for chunk_ in chunks])
                assert reply.status_code == 200 and b"[DONE]" in rest
                await eventually(lambda: not registry.draining(MODEL))
    finally:
        await upstream.stop()
