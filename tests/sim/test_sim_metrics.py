"""/metrics parses with prometheus_client and carries each real engine's names and labels."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.promtext import CONTRACTS, extract
from llmgw.sim import SimFleet
from llmgw.types import Engine

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "metrics-vllm-0.32.0-busy.txt"

# Names written out here, apart from both the simulator and the router core.
CONTRACT_NAMES = {
    "vllm": {
        "vllm:num_requests_waiting": {"engine", "model_name"},
        "vllm:num_requests_running": {"engine", "model_name"},
        "vllm:kv_cache_usage_perc": {"engine", "model_name"},
        "vllm:prefix_cache_queries": {"engine", "model_name"},
        "vllm:prefix_cache_hits": {"engine", "model_name"},
        "vllm:request_success": {"engine", "model_name", "finished_reason"},
        "vllm:time_to_first_token_seconds": {"engine", "model_name"},
        "vllm:e2e_request_latency_seconds": {"engine", "model_name"},
        "vllm:request_queue_time_seconds": {"engine", "model_name"},
        "vllm:request_prefill_time_seconds": {"engine", "model_name"},
        "vllm:request_decode_time_seconds": {"engine", "model_name"},
        "vllm:request_inference_time_seconds": {"engine", "model_name"},
        "vllm:inter_token_latency_seconds": {"engine", "model_name"},
        "vllm:request_time_per_output_token_seconds": {"engine", "model_name"},
        "vllm:prompt_tokens": {"engine", "model_name"},
        "vllm:generation_tokens": {"engine", "model_name"},
    },
    "sglang": {
        "sglang:num_queue_reqs": {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"},
        "sglang:num_running_reqs": {
            "model_name",
            "engine_type",
            "tp_rank",
            "pp_rank",
            "moe_ep_rank",
        },
        "sglang:token_usage": {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"},
        "sglang:cache_hit_rate": {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"},
        "sglang:time_to_first_token_seconds": {"model_name"},
        "sglang:inter_token_latency_seconds": {"model_name"},
        "sglang:e2e_request_latency_seconds": {"model_name"},
        "sglang:prompt_tokens": {"model_name"},
        "sglang:generation_tokens": {"model_name"},
        "sglang:cached_tokens": {"model_name"},
    },
    "trtllm": {
        "trtllm_num_requests_waiting": {"model_name", "engine_type"},
        "trtllm_num_requests_running": {"model_name", "engine_type"},
        "trtllm_kv_cache_utilization": {"model_name", "engine_type"},
        "trtllm_time_to_first_token_seconds": {"model_name", "engine_type"},
    },
}


def label_sets(text: str) -> dict[str, set[str]]:
    """Family name -> label names of its samples (without `le`)."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(family.name, set()).update(set(sample.labels) - {"le"})
    return out


async def scrape(engine: str) -> str:
    fleet = SimFleet(replicas=1, models=["a", "b"], engine=engine, time_scale=0)
    async with fleet, httpx.AsyncClient(base_url=fleet.urls[0]) as client:
        for model in ("a", "b"):
            body = {"model": model, "prompt": "x" * 200, "max_tokens": 2}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
        response = await client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    return response.text


@pytest.mark.parametrize("engine", sorted(CONTRACT_NAMES))
async def test_metrics_parse_and_carry_the_engine_contract(engine: str) -> None:
    text = await scrape(engine)
    labels = label_sets(text)
    for name, expected in CONTRACT_NAMES[engine].items():
        assert labels.get(name) == expected, name
    families = {f.name: f for f in text_string_to_metric_families(text)}
    models = {s.labels["model_name"] for s in families[next(iter(CONTRACT_NAMES[engine]))].samples}
    assert models == {"a", "b"}


async def test_vllm_label_sets_match_a_real_vllm_page() -> None:
    ours = label_sets(await scrape("vllm"))
    real = label_sets(FIXTURE.read_text())
    for name in CONTRACT_NAMES["vllm"]:
        assert ours[name] == real[name], name
    assert {"block_size", "num_gpu_blocks"} <= ours["vllm:cache_config_info"]


