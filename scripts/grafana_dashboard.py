"""Writes deploy/grafana/llmgw.json, the llmgw Grafana dashboard (schemaVersion 39).

    .venv/bin/python -m scripts.grafana_dashboard     # regenerate after changing a panel

Panels are data here (title, unit, queries) so the JSON stays consistent: one Prometheus
datasource variable, a `model` variable, rows of timeseries panels. `bench/dashboard_png.py`
renders the same queries with matplotlib; `tests/test_dashboard.py` checks every metric name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "llmgw.json"
W = "[$__rate_interval]"
M = 'model=~"$model"'
E = 'model_name=~"$model"'  # vLLM's label for the served model

# (row, [(title, unit, [(legend, expr)])])
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    (
        "Traffic",
        [
            (
                "Requests by model and outcome",
                "reqps",
                [
                    (
                        "{{model}} {{outcome}}",
                        f"sum by (model, outcome) (rate(llmgw_requests_total{{{M}}}{W}))",
                    )
                ],
            ),
            (
                "Errors answered by code and status",
                "reqps",
                [("{{status}} {{code}}", f"sum by (code, status) (rate(llmgw_errors_total{W}))")],
            ),
            (
                "Decisions by reason",
                "reqps",
                [
                    (
                        "{{reason}}",
                        f"sum by (reason) (rate(llmgw_decisions_total{{{M}}}{W}))",
                    )
                ],
            ),
            (
                "Decisions by endpoint",
                "reqps",
                [
                    (
                        "{{endpoint}}",
                        f"sum by (endpoint) (rate(llmgw_decisions_total{{{M}}}{W}))",
                    )
                ],
            ),
        ],
    ),
    (
        "Endpoints",
        [
            (
                "In flight per endpoint (router)",
                "short",
                [("{{endpoint}}", f"sum by (endpoint) (llmgw_inflight{{{M}}})")],
            ),
            (
                "Engine load: running and waiting",
                "short",
                [
                    (
                        "running {{instance}}",
                        f"sum by (instance) (vllm:num_requests_running{{{E}}})",
                    ),
                    (
                        "waiting {{instance}}",
                        f"sum by (instance) (vllm:num_requests_waiting{{{E}}})",
                    ),
                ],
            ),
            (
                "KV cache usage",
                "percentunit",
                [("{{instance}}", f"max by (instance) (vllm:kv_cache_usage_perc{{{E}}})")],
            ),
            (
                "Breaker not closed (1 = open or half-open)",
                "short",
                [
                    (
                        "{{endpoint}} {{state}}",
                        f'max by (endpoint, state) (llmgw_breaker_state{{{M}, state!="closed"}})',
                    )
                ],
            ),
        ],
    ),
    (
        "On-demand models",
        [
            (
                "Model state (1 = current)",
                "short",
                [("{{model}} {{state}}", f"max by (model, state) (llmgw_model_state{{{M}}})")],
            ),
            (
                "Cold starts: last start duration and starts per hour",
                "s",
                [
                    (
                        "last start {{model}}",
                        f"max by (model) (llmgw_model_last_start_seconds{{{M}}})",
                    ),
                    (
                        "starts/h {{model}}",
                        f"sum by (model) (increase(llmgw_model_starts_total{{{M}}}[1h]))",
                    ),
                ],
            ),
        ],
    ),
    (
        "Latency",
        [
            (
                "TTFT: predicted vs observed (mean) and observed p90",
                "s",
                [
                    (
                        "observed mean {{model}}",
                        f"sum by (model) (rate(llmgw_ttft_observed_seconds_sum{{{M}}}{W}))"
                        f" / sum by (model) (rate(llmgw_ttft_observed_seconds_count{{{M}}}{W}))",
                    ),
                    (
                        "predicted mean {{model}}",
                        f"sum by (model) (rate(llmgw_ttft_predicted_seconds_sum{{{M}}}{W}))"
                        f" / sum by (model) (rate(llmgw_ttft_predicted_seconds_count{{{M}}}{W}))",
                    ),
                    (
                        "observed p90 {{model}}",
                        "histogram_quantile(0.9, sum by (le, model) "
                        f"(rate(llmgw_ttft_observed_seconds_bucket{{{M}}}{W})))",
                    ),
                    (
                        "engine p90",
                        "histogram_quantile(0.9, sum by (le) "
                        f"(rate(vllm:time_to_first_token_seconds_bucket{{{E}}}{W})))",
                    ),
                ],
            ),
            (
                "TTFT prediction error (observed - predicted) p10 / p50 / p90",
                "s",
                [
                    (
                        f"p{q} {{{{model}}}}",
                        f"histogram_quantile(0.{q // 10}, sum by (le, model) "
                        f"(rate(llmgw_ttft_prediction_error_seconds_bucket{{{M}}}{W})))",
                    )
                    for q in (10, 50, 90)
                ],
            ),
            (
                "Router stage latency p99 (ext_proc / proxy)",
                "s",
                [
                    (
                        "{{stage}}",
                        "histogram_quantile(0.99, sum by (le, stage) "
                        f"(rate(llmgw_stage_seconds_bucket{W})))",
                    )
                ],
            ),
            (
                "Engine prefix cache hit rate",
                "percentunit",
                [
                    (
                        "{{instance}}",
                        f"sum by (instance) (rate(vllm:prefix_cache_hits_total{{{E}}}{W}))"
                        " / sum by (instance) "
                        f"(rate(vllm:prefix_cache_queries_total{{{E}}}{W}))",
                    )
                ],
            ),
        ],
    ),
    (
        "Scrapes",
        [
            (
                "Metrics age per endpoint (scrape freshness)",
                "s",
                [("{{endpoint}}", f"max by (endpoint) (llmgw_metrics_age_seconds{{{M}}})")],
            ),
            (
                "Failed scrapes per endpoint",
                "ops",
                [("{{endpoint}}", f"sum by (endpoint) (rate(llmgw_scrape_errors_total{W}))")],
            ),
        ],
    ),
    (
        "Router replicas (peers)",
        [
            (
                "Peers' requests in flight per endpoint (added to this replica's own)",
                "short",
                [("{{endpoint}}", f"sum by (endpoint) (llmgw_peer_inflight{{{M}}})")],
            ),
            (
                "Peer sharing: inserts and load updates per second, drops by reason",
                "ops",
                [
                    ("inserts sent", f"sum(rate(llmgw_peer_records_sent_total{W}))"),
                    ("inserts received", f"sum(rate(llmgw_peer_records_received_total{W}))"),
                    ("load updates sent", f"sum(rate(llmgw_peer_load_updates_sent_total{W}))"),
                    (
                        "load updates received",
                        f"sum(rate(llmgw_peer_load_updates_received_total{W}))",
                    ),
                    ("dropped: {{reason}}", f"sum by (reason) (rate(llmgw_peer_dropped_total{W}))"),
                ],
            ),
        ],
    ),
]

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def panel(pid: int, title: str, unit: str, queries: list[tuple[str, str]], x: int, y: int) -> Any:
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {
            "defaults": {"unit": unit, "custom": {"drawStyle": "line", "fillOpacity": 10}},
            "overrides": [],
        },
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DATASOURCE,
                "expr": expr,
                "legendFormat": legend,
                "range": True,
            }
            for i, (legend, expr) in enumerate(queries)
        ],
    }


def dashboard() -> dict[str, Any]:
    panels: list[Any] = []
    pid, y = 1, 0
    for row, members in ROWS:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": row,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        pid, y = pid + 1, y + 1
        for i, (title, unit, queries) in enumerate(members):
            panels.append(panel(pid, title, unit, queries, 12 * (i % 2), y + 8 * (i // 2)))
            pid += 1
        y += 8 * ((len(members) + 1) // 2)
    return {
        "uid": "llmgw",
        "title": "llmgw: routing, endpoints, on-demand models, latency",
        "description": "llmgw router (ext_proc or proxy) and its vLLM engines",
        "tags": ["llmgw", "llm", "inference"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                {
                    "name": "model",
                    "label": "Model",
                    "type": "query",
                    "datasource": DATASOURCE,
                    "query": {
                        "query": "label_values(llmgw_decisions_total, model)",
                        "refId": "model",
                    },
                    "definition": "label_values(llmgw_decisions_total, model)",
                    "includeAll": True,
                    "allValue": ".*",
                    "multi": True,
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                    "hide": 0,
                },
            ]
        },
        "panels": panels,
    }


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
