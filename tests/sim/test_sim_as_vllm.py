"""The simulator answers as vLLM 0.32 does where a router test or benchmark could
otherwise pass on it and fail on a real engine: a body not sent as JSON is a 400, a
max_tokens past the context is cut to the room left, and a request without a model is
served by the default one; and, as an option, KV blocks taken as vLLM v1 takes them."""

from __future__ import annotations

import httpx
import pytest

from llmgw.sim import SimFleet
from llmgw.sim.model import EngineConfig, EngineModel, SeqRequest


@pytest.mark.parametrize("content_type", [None, "text/plain"])
async def test_a_body_not_sent_as_json_is_400_as_on_vllm(content_type: str | None) -> None:
    body = b'{"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    headers = {} if content_type is None else {"content-type": content_type}
    async with (
        SimFleet(replicas=1, model="m1", time_scale=0) as fleet,
        httpx.AsyncClient(base_url=fleet.urls[0], timeout=10) as client,
    ):
        reply = await client.post("/v1/chat/completions", content=body, headers=headers)
    assert reply.status_code == 400, reply.text
    assert "application/json" in reply.json()["error"]["message"]


async def test_a_body_with_a_utf8_byte_order_mark_is_read_as_on_vllm() -> None:
    """vLLM's json.loads skips a leading UTF-8 BOM (bodies saved by Windows tools), and so
    does llmgw: the simulator answered 400, so such a request routed fine and then failed."""
    body = b'\xef\xbb\xbf{"model": "m1", "prompt": "hello", "max_tokens": 2}'
    async with (
        SimFleet(replicas=1, model="m1", time_scale=0) as fleet,
        httpx.AsyncClient(base_url=fleet.urls[0], timeout=10) as client,
    ):
        reply = await client.post(
            "/v1/completions", content=body, headers={"content-type": "application/json"}
        )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 2


# 4. Context length: vLLM 0.32 rejects a prompt longer than max_model_len, or a max_tokens
#    above it, but clamps max_tokens to max_model_len - prompt otherwise (get_max_tokens in
#    entrypoints/serve/utils/api_utils.py): a 200 ending with finish_reason "length".


async def test_max_tokens_past_the_context_is_clamped_as_on_vllm() -> None:
    async with (
        SimFleet(replicas=1, model="m1", time_scale=0, max_model_len=256) as fleet,
        httpx.AsyncClient(base_url=fleet.urls[0], timeout=10) as client,
    ):
        body = {"model": "m1", "prompt": "x" * 800, "max_tokens": 100}  # 200 + 100 > 256
        reply = await client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["usage"]["prompt_tokens"] == 200
    assert answer["usage"]["completion_tokens"] == 56
    assert answer["choices"][0]["finish_reason"] == "length"


# 5. Model: `model: str | None = None` in vLLM 0.32's ChatCompletionRequest and
#    CompletionRequest; `_is_model_supported` takes a missing one (the served model answers).


@pytest.mark.parametrize("model", ["absent", None])
async def test_a_request_without_model_is_served_as_on_vllm(model: str | None) -> None:
    body: dict[str, object] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    if model != "absent":
        body["model"] = model
    async with (
        SimFleet(replicas=1, model="m1", time_scale=0) as fleet,
        httpx.AsyncClient(base_url=fleet.urls[0], timeout=10) as client,
    ):
        reply = await client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "m1"


# KV blocks as vLLM v1 takes them (`kv_on_demand`): the prompt's at admission, one more as
# the output fills one, the newest running request preempted when none is free.


def _run(model: EngineModel, until: float = 60.0) -> float:
    now = 0.0
    while model.has_work and now < until:
        now += model.schedule(now)
        model.complete(now)
    return now


def test_admission_needs_only_the_prompts_blocks_on_demand() -> None:
    """Two 16-token prompts with max_tokens 200 on 16 blocks of 16 tokens: both run (each
    holds one block after prefill); reserving prompt + max_tokens, the second waits."""
    for on_demand, running in ((True, 2), (False, 1)):
        cfg = EngineConfig(kv_blocks=16, block_size=16, max_model_len=4096, kv_on_demand=on_demand)
        model = EngineModel(cfg)
        for _ in range(2):
            model.submit(SeqRequest(prompt_tokens=16, max_tokens=200), now=0.0)
        model.complete(model.schedule(0.0))
        assert len(model.running) == running
        if on_demand:
            assert model.kv.usage() <= 4 / 16


def test_out_of_blocks_the_newest_is_preempted_and_finishes_later() -> None:
    cfg = EngineConfig(
        kv_blocks=8, block_size=16, max_model_len=4096, kv_on_demand=True, decode_ms=1.0
    )
    model = EngineModel(cfg)
    first = model.submit(SeqRequest(prompt_tokens=16, max_tokens=60), now=0.0)
    second = model.submit(SeqRequest(prompt_tokens=16, max_tokens=60), now=0.0)
    _run(model)
    assert model.stats.preemptions >= 1
    assert first.output_tokens == second.output_tokens == 60
    assert first.finish_reason == second.finish_reason == "length"
    assert model.kv.usage() == 0.0
