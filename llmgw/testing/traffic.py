"""Session traffic for tests that change a model's endpoints under load: workers that send
one request per session in turn until stopped, keeping failures and who served each session
(from the `x-llmgw-decision` debug header)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx

from llmgw.testing.wait import eventually

CHAT = "/v1/chat/completions"


def served_by(reply: httpx.Response) -> str:
    """The endpoint that answered, from the `x-llmgw-decision` debug header."""
    fields = dict(
        part.split("=", 1) for part in reply.headers["x-llmgw-decision"].split() if "=" in part
    )
    return fields.get("answered") or fields["endpoint"]


@dataclass
class SessionTraffic:
    """`worker(offset, step)` tasks cycle through `sessions`; `round()` waits until every
    session was served once more and returns where."""

    http: httpx.AsyncClient
    sessions: list[str]
    body: bytes
    served: dict[str, str] = field(default_factory=dict)  # session -> last endpoint
    sent: int = 0
    failures: list[str] = field(default_factory=list)
    epoch: int = 0  # a round counts only requests sent after it began
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def worker(self, offset: int, step: int) -> None:
        i = offset
        while not self._stop.is_set():
            session = self.sessions[i % len(self.sessions)]
            i += step
            epoch = self.epoch
            try:
                reply = await self.http.post(
                    CHAT,
                    content=self.body,
                    headers={"x-session-id": session, "content-type": "application/json"},
                )
            except httpx.HTTPError as exc:
                self.failures.append(f"{session}: {type(exc).__name__} {exc}")
                continue
            self.sent += 1
            if reply.status_code != 200:
                self.failures.append(f"{session}: HTTP {reply.status_code} {reply.text[:200]}")
                continue
            if epoch == self.epoch:
                self.served[session] = served_by(reply)

    async def round(self) -> dict[str, str]:
        """Every session served at least once from now on; their endpoints."""
        self.epoch += 1
        self.served.clear()
        await eventually(lambda: len(self.served) == len(self.sessions), timeout=20.0)
        return dict(self.served)

    def stop(self) -> None:
        self._stop.set()
