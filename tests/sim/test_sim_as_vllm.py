"""The simulator answers as vLLM 0.32 does where a router test or benchmark could
otherwise pass on it and fail on a real engine: a body not sent as JSON is a 400, a
max_tokens past the context is cut to the room left, and a request without a model is
served by the default one."""

from __future__ import annotations

import httpx
import pytest

from llmgw.sim import SimFleet


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
