"""bench/routing.py's llmgw contenders: the config they run is one llmgw loads, with the
decision trace where `--trace` asks for it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.routing import all_contenders, llmgw_config
from llmgw.config import load_dict


def test_trace_goes_where_asked_and_nowhere_otherwise(tmp_path: Path) -> None:
    upstreams = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    traced = load_dict(llmgw_config(upstreams, "latency", tmp_path / "envoy-latency.jsonl"))
    assert traced.trace.path == str(tmp_path / "envoy-latency.jsonl")
    assert [e.address for e in traced.models["m1"].endpoints] == ["127.0.0.1:1", "127.0.0.1:2"]
    assert load_dict(llmgw_config(upstreams, None)).trace.path is None


def test_envoy_contenders_use_the_default_body_mode_unless_named() -> None:
    envoy = [c for c in all_contenders() if c.edge == "envoy"]
    assert envoy and all(c.body_mode == "override" for c in envoy)
