"""Router replicas share what they route, so each one's prefix index holds the fleet's traffic.

Two llmgw replicas behind one balancer each see half the requests. Without KV-cache events
each one's prefix index holds only its half: a conversation's next turn, arriving at the
other replica, finds no history anywhere and is placed as new, away from its cache (on a
simulated fleet of 8, two routers' TTFT p90 was 1.2-2.6x one router's; bench/kv_exact.py).
NVIDIA Dynamo's KV router replicas share their routing decisions for the same reason.

Every insert into a prefix index (a routed prompt's block hashes and the endpoint it went
to) is sent to the peers as a UDP datagram; a peer inserts it into its own index for the
same model, as if it had routed it. UDP because a lost hint costs one cache miss at worst
and must never hold a request: no connection to keep, no backpressure, no head-of-line
blocking. Inserts queued in one event-loop turn go out together (records packed up to
`MAX_DATAGRAM` bytes). Datagrams are accepted only from the peers' resolved addresses and
only for endpoints this replica also routes to; with a shared secret (`secret_env`), only
with its HMAC-SHA256 tag (16 bytes appended).

Replicas also share their load: each one's requests in flight per endpoint and the prefill
tokens it queued there (`registry.own_load`). Each router counts only its own between
scrapes, so a replica its peer just filled looked idle to it: two peering proxies routed
1.12-1.17x worse than one where load decides (a busy session home). A router's load
changes are sent as they happen (coalesced per loop turn, only what changed), refreshed
every `LOAD_REFRESH` seconds (a zero for `LOAD_TTL` after the load went to zero), and
forgotten `LOAD_TTL` seconds after a peer last told them, looked for every
`LOAD_EXPIRY_CHECK` (a peer that died stops counting); a stopping replica sends its
zeros. The sums over peers land on each endpoint's state (`remote_inflight`,
`remote_pending`), which the scorers add to their own.

Wire format, big-endian (hand-written with `struct`: a datagram is a header and flat
records; a schema library would add a dependency for ~20 lines):
    header: magic (4 bytes), sender id (8 bytes per process: its start time in ms in 6,
            then 2 random), sequence number (u64, per sender, one per datagram), record
            count (u16)
    b"LGP2", prefix-index inserts; record: model length (u16), endpoint length (u16), key
            length (u16), block size in characters (u32), hash count (u16), then model,
            endpoint, key (UTF-8) and the hashes (i64 each)
    b"LGL2", load; record: model length (u16), endpoint length (u16), requests in flight
            (u32), prefill tokens queued (f32), then model and endpoint (UTF-8)
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import math
import os
import socket
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from llmgw.config import PeersSpec
from llmgw.registry import EndpointState, Registry, own_load
from llmgw.runtime.controlplanes import StartError
from llmgw.runtime.scraper import split_address
from llmgw.scheduling.prefix import PrefixIndex
from llmgw.scheduling.scheduler import ModelRouter, Scheduler

log = logging.getLogger("llmgw.peers")

# Version 2 added the sequence number: a datagram at or below the last one a sender's id
# was heard with is dropped (a replay of a captured datagram, or a late one after the
# sender's goodbye, put a stopped replica's load back).
MAGIC = b"LGP2"
LOAD_MAGIC = b"LGL2"
_HEADER = struct.Struct(">4s8sQH")
_RECORD = struct.Struct(">HHHIH")
_LOAD = struct.Struct(">HHIf")
# A peer's load is resent this often while non-zero, and forgotten this long after it last
# came (a lost update heals within a refresh; a dead peer's load stops counting), looked
# for this often (a scan of the few reports held: a dead peer's load is gone within
# `LOAD_TTL + LOAD_EXPIRY_CHECK`, not up to a refresh later).
LOAD_REFRESH = 1.0
LOAD_TTL = 3.0
LOAD_EXPIRY_CHECK = 0.25
# The most load one peer can claim at one endpoint (a bound no engine comes near): past it a
# load datagram is malformed, not taken into the queue estimates and calibration.
MAX_LOAD_INFLIGHT = 1_000_000  # requests in flight
MAX_LOAD_PENDING = 1e9  # prefill tokens queued
# Kept under common path MTUs' reassembly limits with room to spare; a record longer than
# one datagram keeps its leading blocks (the prefix is what matching walks).
MAX_DATAGRAM = 8192
_MAX_KEY = 512  # longer session keys travel without the key (sharing counts skip them)
MAX_PENDING = 10_000  # records waiting for the next flush; past it new ones are dropped
_MAX_SOURCES = 4096  # peer (ip, port) pairs whose last sender id is kept
_RETIRED_KEPT = 4  # ids a source had before its current one, dropped if they come late
MAX_BUFFERED = 1 << 20  # bytes the transport may hold unsent before a flush is dropped

Record = tuple[str, str, str | None, int, list[int]]  # model, endpoint, key, block chars, hashes
LoadRecord = tuple[str, str, int, float]  # model, endpoint, in flight, prefill tokens queued
_R = TypeVar("_R", Record, LoadRecord)


Numbers = Iterator[int]  # a sender's datagram numbers (itertools.count(1))


def _frames(
    magic: bytes, sender: bytes, records: Iterable[bytes], limit: int, seq: Numbers
) -> list[bytes]:
    """Packed records, in order, in datagrams of at most `limit` bytes: a header each,
    numbered from `seq`."""
    out: list[bytes] = []
    parts: list[bytes] = []
    size = _HEADER.size
    for record in records:
        if size + len(record) > limit and parts:
            out.append(_HEADER.pack(magic, sender, next(seq), len(parts)) + b"".join(parts))
            parts, size = [], _HEADER.size
        parts.append(record)
        size += len(record)
    if parts:
        out.append(_HEADER.pack(magic, sender, next(seq), len(parts)) + b"".join(parts))
    return out


def _unframe(
    data: bytes, magic: bytes, read: Callable[[bytes, int], tuple[_R, int]]
) -> tuple[bytes, int, list[_R]]:
    """(sender id, sequence number, the records `read` takes one at a time from `data`'s
    offset): ValueError unless `data` is one whole datagram of kind `magic`."""
    if len(data) < _HEADER.size:
        raise ValueError("shorter than a header")
    kind, sender, seq, count = _HEADER.unpack_from(data)
    if kind != magic:
        raise ValueError(f"not an llmgw peer datagram of kind {magic.decode()}")
    at = _HEADER.size
    records: list[_R] = []
    try:
        for _ in range(count):
            record, at = read(data, at)
            records.append(record)
    except (struct.error, UnicodeDecodeError) as exc:
        raise ValueError(str(exc)) from None
    if at != len(data):
        raise ValueError("bytes past the last record")
    return sender, seq, records


def _packed_inserts(records: Sequence[Record], limit: int) -> Iterator[bytes]:
    for model, endpoint, key, block_chars, hashes in records:
        m, e = model.encode(), endpoint.encode()
        k = key.encode() if key is not None else b""
        if len(k) > _MAX_KEY:
            k = b""
        room = (limit - _HEADER.size - _RECORD.size - len(m) - len(e) - len(k)) // 8
        if room < 1:
            continue  # names too long to carry any block: never the case for real names
        n = min(len(hashes), room, 0xFFFF)
        head = _RECORD.pack(len(m), len(e), len(k), block_chars, n)
        yield head + m + e + k + struct.pack(f">{n}q", *hashes[:n])


def encode(
    sender: bytes, records: Sequence[Record], limit: int = MAX_DATAGRAM, seq: Numbers | None = None
) -> list[bytes]:
    """Datagrams of at most `limit` bytes carrying `records`, in order."""
    return _frames(MAGIC, sender, _packed_inserts(records, limit), limit, seq or itertools.count(1))


TAG = 16  # bytes of HMAC-SHA256 kept (128 bits) when the replicas share a secret


class Unauthenticated(ValueError):
    """A datagram without the tag the shared secret gives."""


def seal(datagram: bytes, key: bytes) -> bytes:
    return datagram + hmac.digest(key, datagram, "sha256")[:TAG]


def unseal(data: bytes, key: bytes) -> bytes:
    """The datagram inside `data`; raises Unauthenticated unless its tag is `key`'s."""
    body, tag = data[:-TAG], data[-TAG:]
    if len(data) <= TAG or not hmac.compare_digest(tag, hmac.digest(key, body, "sha256")[:TAG]):
        raise Unauthenticated("missing or wrong tag")
    return body


