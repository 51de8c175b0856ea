"""The load client's verdict on a streamed answer: complete only with `data: [DONE]`."""

from __future__ import annotations

import sys
from pathlib import Path

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.loadclient import send_one
from bench.workloads import Conversation, Turn

CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'


async def _answer(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    await response.write(CHUNK)
    if request.query.get("done") == "1":
        await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def test_a_stream_cut_before_done_is_an_error_and_a_whole_one_is_not() -> None:
    """An engine or router that closes an answer mid-way (the chunked body ends cleanly,
    no `[DONE]`) used to count as a success with a short answer; a benchmark would then
    score a contender that cuts answers as fast."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _answer)
    conv = Conversation(0, None, 0.0, "", (Turn("hello there", "", 6, 0.0),))
    async with TestServer(app) as server, aiohttp.ClientSession() as http:
        base = str(server.make_url("/v1/chat/completions"))
        cut = await send_one(http, base, "m1", conv, 0, 0.0)
        whole = await send_one(http, base + "?done=1", "m1", conv, 0, 0.0)
    assert cut.ttft_s is not None and not cut.ok
    assert cut.error is not None and "[DONE]" in cut.error
    assert whole.ok and whole.error is None
