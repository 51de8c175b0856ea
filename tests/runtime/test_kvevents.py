"""The KV-event subscriber against the simulator's ZMQ publisher (vLLM's wire format), over
loopback: discovery, exact cached tokens, replay of a lost batch, a gap without replay, an
engine restart."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import httpx
import orjson
import pytest

from llmgw.config import Config, KvEventsSpec, load_dict
from llmgw.kvevents import BlockStored, EventBatch, encode_events
from llmgw.kvindex import KvState
from llmgw.registry import Registry
from llmgw.runtime.kvevents import (
    KvEventSubscriber,
    ManyRanks,
    source_from_engine,
    source_from_spec,
)
from llmgw.runtime.router import Router
from llmgw.sim import SimFleet
from llmgw.sim.replica import Replica
from llmgw.sim.tokens import block_hashes, chat_prompt, token_ids

pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

BS = 16
SYSTEM = "you are a helpful assistant. " * 30  # ~ 900 chars: several full blocks


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait for a condition the event loop will make true (polled, bounded)."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    async with SimFleet(replicas=1, time_scale=0, seed=1, kv_events_port=0, block_size=BS) as f:
        yield f


@contextlib.asynccontextmanager
async def following(
    replica: Replica, spec: KvEventsSpec, registry: Registry
) -> AsyncIterator[KvEventSubscriber]:
    sub = KvEventSubscriber(registry, f"127.0.0.1:{replica.port}", spec, retry_s=0.05)
    task = asyncio.create_task(sub.run())
    try:
        await asyncio.wait_for(sub.connected.wait(), 5.0)
        yield sub
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def chat(replica: Replica, user: str) -> list[dict[str, object]]:
    messages: list[dict[str, object]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": user},
    ]
    async with httpx.AsyncClient(base_url=replica.url, timeout=10) as client:
        r = await client.post(
            "/v1/chat/completions", json={"model": "m1", "messages": messages, "max_tokens": 2}
        )
        assert r.status_code == 200
    return messages


def engine_hit_tokens(replica: Replica, messages: list[dict[str, object]]) -> int:
    return replica.engine().kv.match_prefix(block_hashes(chat_prompt(messages), BS)) * BS


async def test_discovered_events_predict_the_engines_cached_tokens(fleet: SimFleet) -> None:
    replica = fleet.replicas[0]
    registry = Registry()
    eid = f"127.0.0.1:{replica.port}"
    async with following(replica, KvEventsSpec(discover=True), registry) as sub:
        assert sub.source is not None and sub.source.topic == "kv"
        messages = await chat(replica, "first question")
        await until(lambda: registry.kv_index.size(eid) > 0)
        assert registry.kv_index.state(eid) is KvState.LIVE
        for user in ("first question", "another question entirely"):
            probe: list[dict[str, object]] = [messages[0], {"role": "user", "content": user}]
            ids = token_ids(chat_prompt(probe))
            predicted = registry.kv_index.match(ids, [eid])[eid]
            assert predicted == engine_hit_tokens(replica, probe) > 0
        assert sub.stats.lag_s < 5.0
        assert sub.stats.bad_messages == 0


@pytest.mark.parametrize("topic_in_replies", [True, False])
async def test_a_lost_batch_is_replayed(fleet: SimFleet, topic_in_replies: bool) -> None:
    """Replies as vLLM 0.32 frames them (topic, seq, payload), and as earlier releases did
    (seq, payload): those were skipped, and every gap went unknown after a second."""
    replica = fleet.replicas[0]
    registry = Registry()
    eid = f"127.0.0.1:{replica.port}"
    async with following(replica, KvEventsSpec(discover=True), registry) as sub:
        await chat(replica, "one")
        await until(lambda: sub.stats.batches >= 1)
        assert replica.kv_publisher is not None
        replica.kv_publisher.replay_topic = topic_in_replies
        replica.kv_publisher.drop_next = 1  # the next batch never reaches the SUB socket
        await chat(replica, "two " * 100)
        await chat(replica, "three " * 100)
        await until(lambda: sub.stats.replayed >= 1)
        assert sub.stats.gaps == 0
        assert registry.kv_index.state(eid) is KvState.LIVE


async def test_a_gap_without_replay_marks_the_endpoint_unknown(fleet: SimFleet) -> None:
    replica = fleet.replicas[0]
    assert replica.kv_publisher is not None
    registry = Registry()
    eid = f"127.0.0.1:{replica.port}"
    spec = KvEventsSpec(endpoint=f"tcp://{{host}}:{replica.kv_publisher.port}", topic="kv")
    async with following(replica, spec, registry) as sub:
        await chat(replica, "one")
        await until(lambda: sub.stats.batches >= 1)
        replica.kv_publisher.drop_next = 1
        await chat(replica, "two " * 100)
        await chat(replica, "three " * 100)
        await until(lambda: sub.stats.gaps >= 1)
        assert registry.kv_index.state(eid) is KvState.UNKNOWN
        assert "missed batches" in registry.kv_index.endpoint(eid).reason  # type: ignore[union-attr]


async def test_a_far_ahead_sequence_number_is_not_replayed_and_does_not_stop_following(
    fleet: SimFleet,
) -> None:
    """One forged or corrupt number (2**62) asked the replay endpoint for that many batches:
    the list of them did not fit in memory, the task died, and the endpoint stayed live with
    its blocks frozen."""
    replica = fleet.replicas[0]
    publisher = replica.kv_publisher
    assert publisher is not None
    registry = Registry()
    eid = f"127.0.0.1:{replica.port}"
    async with following(replica, KvEventsSpec(discover=True), registry) as sub:
        await chat(replica, "one")
        await until(lambda: registry.kv_index.state(eid) is KvState.LIVE)
        payload = msgpack.packb([0.0, [], 0])
        publisher._pub.send_multipart((b"kv", (2**62).to_bytes(8, "big"), payload))
        await until(lambda: sub.stats.gaps >= 1)
        assert registry.kv_index.state(eid) is KvState.UNKNOWN
        assert sub.stats.replayed == 0
        await chat(replica, "two " * 100)  # still followed: a batch from the real sequence
        await until(lambda: sub.stats.batches >= 3)


async def test_engine_restart_empties_the_endpoint_within_a_second(fleet: SimFleet) -> None:
    replica = fleet.replicas[0]
    registry = Registry()
    eid = f"127.0.0.1:{replica.port}"
    async with following(replica, KvEventsSpec(discover=True), registry) as sub:
        await chat(replica, "one")
        await until(lambda: registry.kv_index.size(eid) > 0)
        await replica.stop()
        await until(lambda: registry.kv_index.size(eid) == 0, timeout=1.0)
        assert registry.kv_index.state(eid) is KvState.UNKNOWN
        await replica.start()  # same HTTP port, a new publisher from sequence 0
        await until(sub.connected.is_set)
        await chat(replica, "after restart")
        await until(lambda: registry.kv_index.state(eid) is KvState.LIVE)
        assert registry.kv_index.size(eid) > 0


def test_engine_sources_answer_is_read_like_vllms() -> None:
    body = b'{"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": null, "topic": "kv"}}'
    source = source_from_engine(body, "10.0.0.5")
    assert source is not None
    assert (source.endpoint, source.replay_endpoint, source.topic) == (
        "tcp://10.0.0.5:5557",
        None,
        "kv",
    )
    assert source_from_engine(b"{}", "h") is None
    off = b'{"0": {"enable_kv_cache_events": false, "endpoint": "tcp://*:1"}}'
    assert source_from_engine(off, "h") is None


def test_an_ipv6_engines_sources_are_bracketed() -> None:
    body = b'{"0": {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}}'
    source = source_from_engine(body, "fd00::5")
    assert source is not None
    assert (source.endpoint, source.replay_endpoint) == (
        "tcp://[fd00::5]:5557",
        "tcp://[fd00::5]:5558",
    )
    spec = KvEventsSpec(endpoint="tcp://{host}:5557", replay_endpoint="tcp://{host}:5558")
    assert source_from_spec(spec, "fd00::5").endpoint == "tcp://[fd00::5]:5557"
    assert source_from_spec(spec, "10.0.0.5").endpoint == "tcp://10.0.0.5:5557"


async def test_an_ipv6_endpoints_publisher_is_followed() -> None:
    """libzmq refuses IPv6 peers unless the socket allows them: the subscriber never
    connected, and said nothing."""
    import zmq.asyncio  # noqa: PLC0415  (the extra; imported at the top it is not optional)

    ctx = zmq.asyncio.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.IPV6, 1)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        port = pub.bind_to_random_port("tcp://[::1]")
    except zmq.ZMQError as exc:
        pub.close()
        pytest.skip(f"no IPv6 loopback here: {exc}")
    registry = Registry()
    eid = "[::1]:8000"
    spec = KvEventsSpec(endpoint=f"tcp://{{host}}:{port}", topic="kv")
    sub = KvEventSubscriber(registry, eid, spec, retry_s=0.05)
    task = asyncio.create_task(sub.run())
    payload = msgpack.packb(
        [0.0, encode_events([BlockStored((b"h0",), None, (1, 2, 3, 4), 4, medium="GPU")]), 0]
    )
    try:
        async with asyncio.timeout(5):
            while registry.kv_index.state(eid) is not KvState.LIVE:
                # batch 0 of a new engine, sent again until the subscription is through
                await pub.send_multipart([b"kv", (0).to_bytes(8, "big"), payload])
                await asyncio.sleep(0.05)  # the resend interval (PUB drops until joined)
        assert registry.kv_index.match((1, 2, 3, 4, 5), [eid]) == {eid: 4}
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        pub.close()


async def test_a_reload_that_drops_kv_events_stops_following_and_forgets(fleet: SimFleet) -> None:
    """Dropping the last `kv_events:` stanza left the subscribers running on the old config;
    dropping one model's left its endpoints live with frozen blocks."""
    replica = fleet.replicas[0]
    eid = f"127.0.0.1:{replica.port}"

    def config(kv_events: bool) -> Config:
        model: dict[str, object] = {"endpoints": [eid]}
        if kv_events:
            model["kv_events"] = {"discover": True}
        return load_dict({"models": {"m1": model}})

    router = Router(config(True), scrape=True)
    await router.start()
    try:
        index = router.registry.kv_index
        subscribers = router.kv_events
        assert subscribers is not None
        await until(lambda: eid in subscribers.subscribers)
        await asyncio.wait_for(subscribers.subscribers[eid].connected.wait(), 5.0)
        await chat(replica, "one")
        await until(lambda: index.state(eid) is KvState.LIVE and index.size(eid) > 0)
        router.reload(config(False))
        assert subscribers.subscribers == {}
        assert index.state(eid) is KvState.UNKNOWN and index.size(eid) == 0
    finally:
        await router.stop()


