"""A control plane for tests: its starts finish when told to, and it counts its calls."""

from __future__ import annotations

import asyncio

from llmgw.runtime.controlplanes import CrashCallback, StartError
from llmgw.types import Endpoint


class FakeControlPlane:
    """`want` waits for `release` (never set: a model still loading), then fails with
    `fail_with` if given, else serves the model at `address`; `wants` and `stops` count
    the calls, `callbacks` holds the crash callbacks registered."""

    def __init__(self, address: str = "127.0.0.1:9") -> None:
        self.address = address
        self.wants = 0
        self.stops = 0
        self.release = asyncio.Event()
        self.fail_with: str | None = None
        self.callbacks: list[CrashCallback] = []

    async def want(self, model: str) -> list[Endpoint]:
        self.wants += 1
        await self.release.wait()
        if self.fail_with is not None:
            raise StartError(self.fail_with)
        return [Endpoint(address=self.address, model=model)]

    async def stop(self, model: str) -> None:
        self.stops += 1

    def status(self, model: str) -> dict[str, object]:
        return {"wants": self.wants}

    def on_crash(self, callback: CrashCallback) -> None:
        self.callbacks.append(callback)

    async def close(self) -> None:
        return None
