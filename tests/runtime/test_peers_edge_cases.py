"""Router replicas together (`peers:`): an IPv6 wildcard listener peering with IPv4 replicas, a
peer's session keys bounded, an idle stop waiting for the peers' requests in flight (and for
one that ended between two idle checks), and a peer's zero while an endpoint is briefly gone
here."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from llmgw.config import Config, load_dict
from llmgw.registry import Registry
from llmgw.runtime.peers import (
    _HEADER,
    _RECORD,
    MAGIC,
    RemoteLoad,
    apply,
    decode,
    indexes,
)
from llmgw.runtime.ports import free_port
from llmgw.runtime.router import Router
from llmgw.scheduling.prefix import PrefixIndex
from llmgw.testing.controlplane import FakeControlPlane
from llmgw.testing.wait import eventually
from llmgw.types import Decision, Endpoint, Outcome, RequestInfo

ENDPOINTS = [f"10.0.0.{i}:8000" for i in range(1, 5)]
HISTORY = "a long conversation so far, with the notes the user pasted in. " * 40


@asynccontextmanager
async def _running(*routers: Router) -> AsyncIterator[None]:
    try:
        for router in routers:
            await router.start()
        yield
    finally:
        for router in routers:
            await router.stop()


# -- 1: a replica listening on the IPv6 wildcard cannot peer with IPv4 addresses ---------


def _peers_config(listen: str, ports: list[int]) -> Config:
    return load_dict(
        {
            "models": {"m": {"endpoints": ENDPOINTS, "strategy": "latency"}},
            "peers": {"listen": listen, "addresses": [f"127.0.0.1:{p}" for p in ports]},
        }
    )


async def test_a_replica_listening_on_the_ipv6_wildcard_peers_with_ipv4_replicas() -> None:
    ports = [free_port(), free_port()]
    a = Router(_peers_config(f"[::]:{ports[0]}", ports), scrape=False, seed=0)  # dual-stack
    b = Router(_peers_config(f"127.0.0.1:{ports[1]}", ports), scrape=False, seed=1)
    async with _running(a, b):
        assert a.peers is not None and b.peers is not None
        # A knows B (the names resolve; IPv4 peers are reached through the dual-stack socket).
        assert a.peers.stats.peers >= 1
        for sender, receiver in ((a, b), (b, a)):
            prompt = f"from {id(sender)} " + HISTORY
            request = RequestInfo("m", "r", session_key="s", prompt=prompt, prompt_tokens=700)
            chosen = sender.scheduler.pick(request).endpoint.id
            ((_, index),) = indexes(receiver.scheduler)
            hashes = index.hashes(prompt)

            def learned(i: PrefixIndex = index, h: list[int] = hashes) -> bool:
                return bool(i.match(h))

            await eventually(learned)  # the peer learned the pick
            assert index.match(hashes) == {chosen: len(hashes)}
        assert a.peers.stats.dropped.get("unknown_sender", 0) == 0


# -- 2: a peer's oversized session key is kept in full by the receiver ------------------


def _insert_datagram(sender: bytes, endpoint: str, key: str, hashes: list[int]) -> bytes:
    m, e, k = b"m", endpoint.encode(), key.encode()
    record = _RECORD.pack(len(m), len(e), len(k), 256, len(hashes)) + m + e + k
    return _HEADER.pack(MAGIC, sender, 1, 1) + record + struct.pack(f">{len(hashes)}q", *hashes)


def test_a_session_key_past_the_bound_is_not_kept_from_a_peer() -> None:
    # A sender never puts a key past `_MAX_KEY` on the wire; a receiver keeps whatever comes:
    # each block hash holds its last key, so one 60 KB key per block, for every block of
    # every endpoint's index (16,384 each by default), is GBs held from a peer's datagrams.
    router = Router(_peers_config("127.0.0.1:9", [9]), scrape=False)
    ((_, index),) = indexes(router.scheduler)
    for i in range(50):
        datagram = _insert_datagram(b"peer-one", ENDPOINTS[0], f"{i}" + "k" * 60_000, [i])
        ((record),) = decode(datagram)[2]
        assert apply(router.scheduler, record, 0.0) is None
    assert index.size(ENDPOINTS[0]) == 50  # the blocks are taken ...
    assert not index._last_key  # ... not the oversized keys (no sharing counted for them)


# -- 3: an idle on-demand model is stopped while the peers have requests in flight --------


async def _lazy_model_routed_once() -> tuple[Router, FakeControlPlane, Decision]:
    """An on-demand model (idle_timeout 60) started by this replica's one request."""
    config = load_dict(
        {
            "models": {
                "lazy": {
                    "launch": {"command": "true {port}"},
                    "scaling": {"min": 0, "max": 1, "idle_timeout": 60},
                }
            }
        }
    )
    cp = FakeControlPlane()
    cp.release.set()
    router = Router(config, control_plane=cp, scrape=False)
    return router, cp, await router.decide(RequestInfo(model="lazy", request_id="r1"))