def _read_insert(data: bytes, at: int) -> tuple[Record, int]:
    lm, le, lk, block_chars, n = _RECORD.unpack_from(data, at)
    at += _RECORD.size
    end = at + lm + le + lk + 8 * n
    if end > len(data):
        raise ValueError("record runs past the datagram")
    model = data[at : at + lm].decode()
    at += lm
    endpoint = data[at : at + le].decode()
    at += le
    # Past the bound a sender keeps (`_MAX_KEY`), no key: each block would hold it.
    key = data[at : at + lk].decode() if 0 < lk <= _MAX_KEY else None
    hashes = list(struct.unpack_from(f">{n}q", data, at + lk))
    return (model, endpoint, key, block_chars, hashes), end


def decode(data: bytes) -> tuple[bytes, int, list[Record]]:
    """(sender id, sequence number, records); raises ValueError on anything that is not a
    whole datagram."""
    return _unframe(data, MAGIC, _read_insert)


def _packed_loads(records: Sequence[LoadRecord], limit: int) -> Iterator[bytes]:
    for model, endpoint, inflight, pending in records:
        m, e = model.encode(), endpoint.encode()
        if _LOAD.size + len(m) + len(e) > limit - _HEADER.size or len(m) > 0xFFFF:
            continue  # names no datagram can carry: never the case for real names
        n = min(max(inflight, 0), MAX_LOAD_INFLIGHT)
        yield _LOAD.pack(len(m), len(e), n, min(max(pending, 0.0), MAX_LOAD_PENDING)) + m + e


