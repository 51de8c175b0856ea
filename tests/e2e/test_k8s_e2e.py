"""Kubernetes discovery end to end: real Envoy (ORIGINAL_DST) + the ext_proc server, the
fake API server listing simulated engines as a Service's pods (their loopback addresses),
credentials from KUBECONFIG as in a real deployment."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import yaml

from llmgw.asgi.testing import (
    ScriptedUpstream,
    held_stream,
)
from llmgw.config import Config, load_dict
from llmgw.sim import ThreadedFleet
from llmgw.testing.extproc import EnvoyProcess, ExtProcThread, loopback_bootstrap
from llmgw.testing.fake_k8s import FakeKubernetes
from llmgw.testing.traffic import SessionTraffic, served_by
from llmgw.testing.wait import eventually

JSON = {"content-type": "application/json"}  # engines (vLLM) refuse bodies sent as anything else

NS = "models"
MODEL = "m1"
CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}]})
SESSIONS = [f"session-{i}" for i in range(32)]
pytestmark = pytest.mark.e2e


@pytest.fixture
async def kube(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeKubernetes]:
    """The fake API server on this test's loop, and a kubeconfig pointing at it."""
    async with FakeKubernetes() as fake:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "fake", "cluster": {"server": fake.host}}],
                    "users": [{"name": "u", "user": {"token": "t"}}],
                    "contexts": [{"name": "c", "context": {"cluster": "fake", "user": "u"}}],
                    "current-context": "c",
                }
            )
        )
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield fake


@pytest.fixture
def fleet(sim_fleet: ThreadedFleet) -> Iterator[ThreadedFleet]:
    yield sim_fleet
    for i in range(len(sim_fleet.ports)):
        sim_fleet.reset(i)


def discovered_config() -> Config:
    return load_dict(
        {
            "debug_headers": True,
            "scrape": {"interval": 0.05, "staleness": 1.0},
            "models": {
                MODEL: {
                    "discovery": {"service": {"namespace": NS, "name": "vllm"}},
                    "strategy": "ring",
                }
            },
        }
    )


@contextlib.asynccontextmanager
async def envoy_stack(config: Config, envoy_path: str) -> AsyncIterator[tuple[ExtProcThread, str]]:
    # Built off this loop: the ext_proc server lists from the fake API server, which this
    # loop serves.
    extproc = await asyncio.to_thread(ExtProcThread, config)
    try:
        envoy = await asyncio.to_thread(
            EnvoyProcess,
            loopback_bootstrap(
                config,
                extproc.address,
                shape="original-dst",
                message_timeout=5.0,
                connect_timeout=0.5,
            ),
        )
        try:
            yield extproc, envoy.url
        finally:
            await asyncio.to_thread(envoy.stop)
    finally:
        await asyncio.to_thread(extproc.stop)


async def routed(extproc: ExtProcThread) -> set[str]:
    registry = extproc.scheduler.registry
    return set(
        await asyncio.to_thread(extproc.call, lambda: [s.id for s in registry.states(MODEL)])
    )


async def wait_routed(extproc: ExtProcThread, wanted: set[str]) -> None:
    """Until exactly `wanted` is routed and nothing is in flight on pods that left."""
    registry = extproc.scheduler.registry

    def draining() -> int:
        return len(registry.draining(MODEL))

    async with asyncio.timeout(10.0):
        while (
            await routed(extproc) != wanted or await asyncio.to_thread(extproc.call, draining) > 0
        ):
            await asyncio.sleep(0.01)


async def test_scale_2_to_4_to_1_through_envoy_fails_nothing_and_moves_only_moved_sessions(
    kube: FakeKubernetes, fleet: ThreadedFleet, envoy_path: str
) -> None:
    pods = [f"127.0.0.1:{p}" for p in fleet.ports]
    kube.add_deployment("vllm", namespace=NS, pod_ports=fleet.ports, replicas=2)
    await eventually(lambda: sum(p.ready for p in kube.deployments[(NS, "vllm")].pods) == 2)
    async with (
        envoy_stack(discovered_config(), envoy_path) as (extproc, url),
        httpx.AsyncClient(base_url=url, timeout=10.0) as http,
    ):
        await wait_routed(extproc, set(pods[:2]))
        traffic = SessionTraffic(http, SESSIONS, BODY)
        workers = [asyncio.create_task(traffic.worker(i, 2)) for i in range(2)]
        try:
            two = await traffic.round()
            kube.scale("vllm", 4, namespace=NS)
            await wait_routed(extproc, set(pods))
            four = await traffic.round()
            moved = [s for s in SESSIONS if four[s] != two[s]]
            assert moved and all(four[s] in pods[2:] for s in moved), (two, four)
            kube.scale("vllm", 1, namespace=NS)
            await wait_routed(extproc, {pods[0]})
            for i in range(1, 4):  # their pods are gone: a request there would get a 500
                await asyncio.to_thread(fleet.set_faults, i, error_rate=1.0, status=500)
            one = await traffic.round()
            assert set(one.values()) == {pods[0]}
        finally:
            traffic.stop()
            await asyncio.gather(*workers)
    assert traffic.failures == [], traffic.failures[:5]