async def test_a_reload_to_another_kv_events_source_makes_the_endpoint_unknown() -> None:
    """A reload pointing an endpoint's `kv_events` at another source (a topic, a port,
    discover) restarted its subscriber but left the endpoint live on the old stream's
    blocks, frozen, for as long as the new source said nothing (found by a review
    helper)."""
    import zmq.asyncio  # noqa: PLC0415  (the extra; imported at the top it is not optional)

    from llmgw.runtime.kvevents import KvEventSubscribers  # noqa: PLC0415
    from llmgw.types import Endpoint  # noqa: PLC0415

    pub = zmq.asyncio.Context.instance().socket(zmq.PUB)  # a source that never publishes
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    eid = "127.0.0.1:8000"

    def config(topic: str, resync: float) -> Config:
        kv_events = {"endpoint": f"tcp://{{host}}:{port}", "topic": topic, "resync": resync}
        return load_dict({"models": {"m": {"endpoints": [eid], "kv_events": kv_events}}})

    registry = Registry()
    registry.set_endpoints("m", [Endpoint(eid, "m")])
    index = registry.kv_index
    subscribers = KvEventSubscribers(config("kv", 10.0), registry)
    subscribers.sync()
    try:
        batch = EventBatch(0, 0.0, (BlockStored((b"h0",), None, (1, 2, 3, 4), 4),))
        index.apply_batch(eid, batch, now=registry.clock())
        first = subscribers.subscribers[eid]
        subscribers.config = config("kv", 0.0)  # the resync time only: the same stream
        subscribers.sync()
        assert subscribers.subscribers[eid] is first and first.spec.resync == 0.0
        assert index.state(eid) is KvState.LIVE and index.size(eid) == 1
        subscribers.config = config("renamed", 0.0)
        subscribers.sync()
        assert subscribers.subscribers[eid] is not first
        assert index.state(eid) is KvState.UNKNOWN and index.size(eid) == 0
        assert index.endpoint(eid).reason == "kv_events source changed"  # type: ignore[union-attr]
    finally:
        await subscribers.stop()
        pub.close()


