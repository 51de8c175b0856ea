"""`eventually`: await a condition with a deadline, never a bare sleep as synchronisation
(the async sibling of `llmgw.testing.extproc.wait_for`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

POLL_INTERVAL = 0.005  # seconds between looks: cheap conditions, quick tests


async def eventually(
    predicate: Callable[[], bool], timeout: float = 10.0, interval: float = POLL_INTERVAL
) -> None:
    """Return once `predicate()` is true; AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout:g} s")
        await asyncio.sleep(interval)
