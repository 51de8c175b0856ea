"""The real-time driver: a busy engine's steps follow each other like an accelerator's."""

from __future__ import annotations

import asyncio
import time

import pytest

from llmgw.sim.driver import EngineDriver
from llmgw.sim.model import EngineConfig, EngineModel, SeqRequest

DECODE_S = 0.01
TOKENS = 6


async def decode_with_a_stalled_loop(stall_s: float) -> tuple[float, float]:
    """One request's (first token, last token) times when the event loop is blocked for
    `stall_s` right after the first token (a /metrics render, another replica's work)."""
    model = EngineModel(
        EngineConfig(decode_ms=DECODE_S * 1e3, decode_batch_factor=0.0, prefill_us_per_token=10)
    )
    driver = EngineDriver(model)
    driver.start()
    try:
        handle = driver.submit(SeqRequest(prompt_tokens=16, max_tokens=TOKENS), every_token=True)
        await handle.wait_tokens(0)
        time.sleep(stall_s)  # the stall under test (blocks the loop), not a synchronisation
        seq = await handle.wait_finished()
    finally:
        await driver.stop()
    assert seq.first_token_time is not None and seq.last_token_time is not None
    return seq.first_token_time, seq.last_token_time


@pytest.mark.parametrize("stall_s", [0.0, 0.025])
def test_a_late_wake_up_does_not_push_back_the_steps_after_it(stall_s: float) -> None:
    """The decode steps after the first token take TOKENS - 1 step times, stall or not:
    the step the stall delayed starts when the one before it ended (before the fix a
    25 ms stall made the same decode 25 ms longer, on every replica in the process)."""
    first, last = asyncio.run(decode_with_a_stalled_loop(stall_s))
    assert last - first == pytest.approx((TOKENS - 1) * DECODE_S, abs=1e-9)
