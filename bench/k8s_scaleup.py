"""How long a scale-up takes to receive traffic on Kubernetes: from the EndpointSlice event
that marks a new pod Ready to (a) the registry listing it, (b) its first scrape, (c) the
first request routed to it.

The fake API server (`llmgw.testing.fake_k8s`, real paths and JSON, watch) lists simulated
engines as a Service's pods; the embedded proxy serves steady session traffic (4 clients,
48 sessions, ring strategy) through the real Router, Discovery, Scraper and registry.
Each trial scales 2 -> 3, marks the new pod Ready (t0), measures, then scales back to 2.

    .venv/bin/python -m bench.k8s_scaleup [--trials 10] [--scrape-interval 0.1]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import httpx
import orjson

from bench._tools import format_table, write_results
from llmgw.asgi.app import ProxyApp
from llmgw.asgi.testing import MODEL, serve
from llmgw.config import load_dict
from llmgw.runtime.kube.discovery import Discovery
from llmgw.runtime.router import Router
from llmgw.sim import SimFleet
from llmgw.testing.fake_k8s import FakeKubernetes

NS = "models"
BODY = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})


async def wait_for(predicate: Any, timeout: float = 10.0) -> float:
    """Poll every millisecond; the monotonic time the predicate first held."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.001)
    return time.monotonic()


async def first_times(conditions: dict[str, Any], timeout: float = 10.0) -> dict[str, float]:
    """Poll every condition each millisecond; when each first held (monotonic seconds)."""
    seen: dict[str, float] = {}
    async with asyncio.timeout(timeout):
        while len(seen) < len(conditions):
            now = time.monotonic()
            for name, holds in conditions.items():
                if name not in seen and holds():
                    seen[name] = now
            await asyncio.sleep(0.001)
    return seen


async def traffic(http: httpx.AsyncClient, worker: int, stop: asyncio.Event) -> int:
    sent, i = 0, worker
    while not stop.is_set():
        await http.post(
            "/v1/chat/completions",
            content=BODY,
            headers={"x-session-id": f"s{i % 48}", "content-type": "application/json"},
        )
        sent, i = sent + 1, i + 4
    return sent


async def run(trials: int, scrape_interval: float) -> list[dict[str, Any]]:
    from kubernetes import client  # noqa: PLC0415

    config = load_dict(
        {
            "scrape": {"interval": scrape_interval},
            "models": {
                MODEL: {
                    "discovery": {"service": {"namespace": NS, "name": "vllm"}},
                    "strategy": "ring",
                }
            },
        }
    )
    rows: list[dict[str, Any]] = []
    async with (
        SimFleet(replicas=3, model=MODEL, time_scale=0, seed=1) as fleet,
        FakeKubernetes() as kube,
    ):
        deployment = kube.add_deployment("vllm", namespace=NS, pod_ports=fleet.ports)
        deployment.ready_after = 3600.0  # the trial marks the new pod Ready itself
        for pod_port in fleet.ports[:2]:
            kube.scale("vllm", len(deployment.pods) + 1, namespace=NS)
            kube.mark("vllm", pod_port, ready=True, namespace=NS)
        api: Any = client.ApiClient(client.Configuration(host=kube.host))
        router = Router(config, discovery=Discovery(config, api_client=api))
        app = ProxyApp(config, router=router)
        new = f"127.0.0.1:{fleet.ports[2]}"
        async with serve(app) as base, httpx.AsyncClient(base_url=base) as http:
            registry = router.registry
            await wait_for(lambda: len(registry.states(MODEL)) == 2)
            stop = asyncio.Event()
            workers = [asyncio.create_task(traffic(http, w, stop)) for w in range(4)]

            def routed_to_new() -> float:
                return sum(
                    sample.value
                    for metric in app.telemetry.registry.collect()
                    for sample in metric.samples
                    if sample.name == "llmgw_decisions_total"
                    and sample.labels.get("endpoint") == new
                )

            for trial in range(trials):
                kube.scale("vllm", 3, namespace=NS)
                await wait_for(lambda: len(deployment.pods) == 3)
                before = routed_to_new()
                t0 = time.monotonic()
                kube.mark("vllm", fleet.ports[2], ready=True, namespace=NS)
                seen = await first_times(
                    {
                        "listed": lambda: registry.get(MODEL, new) is not None,
                        "routed": lambda b=before: routed_to_new() > b,
                        "scraped": lambda: (
                            (s := registry.get(MODEL, new)) is not None
                            and s.scraped_at > float("-inf")
                        ),
                    }
                )
                listed, routed, scraped = seen["listed"], seen["routed"], seen["scraped"]
                rows.append(
                    {
                        "trial": trial + 1,
                        "event->registry ms": round((listed - t0) * 1000, 1),
                        "event->first routed ms": round((routed - t0) * 1000, 1),
                        "event->first scrape ms": round((scraped - t0) * 1000, 1),
                    }
                )
                kube.scale("vllm", 2, namespace=NS)
                await wait_for(
                    lambda: registry.get(MODEL, new) is None and len(deployment.pods) == 2
                )
                await wait_for(lambda: not registry.draining(MODEL))
            stop.set()
            await asyncio.gather(*workers)
        api.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--scrape-interval", type=float, default=0.1)
    args = parser.parse_args(argv)
    rows = asyncio.run(run(args.trials, args.scrape_interval))
    columns = [c for c in rows[0] if c != "trial"]
    summary = [
        {
            "": name,
            **{c: round(fn([r[c] for r in rows]), 1) for c in columns},
        }
        for name, fn in (
            ("median", statistics.median),
            ("max", max),
        )
    ]
    print(f"Scale-up to traffic on Kubernetes (fake API server, {args.trials} trials)")
    print(format_table(rows))
    print()
    print(format_table(summary))
    path = write_results(
        "k8s_scaleup",
        {"trials": rows, "summary": summary, "scrape_interval": args.scrape_interval},
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
