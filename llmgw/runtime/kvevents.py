"""Subscribers to the engines' KV-cache events (ZMQ), feeding the registry's exact index.

One task per endpoint of a model with a `kv_events` stanza: connect a SUB socket to the
engine's publisher (address from the config template, or from the engine's
`GET /kv_event_sources`), decode each `(topic, seq, payload)` with `llmgw.kvevents`, and
follow sequence numbers: on a gap, ask the replay endpoint (if any) for the missed
batches, else the index marks the endpoint unknown until it resyncs. A disconnect seen
by the socket monitor (the engine went away) empties the endpoint at once; a restarted
engine starts again at sequence 0, which the index treats as an empty cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import orjson
import zmq
import zmq.asyncio
from zmq.utils.monitor import _MonitorMessage, parse_monitor_message

from llmgw.config import Config, KvEventsSpec
from llmgw.discovery import bracketed
from llmgw.kvevents import EventBatch, KvEventError, decode_batch, decode_seq
from llmgw.kvindex import SeqVerdict
from llmgw.registry import Registry
from llmgw.runtime.httpget import HttpGetError, KeepAliveGetter
from llmgw.runtime.scraper import split_address

log = logging.getLogger("llmgw.kvevents")

END_SEQ = -1  # vLLM's replay end marker
MAX_REPLAY = 10_000  # batches vLLM's publisher keeps for replay (its buffer_steps)


@dataclass(frozen=True, slots=True)
class Source:
    endpoint: str
    replay_endpoint: str | None
    topic: str


def source_from_spec(spec: KvEventsSpec, host: str) -> Source:
    assert spec.endpoint is not None
    host = bracketed(host)
    replay = spec.replay_endpoint.format(host=host) if spec.replay_endpoint else None
    return Source(spec.endpoint.format(host=host), replay, spec.topic)


class ManyRanks(ValueError):
    """The engine publishes events from several data-parallel ranks: each rank holds its own
    prefix cache and its own stream, and the engine's load balancer sends a request to any
    rank, so no one stream says what the endpoint holds for a request."""


def source_from_engine(body: bytes, host: str) -> Source | None:
    """The engine's `/kv_event_sources` answer: its ranks' KVEventsConfig, keyed by rank
    (vLLM 0.32: `{"0": {...}}`) or as a list; the one rank's source, None where events are
    off. ManyRanks where several ranks publish."""
    data = orjson.loads(body)
    if isinstance(data, dict) and "enable_kv_cache_events" in data:
        data = [data]  # one config, not keyed by rank
    ranks = list(data.values()) if isinstance(data, dict) else data
    if not isinstance(ranks, list):
        return None
    publishing = [c for c in ranks if isinstance(c, dict) and c.get("enable_kv_cache_events")]
    if len(publishing) > 1:
        raise ManyRanks(
            f"{len(publishing)} data-parallel ranks publish KV events, each for its own cache; "
            "exact matching follows one cache per endpoint, so this endpoint stays on the "
            "approximate index (list each rank as its own endpoint to match exactly)"
        )
    if not publishing:
        return None
    conf = publishing[0]
    if conf.get("publisher", "zmq") != "zmq" or not isinstance(conf.get("endpoint"), str):
        return None

    def reachable(address: str) -> str:  # the engine binds a wildcard: connect to its host
        return address.replace("*", bracketed(host)).replace("0.0.0.0", bracketed(host))

    replay = conf.get("replay_endpoint")
    return Source(
        reachable(conf["endpoint"]),
        reachable(replay) if isinstance(replay, str) else None,
        str(conf.get("topic") or ""),
    )


@dataclass
class SubscriberStats:
    batches: int = 0
    events: int = 0
    gaps: int = 0
    replayed: int = 0
    restarts: int = 0
    bad_messages: int = 0
    disconnects: int = 0
    lag_s: float = 0.0  # last batch: receive time - the engine's timestamp


def _ipv6(endpoint: str) -> int:
    """ZMQ_IPV6 for a connect to `endpoint`: on for an IPv6 literal (`tcp://[::1]:5557`: else
    libzmq never connects, silently), off for a name or an IPv4 address. On, libzmq looks a
    name up as IPv6 only, and `localhost` (::1 in every pod's /etc/hosts) or a dual-stack
    DNS name never reached vLLM's publisher, which binds `tcp://*:PORT`: IPv4 only."""
    return int("://[" in endpoint)


class KvEventSubscriber:
    """Follows one endpoint's event stream into `registry.kv_index`."""

    def __init__(
        self,
        registry: Registry,
        endpoint_id: str,
        spec: KvEventsSpec,
        *,
        context: zmq.asyncio.Context | None = None,
        wall_clock: Callable[[], float] = time.time,
        replay_timeout: float = 1.0,
        retry_s: float = 1.0,
        heartbeat_s: float = 1.0,
        discover_timeout: float = 5.0,
    ) -> None:
        self.registry = registry
        self.endpoint_id = endpoint_id
        self.spec = spec
        self.host, self.port = split_address(endpoint_id)
        self.ctx = context or zmq.asyncio.Context.instance()
        self.wall_clock = wall_clock
        self.replay_timeout = replay_timeout
        self.retry_s = retry_s
        self.heartbeat_s = heartbeat_s  # between ZMTP pings; 3 missed: disconnected
        self.discover_timeout = discover_timeout  # GET /kv_event_sources
        self.stats = SubscriberStats()
        self.source: Source | None = None
        self.connected = asyncio.Event()  # set once the SUB socket is connected
        self._said: str | None = None  # the last warning logged (repeats are not)

    async def _discover(self) -> Source | None:
        if not self.spec.discover:
            return source_from_spec(self.spec, self.host)
        getter = KeepAliveGetter(self.host, self.port)
        try:  # bounded: an engine whose HTTP side hangs (port open) is retried, not waited on
            async with asyncio.timeout(self.discover_timeout):
                status, body = await getter.get("/kv_event_sources")
        finally:
            await getter.close()
        return source_from_engine(body, self.host) if status == 200 else None

    async def run(self) -> None:
        index = self.registry.kv_index
        while True:
            try:
                self.source = await self._discover()
                if self.source is None:
                    self._warn(f"{self.endpoint_id} publishes no KV events (GET /kv_event_sources)")
                else:
                    self._said = None
                    await self._follow(self.source)
            except (HttpGetError, OSError, zmq.ZMQError, ValueError) as exc:
                index.mark_unknown(self.endpoint_id, f"{type(exc).__name__}: {exc}", self._now())
                self._warn(f"kv events from {self.endpoint_id}: {exc}")
            except Exception as exc:  # anything else: unknown and follow again, never a dead task
                index.mark_unknown(self.endpoint_id, f"{type(exc).__name__}: {exc}", self._now())
                log.exception("kv events from %s", self.endpoint_id)
            await asyncio.sleep(self.retry_s)  # back-off before reconnecting, not a sync

    def _warn(self, message: str) -> None:
        """Log a warning once while it stays the same (the loop retries every second)."""
        if message != self._said:
            log.warning("%s", message)
            self._said = message

    def _now(self) -> float:
        return self.registry.clock()

    async def _follow(self, source: Source) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.IPV6, _ipv6(source.endpoint))
        # ZMTP heartbeats: a publisher's host that dies without closing its connection
        # (power, a partition) is a disconnect within seconds, not an endpoint live forever
        # on frozen blocks. libzmq answers them itself, on both ends.
        ping_ms = int(self.heartbeat_s * 1000)
        sub.setsockopt(zmq.HEARTBEAT_IVL, ping_ms)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ping_ms)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(source.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    message = parse_monitor_message(await monitor.recv_multipart())
                    if not self._on_monitor(message):
                        return  # look the source up again: a restarted engine may move
                if sub in ready:
                    await self._on_message(await sub.recv_multipart(), source)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    def _on_monitor(self, message: _MonitorMessage) -> bool:
        """False when the publisher went away."""
        if message["event"] == zmq.EVENT_CONNECTED:
            self.connected.set()
        elif message["event"] == zmq.EVENT_DISCONNECTED:
            # The engine went away: what it cached is gone or unknown until it publishes.
            self.stats.disconnects += 1
            self.connected.clear()
            self.registry.kv_index.mark_unknown(
                self.endpoint_id, "publisher disconnected", self._now()
            )
            return False
        return True

    async def _on_message(self, frames: list[bytes], source: Source) -> None:
        batch = self._decode(frames)
        if batch is None:
            return
        index = self.registry.kv_index
        verdict = index.expect(self.endpoint_id, batch.seq)
        if verdict is SeqVerdict.GAP and source.replay_endpoint is not None:
            last = index.endpoint(self.endpoint_id)
            start = (last.last_seq if last and last.last_seq is not None else -1) + 1
            # More than an engine keeps to replay (vLLM: 10,000 batches) is not asked for:
            # the endpoint goes unknown until resync (a forged far-ahead number asked for
            # a range that could not fit in memory).
            if batch.seq - start <= MAX_REPLAY:
                for missed in await self._replay(source, start, batch.seq):
                    self._apply(missed)
                    self.stats.replayed += 1
        self._apply(batch)

    def _decode(self, frames: list[bytes]) -> EventBatch | None:
        try:
            if len(frames) != 3:
                raise KvEventError(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
            return decode_batch(decode_seq(frames[1]), msgpack.unpackb(frames[2]))
        except (KvEventError, ValueError, msgpack.UnpackException) as exc:
            self.stats.bad_messages += 1
            log.warning("bad KV event message from %s: %s", self.endpoint_id, exc)
            return None

    def _apply(self, batch: EventBatch) -> None:
        verdict = self.registry.kv_index.apply_batch(self.endpoint_id, batch, self._now())
        stats = self.stats
        stats.batches += 1
        stats.events += len(batch.events)
        stats.lag_s = max(0.0, self.wall_clock() - batch.ts)
        kv = self.registry.kv_index.endpoint(self.endpoint_id)
        if kv is not None:
            kv.lag_s = stats.lag_s
        if verdict is SeqVerdict.GAP:
            stats.gaps += 1
        elif verdict is SeqVerdict.RESTART:
            stats.restarts += 1

    async def _replay(self, source: Source, start: int, stop: int) -> list[EventBatch]:
        """Batches start..stop-1 from the replay endpoint (vLLM's ROUTER); [] if it fails."""
        assert source.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IPV6, _ipv6(source.replay_endpoint))
        out: list[EventBatch] = []
        try:
            dealer.connect(source.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(self.replay_timeout):
                while True:
                    frames = await dealer.recv_multipart()
                    # (empty, topic, seq, payload), or (empty, seq, payload) from vLLM
                    # releases that sent no topic in replies.
                    if len(frames) == 4:
                        _, _, seq_frame, payload = frames
                    elif len(frames) == 3:
                        _, seq_frame, payload = frames
                    else:
                        continue
                    seq = decode_seq(seq_frame)
                    if seq == END_SEQ:
                        break
                    if start <= seq < stop:
                        batch = self._decode([b"", seq_frame, payload])
                        if batch is not None:
                            out.append(batch)
        except (TimeoutError, zmq.ZMQError, KvEventError) as exc:
            log.warning("replay from %s failed: %s", self.endpoint_id, exc)
        finally:
            dealer.close(linger=0)
        whole = len(out) == stop - start and all(b.seq == start + i for i, b in enumerate(out))
        return out if whole else []


class KvEventSubscribers:
    """A subscriber task per endpoint of every model with `kv_events`; follows reloads."""

    def __init__(self, config: Config, registry: Registry) -> None:
        self.config = config
        self.registry = registry
        self.subscribers: dict[str, KvEventSubscriber] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._supervisor: asyncio.Task[None] | None = None

    def targets(self) -> dict[str, KvEventsSpec]:
        out: dict[str, KvEventsSpec] = {}
        for model, spec in self.config.models.items():
            if spec.kv_events is None:
                continue
            for state in self.registry.states(model):
                out[state.id] = spec.kv_events
                self.registry.kv_index.set_resync(state.id, spec.kv_events.resync)
        return out

    def sync(self) -> None:
        targets = self.targets()
        index = self.registry.kv_index
        for eid in list(self._tasks):
            spec, sub = targets.get(eid), self.subscribers[eid]
            if spec == sub.spec:
                continue
            if spec is not None and spec.model_copy(update={"resync": sub.spec.resync}) == sub.spec:
                sub.spec = spec  # only `resync` (set on the index by targets()): same stream
                continue
            self._tasks.pop(eid).cancel()
            del self.subscribers[eid]
            # Either way the old stream's blocks would stay live, frozen: no removal reaches
            # them any more.
            if spec is None:  # no longer followed
                index.forget(eid)
            else:  # followed from another source: unknown until that stream syncs
                index.mark_unknown(eid, "kv_events source changed", self.registry.clock())
        for eid, spec in targets.items():
            if eid not in self._tasks:
                sub = self.subscribers[eid] = KvEventSubscriber(self.registry, eid, spec)
                self._tasks[eid] = asyncio.create_task(sub.run(), name=f"kv-events {eid}")

    def start(self) -> None:
        """Subscribe now and follow endpoint-set changes (activations, Kubernetes)."""
        self.sync()
        if self._supervisor is None:
            self._supervisor = asyncio.create_task(self._supervise(), name="kv-events")

    async def _supervise(self) -> None:
        version = self.registry.version
        while True:
            await asyncio.sleep(1.0)  # a periodic check, as the scraper's supervisor does
            if self.registry.version != version:
                version = self.registry.version
                self.sync()

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        if self._supervisor is not None:
            tasks.append(self._supervisor)
            self._supervisor = None
        self._tasks.clear()
        self.subscribers.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