def encode_load(
    sender: bytes,
    records: Sequence[LoadRecord],
    limit: int = MAX_DATAGRAM,
    seq: Numbers | None = None,
) -> list[bytes]:
    """Load datagrams of at most `limit` bytes carrying `records`, in order."""
    return _frames(
        LOAD_MAGIC, sender, _packed_loads(records, limit), limit, seq or itertools.count(1)
    )


def _read_load(data: bytes, at: int) -> tuple[LoadRecord, int]:
    lm, le, inflight, pending = _LOAD.unpack_from(data, at)
    at += _LOAD.size
    end = at + lm + le
    if end > len(data):
        raise ValueError("record runs past the datagram")
    if not 0.0 <= pending <= MAX_LOAD_PENDING:  # NaN, negative, infinite, absurd: not a queue
        raise ValueError("pending prefill tokens out of range")
    if inflight > MAX_LOAD_INFLIGHT:
        raise ValueError("requests in flight out of range")
    model = data[at : at + lm].decode()
    endpoint = data[at + lm : end].decode()
    return (model, endpoint, inflight, pending), end


def decode_load(data: bytes) -> tuple[bytes, int, list[LoadRecord]]:
    """(sender id, sequence number, load records); raises ValueError on anything but a whole
    load datagram."""
    return _unframe(data, LOAD_MAGIC, _read_load)


