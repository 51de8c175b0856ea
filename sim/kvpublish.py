"""The simulator's KV-event publisher: vLLM's ZMQ wire format from the prefix cache.

Multipart `(topic, 8-byte big-endian sequence number, msgpack [ts, [events...], 0])` on a
bound PUB socket, events as vLLM's tagged maps (`llmgw.sim.kvcache` records them); a
ROUTER replay socket answers `(b"", start seq)` with every kept batch from there, then
the end marker, as `vllm/distributed/kv_events.py` does. A new publisher (a restarted
replica) starts again at sequence 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from typing import Any

import msgpack
import zmq
import zmq.asyncio

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KvEventPublisher:
    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, topic: str = "kv", buffer_steps: int = 10_000
    ) -> None:
        self.topic = topic
        self._ctx = zmq.asyncio.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = self._ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self.port = self._bind(self._pub, host, port)
        self.replay_port = self._bind(self._replay, host, 0)
        self._seq = itertools.count()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._task: asyncio.Task[None] | None = None
        self.published = 0
        self.drop_next = 0  # tests: skip this many sequence numbers (a lost batch)
        # vLLM 0.32 replays (topic, seq, payload); earlier releases sent no topic.
        self.replay_topic = True

    @staticmethod
    def _bind(sock: zmq.asyncio.Socket, host: str, port: int) -> int:
        if ":" in host:  # an IPv6 address: bracketed, and the socket told (else "No such device")
            sock.setsockopt(zmq.IPV6, 1)
            host = f"[{host.strip('[]')}]"
        if port:
            sock.bind(f"tcp://{host}:{port}")
            return port
        return sock.bind_to_random_port(f"tcp://{host}")

    def sources(self) -> dict[str, dict[str, Any]]:
        """What vLLM's `GET /kv_event_sources` answers (per data-parallel rank)."""
        return {
            "0": {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{self.port}",
                "replay_endpoint": f"tcp://*:{self.replay_port}",
                "buffer_steps": self._buffer.maxlen,
                "topic": self.topic,
            }
        }

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        seq = next(self._seq)
        payload = msgpack.packb([time.time(), events, 0])
        self._buffer.append((seq, payload))
        if self.drop_next > 0:
            self.drop_next -= 1
            return
        # PUB never blocks: at the high-water mark ZMQ drops, as vLLM's publisher does.
        self._pub.send_multipart((self.topic.encode(), seq.to_bytes(8, "big"), payload))
        self.published += 1

    async def _serve_replay(self) -> None:
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start_frame = frames
            start = int.from_bytes(start_frame, "big")
            topic = (self.topic.encode(),) if self.replay_topic else ()
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._replay.send_multipart(
                        (client, b"", *topic, seq.to_bytes(8, "big"), payload)
                    )
            await self._replay.send_multipart((client, b"", *(b"",) * len(topic), END_SEQ, b""))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._pub.close(linger=0)
        self._replay.close(linger=0)
