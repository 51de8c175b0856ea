"""Renders deploy/grafana/llmgw.json with matplotlib from the same queries, against the
simulated demo fleet behind `llmgw proxy` (the edge that sees first tokens, so predicted vs
observed TTFT has data), plus an on-demand model started mid-run and a replica that fails
for a while. /metrics of the proxy and of every replica is scraped each second into an
in-memory store; `bench/promql_lite.py` evaluates the panels' PromQL over it.

    python -m bench.dashboard_png [--seconds 60] [--out bench/results/dashboard.png]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.promql_lite import Store, evaluate
from llmgw.asgi.app import ProxyApp
from llmgw.asgi.testing import serve
from llmgw.cli.demo import demo_fleet
from llmgw.config import load_dict

ROOT = Path(__file__).resolve().parent
DASHBOARD = ROOT.parent / "deploy" / "grafana" / "llmgw.json"
SIM = f"{shlex.quote(sys.executable)} -m llmgw.sim --port {{port}} --model {{model}}"
VARIABLES = {"$model": ".*", "$__rate_interval": "10s"}


def legend(fmt: str, labels: dict[str, str]) -> str:
    out = fmt
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value)
    return out.replace("{{model}}", "").strip() or "value"


def load(base: str, seconds: float, stop: threading.Event, fleet: Any) -> None:
    """8 chat sessions with growing histories, some one-offs and bad requests; an on-demand
    model asked for at 1/4 of the run; from 1/2 to 2/3 of it replica 2 answers 500 and
    replica 3's /metrics fails."""
    rng = random.Random(1)
    began = time.monotonic()
    with httpx.Client(base_url=base, timeout=30) as client:
        histories: dict[str, list[dict[str, str]]] = {}
        faulted = lazy_asked = False
        while not stop.is_set() and time.monotonic() - began < seconds:
            elapsed = (time.monotonic() - began) / seconds
            if not faulted and elapsed > 0.5:
                fleet.set_faults(2, error_rate=1.0, status=500)
                fleet.set_faults(3, metrics="error")
                faulted = True
            if faulted and elapsed > 0.67:
                fleet.reset(2)
                fleet.reset(3)
            session = f"user-{rng.randrange(8)}"
            history = histories.setdefault(
                session, [{"role": "system", "content": "You are terse. " * 40}]
            )
            history.append({"role": "user", "content": f"question {len(history)} " * 30})
            model = "m1"
            if elapsed > 0.25 and (not lazy_asked or rng.random() < 0.1):
                model, lazy_asked = "lazy", True
            messages = history[:1] + history[-11:]  # the system prompt stays: a shared prefix
            body = {"model": model, "messages": messages, "max_tokens": 16, "stream": True}
            if rng.random() < 0.03:
                body["model"] = "no-such-model"
            reply = client.post(
                "/v1/chat/completions", json=body, headers={"x-session-id": session}
            )
            history.append({"role": "assistant", "content": reply.text[-200:]})
            time.sleep(0.02)  # a pacing client, not synchronisation


async def run(seconds: float) -> Store:
    store = Store()
    fleet = demo_fleet()
    addresses = [u.removeprefix("http://") for u in fleet.urls]
    config = load_dict(
        {
            "models": {
                "m1": {"endpoints": addresses, "strategy": "latency"},
                "lazy": {
                    "launch": {"command": SIM, "expected_start_seconds": 3},
                    "scaling": {"min": 0, "max": 1, "idle_timeout": seconds / 4},
                },
            },
            "breaker": {"failure_threshold": 2, "base_cooldown": 1, "max_cooldown": 4},
            "scrape": {"interval": 0.1},
        }
    )
    app = ProxyApp(config)
    stop = threading.Event()
    try:
        async with serve(app) as base, httpx.AsyncClient(timeout=5) as client:
            worker = threading.Thread(target=load, args=(base, seconds, stop, fleet), daemon=True)
            began = time.monotonic()
            worker.start()
            while worker.is_alive():
                t = time.monotonic() - began
                store.ingest(t, (await client.get(base + "/metrics")).text)
                for address, url in zip(addresses, fleet.urls, strict=True):
                    page = await client.get(url + "/metrics")
                    if page.status_code == 200:  # a failed scrape is a gap, as in Prometheus
                        store.ingest(t, page.text, {"instance": address})
                await asyncio.sleep(1.0)  # the scrape interval
            await asyncio.to_thread(worker.join, 30)
    finally:
        stop.set()
        fleet.stop()
    return store


def render(store: Store, out: Path) -> dict[str, Any]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    times = sorted({t for points in store.series.values() for t, _ in points})
    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.1 * rows))
    summary: dict[str, Any] = {}
    for ax, panel in zip(axes.flat, panels, strict=False):
        drawn = 0
        for target in panel["targets"]:
            lines: dict[str, list[tuple[float, float]]] = {}
            for t in times:
                for labels, value in evaluate(target["expr"], store, t, VARIABLES).items():
                    if math.isfinite(value):
                        name = legend(target["legendFormat"], dict(labels))
                        lines.setdefault(name, []).append((t, value))
            for name, points in sorted(lines.items())[:8]:
                ax.plot([p[0] for p in points], [p[1] for p in points], label=name, lw=1.2)
                drawn += 1
        summary[panel["title"]] = drawn
        ax.set_title(panel["title"], fontsize=9)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("s", fontsize=7)
        unit = panel["fieldConfig"]["defaults"]["unit"]
        ax.set_ylabel(unit, fontsize=7)
        if drawn:
            ax.legend(fontsize=6, loc="upper left", ncol=2)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(dashboard["title"] + " (simulated demo fleet, llmgw proxy)", fontsize=12)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "dashboard.png")
    args = parser.parse_args()
    store = asyncio.run(run(args.seconds))
    summary = render(store, args.out)
    print(f"{'panel':60} series")
    for title, count in summary.items():
        print(f"{title:60} {count}")
    (ROOT / "results" / "dashboard.json").write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