class RemoteLoad:
    """What each peer last reported in flight and queued per endpoint; the sums over peers
    are written into the registry's states (`remote_inflight`, `remote_pending`)."""

    def __init__(self, ttl: float = LOAD_TTL) -> None:
        self.ttl = ttl
        # (model, endpoint) -> sender -> (in flight, tokens queued, when it came)
        self._by: dict[tuple[str, str], dict[bytes, tuple[int, float, float]]] = {}

    def update(self, registry: Registry, sender: bytes, record: LoadRecord, now: float) -> bool:
        """Take one peer's report; False when this replica does not route to that endpoint."""
        model, endpoint, inflight, pending = record
        key = (model, endpoint)
        peers = self._by.get(key)
        state = registry.get(model, endpoint)
        if state is None:
            # Gone here (for now): what this peer told before is over too (a zero must not
            # be lost; the endpoint may come back before the ttl, and a load is refreshed).
            if peers is not None and peers.pop(sender, None) is not None and not peers:
                del self._by[key]
            return False
        before = peers.get(sender) if peers is not None else None
        if inflight or pending:
            if peers is None:
                peers = self._by[key] = {}
            peers[sender] = (inflight, pending, now)
        elif peers is not None:
            peers.pop(sender, None)
        if inflight > 0 or (before is not None and before[0] > 0):
            # In use now (or until now): a request that begins and ends between two of the
            # activator's idle checks still restarts its timer.
            state.remote_busy_at = now
        _sum_into(state, peers)
        if peers is not None and not peers:
            del self._by[key]
        return True

    def expire(self, registry: Registry, now: float) -> int:
        """Forget reports older than `ttl`; returns how many were forgotten."""
        ttl = self.ttl
        return self._drop(registry, lambda _, report: now - report[2] > ttl)

    def forget(self, registry: Registry, sender: bytes) -> int:
        """Drop everything `sender` reported (it restarted under a new id); how many."""
        return self._drop(registry, lambda who, _: who == sender)

    def _drop(
        self, registry: Registry, which: Callable[[bytes, tuple[int, float, float]], bool]
    ) -> int:
        """Drop the reports `which` picks, re-summing the endpoints they were about."""
        dropped = 0
        for key, peers in list(self._by.items()):
            gone = [sender for sender, report in peers.items() if which(sender, report)]
            if not gone:
                continue
            for sender in gone:
                del peers[sender]
            dropped += len(gone)
            state = registry.get(*key)
            if state is not None:
                _sum_into(state, peers)
            if not peers:
                del self._by[key]
        return dropped

    def clear(self, registry: Registry) -> None:
        for key in self._by:
            state = registry.get(*key)
            if state is not None:
                _sum_into(state, None)
        self._by.clear()


def _sum_into(state: EndpointState, peers: dict[bytes, tuple[int, float, float]] | None) -> None:
    inflight, pending = 0, 0.0
    for n, tokens, _ in (peers or {}).values():
        inflight += n
        pending += tokens
    state.remote_inflight, state.remote_pending = inflight, pending


def _router_indexes(router: ModelRouter) -> Iterator[PrefixIndex]:
    for scorer, _ in router.scorers:
        index = getattr(scorer, "index", None)
        if isinstance(index, PrefixIndex):
            yield index


def indexes(scheduler: Scheduler) -> Iterator[tuple[str, PrefixIndex]]:
    """(model, index) for every prefix index of the scheduler's routers."""
    for model, router in scheduler.routers.items():
        for index in _router_indexes(router):
            yield model, index


def apply(scheduler: Scheduler, record: Record, now: float) -> str | None:
    """Insert a peer's record into this scheduler's indexes for its model (those cutting
    blocks of the same size); None once inserted, else why not (a `llmgw_peer_dropped_total`
    reason): `unknown_endpoint`, this replica does not route to that endpoint; `no_index`,
    it has no index of that block size for the model (another `block_tokens`, or a strategy
    without a prefix index)."""
    model, endpoint, key, block_chars, hashes = record
    router = scheduler.routers.get(model)
    if router is None or scheduler.registry.get(model, endpoint) is None:
        return "unknown_endpoint"
    applied = False
    for index in _router_indexes(router):
        if index.block_chars == block_chars:
            index.insert(endpoint, hashes, key, now)
            applied = True
    return None if applied else "no_index"


def _sibling_ports(directory: Path) -> set[tuple[str, int]]:
    """Loopback addresses of the live worker processes registered in `directory`."""
    found: set[tuple[str, int]] = set()
    for entry in directory.glob("*.port"):
        try:
            pid, _, port = entry.stem.partition("-")
            os.kill(int(pid), 0)  # a worker that died without unregistering: skipped
            found.add(("127.0.0.1", int(port)))
        except (ValueError, OSError):  # not ours, gone, or removed as we read
            continue
    return found


def workers_spec(interval: float = 0.5) -> PeersSpec:
    """The worker processes of one edge peer on loopback, on ports the kernel picks."""
    return PeersSpec.model_construct(listen="127.0.0.1:0", addresses=(), resolve_interval=interval)