async def test_an_idle_model_is_not_stopped_while_peer_replicas_have_requests_in_flight() -> None:
    router, cp, decision = await _lazy_model_routed_once()
    assert router.activator is not None
    router.acquire(decision).finish(Outcome.SUCCESS)  # this replica's own use is over
    # The other router replica has two requests streaming from the same engine (what its
    # `peers:` load updates put on this replica's registry).
    endpoint = decision.endpoint.id
    remote = RemoteLoad()
    assert remote.update(router.registry, b"replica2", ("lazy", endpoint, 2, 0.0), 0.0)
    state = router.registry.get("lazy", endpoint)
    assert state is not None and state.remote_inflight == 2
    clock = router.activator.clock
    router.activator.clock = lambda: clock() + 100  # past the idle timeout
    await router.activator.tick()
    assert cp.stops == 0  # scaling the Deployment to 0 would kill the peer's requests
    # Once the peer's requests end, the idle timer runs from then.
    remote.update(router.registry, b"replica2", ("lazy", endpoint, 0, 0.0), 0.0)
    router.activator.clock = lambda: clock() + 130
    await router.activator.tick()
    assert cp.stops == 0
    router.activator.clock = lambda: clock() + 200
    await router.activator.tick()
    assert cp.stops == 1


async def test_a_peers_request_between_two_idle_checks_restarts_the_idle_timer() -> None:
    """The activator read the peers' in-flight count only at its ticks (every 0.5 s): a peer's
    request that began and ended between two never restarted the idle timer, and the model
    was stopped while the other replica used it (found by a review helper)."""
    router, cp, decision = await _lazy_model_routed_once()
    assert router.activator is not None
    router.acquire(decision).finish(Outcome.SUCCESS)  # this replica's own use ends at 0
    clock = router.activator.clock
    router.activator.clock = lambda: clock() + 50
    await router.activator.tick()
    # After 50 the other replica's short request begins and ends before this one's next tick.
    endpoint = decision.endpoint.id
    remote = RemoteLoad()
    now = router.registry.clock()
    assert remote.update(router.registry, b"replica2", ("lazy", endpoint, 1, 0.0), now)
    assert remote.update(router.registry, b"replica2", ("lazy", endpoint, 0, 0.0), now)
    router.activator.clock = lambda: clock() + 50.5  # the next tick
    await router.activator.tick()
    router.activator.clock = lambda: clock() + 100  # 100 s after its own use, 50 after the peer's
    await router.activator.tick()
    assert cp.stops == 0
    router.activator.clock = lambda: clock() + 111  # 60 s after the tick that saw the peer's
    await router.activator.tick()
    assert cp.stops == 1


# -- 4: a peer's zero for an endpoint gone here for a moment is lost --------------------


def test_a_peers_zero_while_the_endpoint_was_gone_here_counts_when_it_returns() -> None:
    registry = Registry(clock=lambda: 0.0)
    endpoints = [Endpoint(e, "m") for e in ENDPOINTS[:2]]
    registry.set_endpoints("m", endpoints)
    remote = RemoteLoad(ttl=3.0)
    assert remote.update(registry, b"peer-one", ("m", ENDPOINTS[0], 5, 800.0), now=0.0)
    registry.set_endpoints("m", endpoints[1:])  # NotReady here for a moment (a flap)
    # Meanwhile peer-one's five requests there end: its zero finds no endpoint here.
    assert not remote.update(registry, b"peer-one", ("m", ENDPOINTS[0], 0, 0.0), now=0.5)
    registry.set_endpoints("m", endpoints)  # back
    assert remote.update(registry, b"peer-two", ("m", ENDPOINTS[0], 1, 100.0), now=1.0)
    state = registry.get("m", ENDPOINTS[0])
    assert state is not None
    # peer-two's one request, not also peer-one's five it said had ended.
    assert (state.remote_inflight, state.remote_pending) == (1, 100.0)