async def test_rolling_update_and_an_api_outage_through_envoy_fail_nothing(
    kube: FakeKubernetes, fleet: ThreadedFleet, envoy_path: str
) -> None:
    pods = [f"127.0.0.1:{p}" for p in fleet.ports]
    kube.add_deployment("vllm", namespace=NS, pod_ports=fleet.ports[:2], replicas=2)
    await eventually(lambda: sum(p.ready for p in kube.deployments[(NS, "vllm")].pods) == 2)
    async with (
        envoy_stack(discovered_config(), envoy_path) as (extproc, url),
        httpx.AsyncClient(base_url=url, timeout=10.0) as http,
    ):
        await wait_routed(extproc, set(pods[:2]))
        traffic = SessionTraffic(http, SESSIONS, BODY)
        workers = [asyncio.create_task(traffic.worker(i, 2)) for i in range(2)]
        try:
            kube.rollout("vllm", fleet.ports[2:], namespace=NS)  # every address changes
            await wait_routed(extproc, set(pods[2:]))
            for i in range(2):
                await asyncio.to_thread(fleet.set_faults, i, error_rate=1.0, status=500)
            assert set((await traffic.round()).values()) == set(pods[2:])
            await kube.go_down()  # llmgw keeps routing on what it last saw
            discovery = extproc.server.router.discovery
            assert discovery is not None
            await eventually(lambda: discovery.staleness()[MODEL] > 0)
            sent = traffic.sent
            await eventually(lambda: traffic.sent > sent + 20)
            assert await routed(extproc) == set(pods[2:])
            metrics = (await http.get(f"http://127.0.0.1:{extproc.ports['metrics']}/metrics")).text
            assert 'llmgw_discovery_stale_seconds{model="m1"}' in metrics
            await kube.come_back()
            await eventually(lambda: discovery.staleness()[MODEL] == 0)
        finally:
            traffic.stop()
            await asyncio.gather(*workers)
    assert traffic.failures == [], traffic.failures[:5]


OUTAGE = 30.0  # seconds: issue 15's "API server unreachable for 30 s"
MAX_BACKOFF = 30.0 * 1.2  # the reflector's retry cap, with its +20 % jitter
STALE = re.compile(r'^llmgw_discovery_stale_seconds\{model="m1"\} (\S+)$', re.MULTILINE)