@dataclass
class PeerStats:
    """Counts for `/metrics` (`llmgw_peer_*`)."""

    sent: int = 0  # records sent (to each peer once)
    received: int = 0  # records applied
    load_sent: int = 0  # load updates sent (one endpoint's, to each peer once)
    load_received: int = 0  # peers' load updates taken
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> records or datagrams
    peers: int = 0  # addresses sent to (this replica's own skipped where recognised)

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n


class Peers(asyncio.DatagramProtocol):
    """Sends this replica's prefix-index inserts to its peers and applies theirs.

    `scheduler` is read at each use (a config reload swaps it); `attach()` after a reload
    hooks the new routers' indexes. Inserts made off the event loop's thread (a pick in a
    worker thread) are handed to the loop; sending and applying run on the loop only."""

    def __init__(
        self,
        spec: PeersSpec,
        scheduler: Callable[[], Scheduler],
        *,
        siblings: Path | None = None,
        key: bytes | None = None,
    ) -> None:
        """`siblings`: the worker processes of one edge (`--workers N`) find each other in
        this directory instead of `spec.addresses` (each writes `<pid>-<port>.port`);
        `key`: their shared secret, given rather than named by `spec.secret_env`."""
        self.spec = spec
        self._scheduler = scheduler
        self.siblings = siblings
        secret = os.environ.get(spec.secret_env) if spec.secret_env else None
        if spec.secret_env and not secret:
            raise StartError(
                f"peers.secret_env: the environment variable {spec.secret_env} is not set or "
                "empty (every replica needs the same secret)"
            )
        self._key = key if key is not None else secret.encode() if secret else None
        # Its start time first (ms, big-endian), then random: of two ids heard from one
        # address, the lower is the older process (a late datagram of a replica that has
        # restarted since), however the wire reordered them.
        self.sender = (time.time_ns() // 1_000_000).to_bytes(6, "big") + os.urandom(2)
        self._seq = itertools.count(1)  # this replica's datagram numbers
        # Per peer sender id, the highest sequence number heard (bounded like the sources).
        self._heard: dict[bytes, int] = {}
        self.stats = PeerStats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._transport: asyncio.DatagramTransport | None = None
        self._closed: asyncio.Event | None = None  # set once the socket is closed
        self._targets: set[tuple[str, int]] = set()
        self._allowed: set[str] = set()
        # Per configured address, what it last resolved to: a failed lookup keeps it.
        self._resolved: dict[str, set[tuple[str, int]]] = {}
        self._pending: list[Record] = []
        # Endpoints whose load changed since the last flush, and what each peer was last
        # told (non-zero only: those are refreshed); endpoints whose load went to zero, with
        # the refreshes left that repeat the zero (a lost one would count for `LOAD_TTL`).
        self._load_dirty: dict[tuple[str, str], EndpointState] = {}
        self._load_told: dict[tuple[str, str], tuple[int, float]] = {}
        self._load_zeroed: dict[tuple[str, str], int] = {}
        self.remote = RemoteLoad()
        # The id each peer address last sent with: a new one there is that replica
        # restarted (a crash says no goodbye), so its old self's load is dropped at once,
        # not counted beside the new one's until the ttl; and the ids it had before, whose
        # late (reordered) datagrams are dropped rather than undo that (`stale_sender`).
        # With the id, when it was last heard (registry clock).
        self._sender_at: dict[tuple[str, int], tuple[bytes, float]] = {}
        self._retired: dict[tuple[str, int], list[bytes]] = {}
        self._keeper: asyncio.Task[None] | None = None
        self._flush_scheduled = False
        self._applying = False
        self._resolver: asyncio.Task[None] | None = None
        # Set by a datagram from a peer not known yet: look again now (made in `start`, on
        # the loop that waits on it).
        self._wake: asyncio.Event | None = None
        self._family = socket.AF_INET
        self.port = 0  # bound port (the configured one, or the kernel's for port 0)

    async def start(self) -> None:
        """Bind and resolve; raises StartError when the port cannot be bound (nothing left
        open then)."""
        self._loop = loop = asyncio.get_running_loop()
        self._closed = asyncio.Event()
        self._wake = asyncio.Event()
        host, port = split_address(self.spec.listen)
        self._family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            transport, _ = await loop.create_datagram_endpoint(
                lambda: self, local_addr=(host, port), family=self._family
            )
        except OSError as exc:
            raise StartError(f"peers.listen {self.spec.listen}: cannot bind: {exc}") from exc
        self._transport = transport
        try:
            self.port = transport.get_extra_info("sockname")[1]
            if self.siblings is not None:
                try:
                    self._registration().touch()  # the name says it all: <pid>-<port>
                except OSError as exc:
                    raise StartError(f"worker group {self.siblings}: {exc}") from exc
            await self.resolve()
            self.attach()
        except BaseException:
            self._transport = None
            transport.close()
            raise
        self._resolver = asyncio.create_task(self._resolve_forever())
        self._keeper = asyncio.create_task(self._keep_load_forever())
        self._hello()

    def _hello(self) -> None:
        """An empty datagram to every peer known now: one that started earlier and does not
        know this replica yet looks its peers up again at once, instead of at its next
        `resolve_interval` (inserts sent to nobody are lost)."""
        transport = self._transport
        if transport is None:
            return
        datagram = _HEADER.pack(MAGIC, self.sender, next(self._seq), 0)
        if self._key is not None:
            datagram = seal(datagram, self._key)
        for target in self._targets:
            with contextlib.suppress(OSError):
                transport.sendto(datagram, target)

    async def stop(self) -> None:
        for task in (self._resolver, self._keeper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._resolver = self._keeper = None
        self.detach()
        # Goodbye: the peers stop counting this replica's load now, not `LOAD_TTL` later.
        self._send_load([(m, e, 0, 0.0) for (m, e) in self._load_told])
        self._load_told.clear()
        self._load_zeroed.clear()
        self.remote.clear(self._scheduler().registry)
        if self.siblings is not None:
            self._registration().unlink(missing_ok=True)
        if self._transport is not None:
            self._transport.close()
            self._transport = None
            if self._closed is not None:  # asyncio closes the socket a loop turn later
                await self._closed.wait()

    def attach(self) -> None:
        """Hook every prefix index of the current scheduler, and its registry's load changes
        (again after a reload)."""
        scheduler = self._scheduler()
        for model, index in indexes(scheduler):
            index.on_insert = self._sender(model, index.block_chars)
        scheduler.registry.on_load = self._load_changed

    def detach(self) -> None:
        scheduler = self._scheduler()
        for _, index in indexes(scheduler):
            index.on_insert = None
        scheduler.registry.on_load = None

    def _load_changed(self, model: str, state: EndpointState) -> None:
        # Marked even with no peers known: what each would be told stays true (`_load_told`)
        # for when they are.
        if self._loop is not None and self._transport is not None:
            self._on_loop(self._loop, self._mark, model, state)

    @staticmethod
    def _on_loop(loop: asyncio.AbstractEventLoop, call: Callable[..., None], *args: Any) -> None:
        """`call(*args)` now on the loop's thread, else handed to the loop (a pick in a
        worker thread)."""
        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:  # no loop in this thread
            here = False
        if here:
            call(*args)
        else:
            loop.call_soon_threadsafe(call, *args)

    def _mark(self, model: str, state: EndpointState) -> None:
        self._load_dirty[(model, state.id)] = state
        self._schedule_flush()

    def _sender(self, model: str, block_chars: int) -> Callable[[str, list[int], str | None], None]:
        def told(endpoint: str, hashes: list[int], key: str | None) -> None:
            loop = self._loop
            if self._applying or loop is None or self._transport is None or not self._targets:
                return
            self._on_loop(loop, self._enqueue, (model, endpoint, key, block_chars, hashes))

        return told

    def _enqueue(self, record: Record) -> None:
        if len(self._pending) >= MAX_PENDING:  # the loop is not getting to its flushes
            self.stats.drop("overflow")
            return
        self._pending.append(record)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled and self._loop is not None:
            self._loop.call_soon(self._flush)
            self._flush_scheduled = True

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._load_dirty:
            dirty, self._load_dirty = self._load_dirty, {}
            told = self._load_told
            changed: list[LoadRecord] = []
            for key, state in dirty.items():
                load = own_load(state)
                if told.get(key, (0, 0.0)) != load:
                    changed.append((key[0], key[1], *load))
                    if load[0] or load[1]:
                        told[key] = load
                        self._load_zeroed.pop(key, None)
                    else:
                        told.pop(key, None)
                        self._load_zeroed[key] = max(1, math.ceil(LOAD_TTL / LOAD_REFRESH))
            self._send_load(changed)
        records, self._pending = self._pending, []
        if records and self._send(encode, records):
            self.stats.sent += len(records)

    def _send_load(self, records: list[LoadRecord]) -> None:
        if records and self._send(encode_load, records):
            self.stats.load_sent += len(records)

    def _send(
        self,
        encoder: Callable[[bytes, Sequence[Any], int, Iterator[int]], list[bytes]],
        records: Sequence[Any],
    ) -> bool:
        """Send `records` to every peer; False if they were dropped (or no peer is known)."""
        transport = self._transport
        if transport is None or not self._targets:
            return False
        # Selector transports buffer what the kernel refuses, without limit (not in the
        # DatagramTransport interface, hence the lookup).
        buffered = getattr(transport, "get_write_buffer_size", None)
        if buffered is not None and buffered() > MAX_BUFFERED:
            self.stats.drop("send_buffer_full", len(records))
            return False
        key = self._key
        limit = MAX_DATAGRAM - TAG if key is not None else MAX_DATAGRAM
        for datagram in encoder(self.sender, records, limit, self._seq):
            if key is not None:
                datagram = seal(datagram, key)  # noqa: PLW2901
            for target in self._targets:
                try:
                    transport.sendto(datagram, target)
                except OSError:
                    self.stats.drop("send_error")
        return True

    async def _keep_load_forever(self) -> None:
        """Refresh this replica's load at the peers every `LOAD_REFRESH` (non-zero, and
        zeros for `LOAD_TTL` after the load went to zero) and forget theirs gone quiet,
        looked for every `LOAD_EXPIRY_CHECK`."""
        step = min(LOAD_EXPIRY_CHECK, LOAD_REFRESH)
        every = max(1, round(LOAD_REFRESH / step))  # checks per refresh
        for check in itertools.count(1):
            await asyncio.sleep(step)
            try:
                registry = self._scheduler().registry
                self.remote.expire(registry, registry.clock())
            except Exception:  # never let either die: log and go on
                log.exception("forgetting the peers' quiet load failed")
            if check % every:
                continue
            try:
                told = self._load_told
                updates = [(m, e, n, t) for (m, e), (n, t) in told.items()]
                zeroed = self._load_zeroed
                for key, left in list(zeroed.items()):
                    updates.append((key[0], key[1], 0, 0.0))
                    if left > 1:
                        zeroed[key] = left - 1
                    else:
                        del zeroed[key]
                self._send_load(updates)
            except Exception:
                log.exception("refreshing this replica's load at the peers failed")

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._closed is not None:
            self._closed.set()

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        ip = str(addr[0])
        try:
            body = unseal(data, self._key) if self._key is not None else data
        except Unauthenticated:  # checked first: a stranger without the key wakes nothing
            self.stats.drop("unauthenticated")
            return
        if ip not in self._allowed:
            self.stats.drop("unknown_sender")
            self._wake_resolver()  # perhaps a replica that just started (bounded rate)
            return
        try:
            records: list[Record] = []
            loads: list[LoadRecord] = []
            if body[:4] == LOAD_MAGIC:
                sender, seq, loads = decode_load(body)
            else:
                sender, seq, records = decode(body)
        except ValueError:
            self.stats.drop("malformed")
            return
        if sender == self.sender:
            return
        heard = self._heard.get(sender)
        if heard is not None and seq <= heard:  # a replay, or one overtaken (UDP reorders)
            self.stats.drop("replayed")
            return
        if heard is None and len(self._heard) >= _MAX_SOURCES:
            self._heard.clear()
        self._heard[sender] = seq
        source = (ip, int(addr[1]))
        if source not in self._targets:  # a peer this one does not send to yet
            self._wake_resolver()
        scheduler = self._scheduler()
        now = scheduler.registry.clock()
        before, heard_at = self._sender_at.get(source, (None, now))
        if before != sender:
            retired = self._retired.get(source, [])
            was = sender in retired
            # An id older than the one that replaced it or than the current one (started
            # before it: a restart's datagrams reordered, the old process's last one after
            # the new one's first) is stale, unless the current one has gone quiet past the
            # load TTL while this one talks (a clock that stepped back at the restart).
            stale = was or (before is not None and sender < before)
            if stale and now - heard_at <= LOAD_TTL:
                self.stats.drop("stale_sender")
                return
            if was:
                retired.remove(sender)
            if before is not None:
                self.remote.forget(scheduler.registry, before)
                retired = self._retired.setdefault(source, [])
                retired.append(before)
                del retired[:-_RETIRED_KEPT]
            elif len(self._sender_at) >= _MAX_SOURCES:  # bounded; only peers' ips get here
                self._sender_at.clear()
                self._retired.clear()
        self._sender_at[source] = (sender, now)
        if loads:
            registry = scheduler.registry
            for load in loads:
                if self.remote.update(registry, sender, load, now):
                    self.stats.load_received += 1
                else:
                    self.stats.drop("unknown_endpoint")
            return
        self._applying = True
        try:
            for record in records:
                refused = apply(scheduler, record, now)
                if refused is None:
                    self.stats.received += 1
                else:
                    self.stats.drop(refused)
        finally:
            self._applying = False

    def _wake_resolver(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def error_received(self, exc: Exception) -> None:  # ICMP unreachable: a peer not up yet
        self.stats.drop("send_error")

    async def resolve(self) -> None:
        """Resolve every peer address now (all of a name's addresses); an address whose
        lookup fails keeps what it last resolved to (one DNS hiccup must not cut a replica
        off from its peers)."""
        if self.siblings is not None:
            # Registered again at each look: a /tmp cleaner (systemd-tmpfiles' 10 days)
            # deletes files it sees untouched, and the workers silently stopped peering.
            with contextlib.suppress(OSError):
                self.siblings.mkdir(parents=True, exist_ok=True)
                self._registration().touch()
            self._resolved = {"siblings": _sibling_ports(self.siblings)}
        loop = asyncio.get_running_loop()
        # An IPv6 socket (`[::]`) is dual-stack: IPv4 peers are reached, and heard from, at
        # their v4-mapped addresses (an AF_INET6 lookup of an IPv4-only name finds nothing).
        flags = socket.AI_V4MAPPED if self._family == socket.AF_INET6 else 0
        for address in self.spec.addresses:
            host, port = split_address(address)
            try:
                infos = await loop.getaddrinfo(
                    host, port, family=self._family, type=socket.SOCK_DGRAM, flags=flags
                )
            except (OSError, UnicodeError) as exc:  # UnicodeError: a label IDNA refuses
                log.warning("peer address %s does not resolve: %s", address, exc)
                continue
            self._resolved[address] = {(str(i[4][0]), int(i[4][1])) for i in infos}
        targets = set().union(*self._resolved.values())
        me = {(ip, self.port) for ip, _ in targets if self._is_local(ip)}
        self._targets = targets - me
        self._allowed = {ip for ip, _ in targets}
        self.stats.peers = len(self._targets)

    def _registration(self) -> Path:
        assert self.siblings is not None
        return self.siblings / f"{os.getpid()}-{self.port}.port"

    def _is_local(self, ip: str) -> bool:
        """This replica's own address. Listening on the wildcard, every loopback address
        is (no other replica can hold the port there); on 127.0.0.1, only that one: a
        replica on 127.0.0.2 and the same port is a peer (it went unsent to)."""
        host, _ = split_address(self.spec.listen)
        return ip == host or (ip.startswith("127.") and host == "0.0.0.0")

    async def _resolve_forever(self) -> None:
        # Woken early by a datagram from an unknown peer, at most once per `floor` seconds
        # (a directory read for sibling workers; DNS otherwise, so a stranger's datagrams
        # cannot make it query more than once a second).
        floor = 0.1 if self.siblings is not None else 1.0
        wake = self._wake
        assert wake is not None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), self.spec.resolve_interval)
            wake.clear()
            try:
                await self.resolve()
            except Exception:  # never let the lookups die: log and try again next time
                log.exception("resolving the peers failed")
            await asyncio.sleep(floor)