@pytest.mark.parametrize("engine", sorted(CONTRACT_NAMES))
async def test_the_router_core_contracts_read_the_sim(engine: str) -> None:
    text = await scrape(engine)
    contract = next(c for e, c in CONTRACTS.items() if str(e) == engine)
    for model in ("a", "b"):
        metrics = extract(text, contract, model=model)
        assert metrics.waiting == 0
        assert metrics.running == 0
        assert 0.0 <= metrics.kv_usage <= 1.0
        assert metrics.finished_total == 1


def shape(text: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Family name -> (type, bucket bounds) for every vllm: family."""
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:"):
            continue
        bounds = tuple(
            dict.fromkeys(s.labels["le"] for s in family.samples if s.name.endswith("_bucket"))
        )
        out[family.name] = (family.type, bounds)
    return out


async def test_vllm_types_and_buckets_match_a_real_vllm_page() -> None:
    ours = shape(await scrape("vllm"))
    real = shape(FIXTURE.read_text())
    for name in CONTRACT_NAMES["vllm"]:
        assert ours[name] == real[name], name


async def test_vllm_phase_histograms_add_up_for_a_long_prefill() -> None:
    # 4,000 uncached tokens at 100 us: prefill 0.4 s, above the 0.3 s first bucket.
    fleet = SimFleet(replicas=1, model="m1", decode_ms=5, prefill_us_per_token=100)
    async with fleet, httpx.AsyncClient(base_url=fleet.urls[0], timeout=10) as client:
        body = {"model": "m1", "prompt": "x" * 16_000, "max_tokens": 3}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        text = (await client.get("/metrics")).text
    samples = {
        (s.name, s.labels.get("le")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples[("vllm:request_prefill_time_seconds_bucket", "0.3")] == 0
    assert samples[("vllm:request_prefill_time_seconds_count", None)] == 1
    assert samples[("vllm:request_prefill_time_seconds_sum", None)] >= 0.4 * 0.99
    assert samples[("vllm:inter_token_latency_seconds_count", None)] == 2
    assert samples[("vllm:request_time_per_output_token_seconds_count", None)] == 1
    assert samples[("vllm:prompt_tokens_total", None)] == 4000
    assert samples[("vllm:generation_tokens_total", None)] == 3
    assert samples[("vllm:prefix_cache_queries_total", None)] == 4000


async def test_vllm_time_to_first_token_is_observed_at_the_first_token() -> None:
    """As on vLLM: a scrape while a request decodes already counts its time to first token,
    and its prefill, queue and end-to-end times only once it has finished."""

    def counts(text: str) -> dict[str, float]:
        return {
            s.name: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name.endswith("_count")
        }

    ttft, prefill, e2e = (
        f"vllm:{name}_count"
        for name in ("time_to_first_token_seconds", "request_prefill_time_seconds",
                     "e2e_request_latency_seconds")
    )  # fmt: skip
    fleet = SimFleet(replicas=1, model="m1", decode_ms=20)
    async with fleet, httpx.AsyncClient(base_url=fleet.urls[0], timeout=10) as client:
        body = {"model": "m1", "prompt": "x" * 400, "max_tokens": 100, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.aiter_lines()
            async for line in lines:
                if line.startswith("data: ") and '"text"' in line:
                    break  # the first token: 99 more steps of 20 ms to go
            during = counts((await client.get("/metrics")).text)
            async for _ in lines:
                pass
        after = counts((await client.get("/metrics")).text)
    assert (during[ttft], during[prefill], during[e2e]) == (1, 0, 0)
    assert (after[ttft], after[prefill], after[e2e]) == (1, 1, 1)


def sample_values(text: str) -> dict[tuple[str, str | None], float]:
    return {
        (s.name, s.labels.get("le")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


async def test_vllm_prefix_cache_hits_count_whole_blocks() -> None:
    """A prompt of exactly two cached blocks hits one block on vLLM (the hit stops before
    the last token, at a block boundary); the simulator counted 31 of 32 tokens, a number
    vLLM never reports (found by a review helper)."""
    async with (
        SimFleet(replicas=1, model="m1", time_scale=0, block_size=16) as fleet,
        httpx.AsyncClient(base_url=fleet.urls[0], timeout=10) as client,
    ):
        body = {"model": "m1", "prompt": "x" * 128, "max_tokens": 1}  # 32 tokens = 2 blocks
        for _ in range(2):
            assert (await client.post("/v1/completions", json=body)).status_code == 200
        text = (await client.get("/metrics")).text
    assert sample_values(text)[("vllm:prefix_cache_hits_total", None)] == 16


async def test_vllm_computed_tokens_histogram_is_served_as_vllm_serves_it() -> None:
    """vLLM 0.32 serves vllm:request_prefill_kv_computed_tokens (each finished request's
    prompt minus its cached tokens), which the router's vLLM contract reads; the simulator
    had none, so calibration took its other branch on the simulator only (found by a review
    helper)."""
    fleet = SimFleet(replicas=1, model="m1", time_scale=0, max_model_len=512)
    async with fleet, httpx.AsyncClient(base_url=fleet.urls[0], timeout=10) as client:
        body = {"model": "m1", "prompt": "x" * 400, "max_tokens": 2}  # 100 tokens, 6 blocks
        for _ in range(2):
            assert (await client.post("/v1/completions", json=body)).status_code == 200
        text = (await client.get("/metrics")).text
    name = "vllm:request_prefill_kv_computed_tokens"
    metrics = extract(text, CONTRACTS[Engine.VLLM], model="m1")
    assert metrics.computed_tokens_sum == 100 + 4  # the second hit 96 tokens
    assert sample_values(text)[(name + "_count", None)] == 2
    # vLLM's buckets are 1-2-5 up to max_model_len: the fixture's engine ran with 512.
    assert shape(text)[name] == shape(FIXTURE.read_text())[name]
    assert label_sets(text)[name] == label_sets(FIXTURE.read_text())[name]


async def test_vllm_a_client_abort_is_not_counted_as_a_finished_request() -> None:
    """vLLM 0.32 (AsyncLLM.generate -> OutputProcessor.abort_requests) drops a request
    whose client went away without recording it as finished: no request_success, e2e,
    queue or computed-tokens observation; its inter-token latencies were observed as its
    tokens came. The simulator counted it as finished "abort" with all of those (found by
    a review helper)."""
    async with SimFleet(replicas=1, model="m1", decode_ms=20, time_scale=1) as fleet:
        engine = fleet.replicas[0].engine()
        body = {"model": "m1", "prompt": "hi", "max_tokens": 2000, "stream": True}
        async with httpx.AsyncClient(base_url=fleet.urls[0], timeout=10) as client:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if '"text"' in line and engine.running[0].output_tokens >= 3:
                        break
            await fleet.replicas[0].wait_until(lambda: not engine.running, timeout=3)
            text = (await client.get("/metrics")).text
    s = {
        (x.name, x.labels.get("finished_reason")): x.value
        for f in text_string_to_metric_families(text)
        for x in f.samples
    }
    assert s[("vllm:request_success_total", "abort")] == 0
    for name in (
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_kv_computed_tokens",
    ):
        assert s[(f"vllm:{name}_count", None)] == 0, name
    assert s[("vllm:time_to_first_token_seconds_count", None)] == 1
    assert s[("vllm:inter_token_latency_seconds_count", None)] >= 2


async def test_a_two_model_replica_serves_the_cache_config_series_once() -> None:
    """vllm:cache_config_info has no model_name label: each served model added the same
    series again, a duplicate Prometheus drops and that the router's contract (summing it
    over engines) read as twice the KV size (found by a review helper)."""
    async with (
        SimFleet(replicas=1, models=["a", "b"], time_scale=0) as fleet,
        httpx.AsyncClient(base_url=fleet.urls[0], timeout=10) as client,
    ):
        text = (await client.get("/metrics")).text
    series = [
        tuple(sorted(s.labels.items()))
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "vllm:cache_config_info"
    ]
    assert len(series) == 1
    for model in ("a", "b"):
        assert extract(text, CONTRACTS[Engine.VLLM], model=model).kv_tokens == 2048 * 16
