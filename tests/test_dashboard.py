"""deploy/grafana/llmgw.json: a current Grafana dashboard whose every PromQL query names only
series that both edges' live /metrics (or a vLLM engine's standard names) export."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.asgi.app import ProxyApp
from llmgw.asgi.testing import address_of, serve
from llmgw.config import Config, load_dict
from llmgw.extproc.server import ExtProcServer
from llmgw.runtime.ports import free_port
from llmgw.sim import SimFleet

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "llmgw.json"
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
}


def exprs(dashboard: dict[str, Any]) -> Iterator[str]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield target["expr"]


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords,
    label names (inside `{}` or `by (...)`), durations or strings."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", "", text)  # grouping labels
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word, rest = match.group(0), text[match.end() :].lstrip()
        if word in _KEYWORDS or rest.startswith("("):
            continue
        names.add(word)
    return names


def exported(text: str) -> set[str]:
    """Every series name a /metrics page offers (families without samples included)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        if not family.samples:  # not observed yet: what it will export once it is
            names.update(family.name + s for s in _SUFFIXES.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


def test_metric_names_are_extracted_from_promql() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (le, model) (rate(a_b_bucket{model=~"$m"}[5m])))'
        ' / sum without (x) (vllm:c_total) + max by (endpoint) (g{state!="closed"}) * 2'
    )
    assert metric_names(expr) == {"a_b_bucket", "vllm:c_total", "g"}


def test_the_dashboard_is_current_grafana_json_with_unique_panels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"] == "llmgw"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "model"} <= variables
    for panel in dashboard["panels"]:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}"
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("outcome", "error", "reason", "in flight", "kv", "breaker", "model state",
                  "cold start", "predicted", "stage", "freshness", "peer"):  # fmt: skip
        assert topic in titles, topic


def config_for(fleet: SimFleet) -> Config:
    """With `peers:` (a replica of its own; the peer series are exported only with it)."""
    addresses = [address_of(u) for u in fleet.urls]
    listen = f"127.0.0.1:{free_port()}"
    return load_dict(
        {
            "models": {"m1": {"endpoints": addresses, "strategy": "latency"}},
            "peers": {"listen": listen, "addresses": [listen]},
        }
    )


@pytest.fixture
async def fleet() -> Any:
    async with SimFleet(replicas=2, model="m1", time_scale=0, seed=3) as fleet:
        yield fleet


async def test_every_dashboard_query_names_series_both_edges_export(fleet: SimFleet) -> None:
    wanted = set().union(*(metric_names(e) for e in exprs(json.loads(DASHBOARD.read_text()))))
    body = {"model": "m1", "messages": [{"role": "user", "content": "hello"}]}
    async with httpx.AsyncClient(timeout=10) as client:
        engine = exported((await client.get(fleet.urls[0] + "/metrics")).text)
        # The proxy, after a routed request and a refused one.
        app = ProxyApp(config_for(fleet), scrape=False)
        async with serve(app) as base:
            assert (await client.post(base + "/v1/chat/completions", json=body)).status_code == 200
            # A streamed one is timed (observed, predicted, the error): their series exist
            # as observed, not as the page would name them before (a histogram with negative
            # buckets exports no _sum: a panel read one that never came).
            streamed = {**body, "stream": True}
            reply = await client.post(base + "/v1/chat/completions", json=streamed)
            assert reply.status_code == 200
            unknown = {**body, "model": "nope"}
            assert (
                await client.post(base + "/v1/chat/completions", json=unknown)
            ).status_code == 404
            proxy = exported((await client.get(base + "/metrics")).text)
        server = ExtProcServer(
            config_for(fleet), host="127.0.0.1", grpc_port=0, health_port=0, metrics_port=0
        )
        await server.start()
        try:
            page = await client.get(f"http://127.0.0.1:{server.ports['metrics']}/metrics")
            extproc = exported(page.text)
        finally:
            await server.stop(0)
    router_names = {n for n in wanted if n.startswith("llmgw_")}
    engine_names = {n for n in wanted if n.startswith("vllm:")}
    assert router_names and engine_names and router_names | engine_names == wanted
    assert router_names <= proxy, sorted(router_names - proxy)
    assert router_names <= extproc, sorted(router_names - extproc)
    assert engine_names <= engine, sorted(engine_names - engine)