class Relay:
    """A TCP relay that can go silent without closing (a host lost without a FIN)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.silent = False
        self.server: asyncio.Server | None = None
        self.port = 0
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._pair, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        await self.server.wait_closed()

    async def _pair(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    if not self.silent:
                        dst.write(data)

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


async def test_a_publisher_gone_silent_without_closing_is_a_disconnect(fleet: SimFleet) -> None:
    """No FIN ever comes from a host that lost power: the subscriber's heartbeats time out
    and the endpoint goes unknown, not live on frozen blocks."""
    replica = fleet.replicas[0]
    publisher = replica.kv_publisher
    assert publisher is not None
    relay = Relay(publisher.port)
    await relay.start()
    registry = Registry()
    eid = f"127.0.0.1:{replica.port}"
    spec = KvEventsSpec(endpoint=f"tcp://{{host}}:{relay.port}", topic="kv")
    sub = KvEventSubscriber(registry, eid, spec, retry_s=0.05, heartbeat_s=0.1)
    task = asyncio.create_task(sub.run())
    try:
        await asyncio.wait_for(sub.connected.wait(), 5.0)
        registry.kv_index.resync_s = 0.0  # a batch lost while the relay's link comes up
        for turn in range(50):
            await chat(replica, f"turn {turn} " * 40)
            if registry.kv_index.state(eid) is KvState.LIVE:
                break
            await asyncio.sleep(0.05)  # paced: the subscription crosses the relay meanwhile
        assert registry.kv_index.state(eid) is KvState.LIVE
        relay.silent = True
        await until(lambda: sub.stats.disconnects >= 1, timeout=5.0)
        assert registry.kv_index.state(eid) is KvState.UNKNOWN
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await relay.stop()


def test_each_models_resync_time_applies_to_its_own_endpoints() -> None:
    """`kv_events.resync` is a model's setting: the last model's value was set on the one
    index, so a model asking to trust its engines at once waited another model's minute."""
    from llmgw.kvevents import EventBatch  # noqa: PLC0415
    from llmgw.runtime.kvevents import KvEventSubscribers  # noqa: PLC0415
    from llmgw.types import Endpoint  # noqa: PLC0415

    fast, slow = "10.0.0.1:8000", "10.0.0.2:8000"
    config = load_dict(
        {
            "models": {
                "fast": {"endpoints": [fast], "kv_events": {"discover": True, "resync": 0}},
                "slow": {"endpoints": [slow], "kv_events": {"discover": True, "resync": 60}},
            }
        }
    )
    registry = Registry()
    registry.set_endpoints("fast", [Endpoint(fast, "fast")])
    registry.set_endpoints("slow", [Endpoint(slow, "slow")])
    KvEventSubscribers(config, registry).targets()
    index = registry.kv_index
    for eid in (fast, slow):
        index.apply_batch(eid, EventBatch(5, 0.0, ()), now=0.0)  # joined late: unknown
        index.apply_batch(eid, EventBatch(6, 0.0, ()), now=1.0)
    assert index.state(fast) is KvState.LIVE
    assert index.state(slow) is KvState.UNKNOWN