class Records(logging.Handler):
    """Keeps llmgw.k8s records (caplog misses them once `llmgw.logs.configure` has run)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.slow
async def test_a_30s_api_outage_through_envoy_fails_nothing_and_a_change_made_meanwhile_lands_after(
    kube: FakeKubernetes, fleet: ThreadedFleet, envoy_path: str
) -> None:
    pods = [f"127.0.0.1:{p}" for p in fleet.ports]
    kube.add_deployment("vllm", namespace=NS, pod_ports=fleet.ports, replicas=2)
    await eventually(lambda: sum(p.ready for p in kube.deployments[(NS, "vllm")].pods) == 2)
    k8s_log = logging.getLogger("llmgw.k8s")
    records = Records()
    level = k8s_log.level
    k8s_log.addHandler(records)
    k8s_log.setLevel(logging.INFO)
    async with (
        envoy_stack(discovered_config(), envoy_path) as (extproc, url),
        httpx.AsyncClient(base_url=url, timeout=10.0) as http,
    ):
        await wait_routed(extproc, set(pods[:2]))
        metrics_url = f"http://127.0.0.1:{extproc.ports['metrics']}/metrics"
        traffic = SessionTraffic(http, SESSIONS, BODY)
        workers = [asyncio.create_task(traffic.worker(i, 2)) for i in range(2)]
        stale: list[float] = []
        try:
            await traffic.round()
            at_down = traffic.sent
            await kube.go_down()
            ends = time.monotonic() + OUTAGE
            scaled = False
            while time.monotonic() < ends:  # the scenario's length, sampling /metrics
                found = STALE.search((await http.get(metrics_url)).text)
                assert found is not None
                stale.append(float(found.group(1)))
                if not scaled and time.monotonic() > ends - OUTAGE / 2:
                    kube.scale("vllm", 3, namespace=NS)  # a pod added while llmgw is blind
                    scaled = True
                await asyncio.sleep(1.0)
            assert await routed(extproc) == set(pods[:2])  # the last known fleet, kept
            sent = traffic.sent
            assert sent > at_down + OUTAGE  # traffic went on: over one request a second
            await kube.come_back()
            back = time.monotonic()
            async with asyncio.timeout(MAX_BACKOFF + 5.0):
                while await routed(extproc) != set(pods[:3]):
                    await asyncio.sleep(0.05)
            catch_up = time.monotonic() - back
            print(
                f"\n{OUTAGE:g}s API outage: {sent - at_down} requests meanwhile, stale max "
                f"{max(stale):.1f}s, change caught up {catch_up:.1f}s after the API returned"
            )
            await eventually(lambda: traffic.sent > sent + 20)
            assert pods[2] in set((await traffic.round()).values())
        finally:
            traffic.stop()
            await asyncio.gather(*workers)
            k8s_log.removeHandler(records)
            k8s_log.setLevel(level)
    assert traffic.failures == [], traffic.failures[:5]
    assert max(stale) > OUTAGE - 5.0, stale
    lost = [r.getMessage() for r in records.records if "Kubernetes API lost" in r.getMessage()]
    assert len(lost) == 1 and " since " in lost[0], lost
    assert sum("reachable again" in r.getMessage() for r in records.records) == 1


async def test_a_pod_turning_not_ready_finishes_its_stream_through_envoy_and_gets_no_new_request(
    kube: FakeKubernetes, fleet: ThreadedFleet, envoy_path: str
) -> None:
    release = asyncio.Event()

    upstream = await ScriptedUpstream(held_stream(release, CHAT)).start()
    try:
        port_a = int(upstream.address.rsplit(":", 1)[1])
        a, b = upstream.address, f"127.0.0.1:{fleet.ports[0]}"
        kube.add_deployment("vllm", namespace=NS, pod_ports=[port_a, fleet.ports[0]], replicas=2)
        async with (
            envoy_stack(discovered_config(), envoy_path) as (extproc, url),
            httpx.AsyncClient(base_url=url, timeout=10.0) as http,
        ):
            await wait_routed(extproc, {a, b})
            scheduler = extproc.scheduler

            def ring_owner(session: str) -> str:
                states = scheduler.registry.states(MODEL)
                return scheduler.routers[MODEL].ring_for(states).candidates(session)[0]

            owners = await asyncio.to_thread(
                extproc.call, lambda: {f"s{i}": ring_owner(f"s{i}") for i in range(200)}
            )
            session = next(s for s, owner in owners.items() if owner == a)
            stream_body = orjson.dumps(
                {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}]}
            )
            async with http.stream(
                "POST", CHAT, content=stream_body, headers={**JSON, "x-session-id": session}
            ) as reply:
                chunks = reply.aiter_raw()
                assert b"content" in await anext(chunks)
                kube.mark("vllm", port_a, ready=False, namespace=NS)
                async with asyncio.timeout(10.0):
                    while await routed(extproc) != {b}:
                        await asyncio.sleep(0.01)
                kube.mark("vllm", port_a, ready=False, terminating=True, namespace=NS)
                for _ in range(5):  # the same session, while its old pod drains
                    again = await http.post(
                        CHAT, content=BODY, headers={**JSON, "x-session-id": session}
                    )
                    assert again.status_code == 200 and served_by(again) == b
                assert [r.target for r in upstream.requests].count(CHAT) == 1
                draining = await asyncio.to_thread(
                    extproc.call,
                    lambda: [(s.id, s.inflight) for s in scheduler.registry.draining(MODEL)],
                )
                assert draining == [(a, 1)]
                release.set()
                rest = b"".join([part async for part in chunks])
            assert reply.status_code == 200 and b"[DONE]" in rest
            await wait_routed(extproc, {b})  # and the draining pod's request has ended
    finally:
        await upstream.stop()
