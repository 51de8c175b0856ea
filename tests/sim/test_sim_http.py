"""Every endpoint and error of a simulated replica, over real loopback HTTP."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.sim import SimFleet

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    async with SimFleet(replicas=2, models=["m1", "m2"], time_scale=0, seed=1) as fleet:
        yield fleet


@pytest.fixture
async def client(fleet: SimFleet) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=fleet.urls[0], timeout=10) as client:
        yield client


def sse_events(text: str) -> list[str]:
    assert text.endswith("\n\n")
    return [block.removeprefix("data: ") for block in text.strip("\n").split("\n\n")]


async def test_health_models_and_replica_header(fleet: SimFleet) -> None:
    for index, url in enumerate(fleet.urls):
        async with httpx.AsyncClient(base_url=url) as client:
            health = await client.get("/health")
            assert health.status_code == 200
            assert health.headers["x-sim-replica"] == str(index)
            models = (await client.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["m1", "m2"]
            assert models["object"] == "list"


async def test_chat_completion_non_streaming(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == "m1"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 4
    assert response.headers["x-sim-replica"] == "0"


async def test_chat_without_max_tokens_stops_naturally(client: httpx.AsyncClient) -> None:
    chat = {"model": "m2", "messages": [{"role": "user", "content": "Once"}]}
    response = await client.post("/v1/chat/completions", json=chat)
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert 16 <= body["usage"]["completion_tokens"] <= 64


async def test_completion_without_max_tokens_gets_vllms_default_of_16(
    client: httpx.AsyncClient,
) -> None:
    """vLLM 0.32's CompletionRequest has `max_tokens: int | None = 16` (OpenAI's default):
    the simulator drew 16 to 64 tokens and stopped "naturally" (found by a review helper)."""
    response = await client.post("/v1/completions", json={"model": "m2", "prompt": "Once"})
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 16


async def test_streamed_chat_has_the_shape_of_real_vllm(client: httpx.AsyncClient) -> None:
    request = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    response = await client.post("/v1/chat/completions", json=request)
    assert response.headers["content-type"].startswith("text/event-stream")
    ours = sse_events(response.text)
    real = sse_events((FIXTURES / "sse-vllm-0.32.0-chat-stream.txt").read_text())
    assert ours[-1] == real[-1] == "[DONE]"
    ours_json = [json.loads(event) for event in ours[:-1]]
    real_json = [json.loads(event) for event in real[:-1]]
    # Role chunk, token chunks, last token chunk, usage chunk: same keys at every level.
    for mine, theirs in [
        (ours_json[0], real_json[0]),
        (ours_json[1], real_json[1]),
        (ours_json[-2], real_json[-2]),
        (ours_json[-1], real_json[-1]),
    ]:
        assert mine.keys() == theirs.keys()
        for a, b in zip(mine["choices"], theirs["choices"], strict=True):
            assert a.keys() == b.keys()
            assert a["delta"].keys() == b["delta"].keys()
    assert len(ours_json) == 1 + 4 + 1
    assert ours_json[-2]["choices"][0]["finish_reason"] == "length"
    assert ours_json[-1]["usage"]["completion_tokens"] == 4


async def test_streamed_completion_without_usage(client: httpx.AsyncClient) -> None:
    request = {"model": "m1", "prompt": "abc", "max_tokens": 3, "stream": True}
    response = await client.post("/v1/completions", json=request)
    events = sse_events(response.text)
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["object"] for c in chunks] == ["text_completion"] * 3
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "Invalid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"model": 5, "messages": []}', "model: Input should be a valid string"),
        (b'{"model": "m1"}', "messages: Field required"),
        (b'{"model": "m1", "messages": "hi"}', "messages"),
        (b'{"model": "m1", "messages": [], "max_tokens": "seven"}', "max_tokens"),
        (b'{"model": "m1", "messages": [], "max_tokens": 7.5}', "max_tokens"),
        (b'{"model": "m1", "messages": [], "max_tokens": 0}', "max_tokens"),
        (b'{"model": "m1", "messages": [], "stream": "maybe"}', "stream"),
        (b'{"model": "m1", "messages": [], "stream": 2}', "stream"),
        (b'{"model": "m1", "messages": [], "n": 2}', "n"),
        (b'{"model": "m1", "messages": [], "max_tokens": 100000}', "context length"),
    ],
)
async def test_bad_requests_are_400_openai_errors(
    client: httpx.AsyncClient, body: bytes, needle: str
) -> None:
    json_body = {"content-type": "application/json"}
    response = await client.post("/v1/chat/completions", content=body, headers=json_body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert needle in error["message"]
    assert error["type"] == "BadRequestError"
    assert error["code"] == 400
    assert response.headers["x-sim-replica"] == "0"


async def test_values_vllm_coerces_are_taken_as_vllm_takes_them(
    client: httpx.AsyncClient,
) -> None:
    """vLLM 0.32's request models validate in pydantic's lax mode: an integral float or a
    string of digits for an int, "true"/"yes"/"0" for a bool; an empty stream_options
    without stream passes its check (`data.get("stream_options") and not
    data.get("stream")`). The simulator answered 400 to each (found by a review helper)."""
    cases: dict[str, tuple[dict[str, object], int]] = {
        "max_tokens str": ({"max_tokens": "7"}, 7),
        "max_tokens float": ({"max_tokens": 7.0}, 7),
        "max_completion_tokens str": ({"max_completion_tokens": " 3 "}, 3),
        "stream str": ({"max_tokens": 2, "stream": "true"}, 2),
        "n float": ({"max_tokens": 2, "n": 1.0}, 2),
        "empty stream_options": ({"max_tokens": 2, "stream_options": {}}, 2),
    }
    for name, (extra, tokens) in cases.items():
        reply = await client.post("/v1/chat/completions", json={**CHAT, **extra})
        assert reply.status_code == 200, (name, reply.text)
        if extra.get("stream"):
            assert reply.text.endswith("data: [DONE]\n\n"), name
            assert reply.text.count('"delta":{"content"') == tokens, name
        else:
            assert reply.json()["usage"]["completion_tokens"] == tokens, name
    usage = {"stream": "yes", "stream_options": {"include_usage": "on"}}
    streamed = await client.post("/v1/chat/completions", json={**CHAT, **usage})
    assert '"usage":{"prompt_tokens"' in streamed.text


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"prompt": []}, "at least one prompt"),
        ({"prompt": ["alpha", "beta"]}, "send each of the 2 prompts on its own"),  # was joined
        ({"prompt": [[1, 2], [3]]}, "send each of the 2 prompts on its own"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream=True"),
        ({"prompt": "hi", "max_tokens": 2, "max_completion_tokens": "ten"}, None),  # completions
    ],
)
async def test_completions_bodies_are_answered_as_vllm_answers_them(
    client: httpx.AsyncClient, body: dict[str, object], needle: str | None
) -> None:
    response = await client.post("/v1/completions", json={"model": "m1", **body})
    if needle is None:  # vLLM's completions API takes max_tokens only: the other is ignored
        assert response.status_code == 200
        return
    assert response.status_code == 400 and needle in response.json()["error"]["message"]


async def test_chat_takes_max_completion_tokens_over_max_tokens_as_vllm_does(
    client: httpx.AsyncClient,
) -> None:
    body = {**CHAT, "max_tokens": 2, "max_completion_tokens": 5}
    reply = (await client.post("/v1/chat/completions", json=body)).json()
    assert reply["usage"]["completion_tokens"] == 5
    bad = {**body, "max_completion_tokens": "ten"}
    assert (await client.post("/v1/chat/completions", json=bad)).status_code == 400
    one = await client.post("/v1/completions", json={"model": "m1", "prompt": ["hi there"]})
    assert one.status_code == 200  # a batch of one is that prompt


async def test_unknown_model_is_404_and_unknown_path_is_404(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "NotFoundError"
    assert (await client.get("/v2/nothing")).status_code == 404
    assert (await client.get("/v1/chat/completions")).status_code == 405


async def test_full_queue_answers_429() -> None:
    async with SimFleet(
        replicas=1, model="m1", max_num_seqs=1, max_queue=1, decode_ms=50, time_scale=1
    ) as fleet:
        replica = fleet.replicas[0]
        engine = replica.engine()
        request = {**CHAT, "max_tokens": 1000}
        async with httpx.AsyncClient(base_url=fleet.urls[0], timeout=10) as client:
            running = asyncio.create_task(client.post("/v1/chat/completions", json=request))
            await replica.wait_until(lambda: len(engine.running) == 1)
            waiting = asyncio.create_task(client.post("/v1/chat/completions", json=request))
            await replica.wait_until(lambda: len(engine.waiting) == 1)
            rejected = await client.post("/v1/chat/completions", json=request)
            assert rejected.status_code == 429
            assert rejected.json()["error"]["code"] == 429
            metrics = (await client.get("/metrics")).text
            assert 'vllm:num_requests_running{engine="0",model_name="m1"} 1.0' in metrics
            assert 'vllm:num_requests_waiting{engine="0",model_name="m1"} 1.0' in metrics
            running.cancel()
            waiting.cancel()
            await asyncio.gather(running, waiting, return_exceptions=True)
            # A client that goes away aborts its sequence and frees its blocks.
            await replica.wait_until(lambda: not engine.has_work)
            assert engine.kv.used_blocks == 0


async def test_faults_get_post_validate_and_reset(client: httpx.AsyncClient) -> None:
    assert (await client.get("/admin/faults")).json()["error_rate"] == 0.0
    updated = await client.post("/admin/faults", json={"status": 503})
    assert updated.json()["status"] == 503
    storm = await client.post("/v1/chat/completions", json=CHAT)
    assert storm.status_code == 503
    assert storm.json()["error"]["type"] == "ServiceUnavailableError"
    assert storm.headers["retry-after"] == "1"
    bad = await client.post("/admin/faults", json={"error_rate": 2})
    assert bad.status_code == 400
    assert "error_rate" in bad.json()["error"]["message"]
    assert (await client.post("/admin/faults", json={"bogus": 1})).status_code == 400
    reset = await client.post("/admin/reset")
    assert reset.json()["status"] is None
    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200


async def test_error_rate_one_fails_every_request(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    fleet.replicas[0].set_faults(error_rate=1.0)
    statuses = {(await client.post("/v1/completions", json=CHAT)).status_code for _ in range(5)}
    assert statuses == {500}
    # Only the faulty replica is affected.
    async with httpx.AsyncClient(base_url=fleet.urls[1]) as other:
        assert (await other.post("/v1/chat/completions", json=CHAT)).status_code == 200


async def test_hang_holds_requests_until_reset(fleet: SimFleet, client: httpx.AsyncClient) -> None:
    replica = fleet.replicas[0]
    replica.set_faults(hang=True)
    pending = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
    await replica.wait_until(lambda: replica.hung_requests == 1)
    assert not pending.done()
    replica.reset()
    response = await pending
    assert response.status_code == 503


async def test_slowdown_is_applied_to_the_engine(fleet: SimFleet) -> None:
    fleet.replicas[1].set_faults(slowdown=3.0)
    assert fleet.replicas[1].engine("m2").slowdown == 3.0
    fleet.replicas[1].reset()
    assert fleet.replicas[1].engine("m2").slowdown == 1.0


async def test_metrics_faults_answer_500_or_garbage(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    fleet.replicas[0].set_faults(metrics="error")
    assert (await client.get("/metrics")).status_code == 500
    fleet.replicas[0].set_faults(metrics="garbage")
    garbage = await client.get("/metrics")
    assert garbage.status_code == 200
    assert "vllm:" not in garbage.text
    fleet.replicas[0].set_faults(health_status=503)
    assert (await client.get("/health")).status_code == 503


async def test_crash_closes_the_socket_in_process(fleet: SimFleet) -> None:
    async with httpx.AsyncClient(base_url=fleet.urls[1]) as client:
        response = await client.post("/admin/faults", json={"crash": True})
        assert response.json()["crash"] is True
    assert fleet.replicas[1].crashed
    async with httpx.AsyncClient(base_url=fleet.urls[1]) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get("/health")


async def test_crash_mid_stream_cuts_the_connection(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    fleet.replicas[0].set_faults(crash_after_chunks=2)
    request: dict[str, Any] = {**CHAT, "stream": True, "max_tokens": 10}
    received: list[str] = []
    with pytest.raises(httpx.TransportError):
        async with client.stream("POST", "/v1/chat/completions", json=request) as response:
            async for line in response.aiter_lines():
                if line:
                    received.append(line)
    assert len(received) == 2
    fleet.replicas[0].reset()
    assert (await client.get("/health")).status_code == 200


async def test_pipelined_requests_are_answered_in_order(fleet: SimFleet) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", fleet.ports[0])
    writer.write(
        b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
        b"GET /nothing HTTP/1.1\r\nhost: x\r\n\r\n"
        b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    )
    data = await asyncio.wait_for(reader.read(), timeout=5)
    writer.close()
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", data)
    assert statuses == [b"200", b"404", b"200"]


async def test_malformed_http_is_rejected(fleet: SimFleet) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", fleet.ports[0])
    writer.write(b"NOT HTTP AT ALL\r\n\r\n")
    data = await asyncio.wait_for(reader.read(), timeout=5)
    writer.close()
    assert data.startswith(b"HTTP/1.1 400")