async def test_discovery_against_an_engine_that_never_answers_is_retried() -> None:
    """`GET /kv_event_sources` is bounded: an engine whose HTTP side hangs with its port
    open (after a heartbeat disconnect, say) is asked again, not waited on until its socket
    dies, which left that endpoint's subscriber stalled (found by a review helper)."""
    accepted: list[asyncio.StreamWriter] = []

    async def hang(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # read nothing, answer nothing

    server = await asyncio.start_server(hang, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sub = KvEventSubscriber(
        Registry(),
        f"127.0.0.1:{port}",
        KvEventsSpec(discover=True),
        retry_s=0.01,
        discover_timeout=0.1,
    )
    task = asyncio.create_task(sub.run())
    try:
        await until(lambda: len(accepted) >= 2)
        assert sub.source is None
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()


ONE_RANK = {"enable_kv_cache_events": True, "endpoint": "tcp://*:5557", "topic": "kv"}


def test_engine_sources_as_a_list_or_one_config_are_read_too() -> None:
    """Newer vLLM answers `/kv_event_sources` with a list of its ranks' configs."""
    for body in (orjson.dumps([ONE_RANK]), orjson.dumps(ONE_RANK)):
        source = source_from_engine(body, "10.0.0.5")
        assert source is not None and source.endpoint == "tcp://10.0.0.5:5557"


async def test_an_engine_whose_data_parallel_ranks_publish_stays_approximate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each data-parallel rank has its own cache and stream, and the engine sends a request
    to any rank: following rank 0's alone reported its blocks as the whole endpoint's,
    exactly (found by a review helper). The endpoint is not live for exact matching, said
    once in the log, not at every retry."""
    ranks = {"0": ONE_RANK, "1": {**ONE_RANK, "endpoint": "tcp://*:5558"}}
    with pytest.raises(ManyRanks, match="2 data-parallel ranks"):
        source_from_engine(orjson.dumps(ranks), "h")
    asked: list[int] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        asked.append(1)
        body = orjson.dumps(ranks)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    eid = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    registry = Registry()
    sub = KvEventSubscriber(registry, eid, KvEventsSpec(discover=True), retry_s=0.01)
    task = asyncio.create_task(sub.run())
    try:
        with caplog.at_level(logging.WARNING, logger="llmgw.kvevents"):
            await until(lambda: len(asked) >= 3)
        assert sub.source is None and registry.kv_index.state(eid) is not KvState.LIVE
        assert registry.kv_index.match((1, 2, 3), [eid]) == {}
        assert caplog.text.count("data-parallel ranks") == 1
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        server.close()
        await server.wait_closed()
