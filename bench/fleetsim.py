"""In-process fleet simulation: the real llmgw core in front of N simulated engines,
in virtual time (a heap of events; no sockets, no asyncio, no sleeps).

    prepared = prepare(workload, engine_configs)           # prompts, block hashes, RequestInfo
    result = simulate(prepared, make_contender("chat"), seed=1)
    result.row()                                            # TTFT p50/p90/p99, hit rate...

What is real and what is modelled:
- Engines: `llmgw.sim.model.EngineModel` (continuous batching, prefix cache, LRU eviction),
  one per replica with its own `EngineConfig`, stepped as `llmgw/sim/driver.py` does:
  `duration = schedule(now)`, then `complete(now + duration)`; an idle engine wakes on
  submit (after every other event of the same instant, as the driver's task runs after
  the requests that woke it). Requests are built from the chat messages exactly as the
  simulator's HTTP replica builds them (`chat_prompt`, `count_tokens`, `block_hashes`).
- Router: `Scheduler.pick` / `acquire` / `Lease.finish` of a `Scheduler` built from a
  `Config`, on a `Registry` whose clock is the virtual clock. `RequestInfo` comes from
  `llmgw.request.build_request` on the JSON body the load client sends, so it is what
  both edges would build. Scrapes render each replica's Prometheus page with the
  simulator's own metrics code and feed it through `Scraper.ingest`, the runtime
  scraper's parse path (every `scrape_interval` ± jitter, per replica).
- Client: `bench/loadclient.py`'s open loop: a conversation starts at `start_s`, turn k+1
  is sent when turn k's response ended plus the turn's think time, errors included.
  TTFT = first token - send time (no network, no SSE framing).
- Reference policies (consistent hash, round robin, least requests, sglang cache_aware)
  are plain functions of router-local state; they see no scrape.
- KV-cache events (contenders that use them, e.g. `llmgw:latency-exact`): the engines
  record vLLM's events as they cache and evict blocks; each step's events are encoded
  as vLLM's wire payload (msgpack `[ts, [events]]`, a sequence number per engine),
  delivered `kv_event_lag` seconds later and decoded by `llmgw.kvevents`, the
  subscriber's own decode path, into the registry's exact index.
"""

from __future__ import annotations

import copy
import heapq
import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import msgpack
import orjson

from bench.workloads import Workload, percentile
from llmgw.config import Config, load_dict
from llmgw.errors import LlmgwError
from llmgw.hashring import HashRing
from llmgw.kvevents import decode_batch
from llmgw.registry import EndpointState, Registry, own_load
from llmgw.request import build_request
from llmgw.runtime.peers import RemoteLoad
from llmgw.runtime.peers import apply as apply_peer
from llmgw.runtime.peers import indexes as peer_indexes
from llmgw.runtime.scraper import Scraper
from llmgw.scheduling.scheduler import Lease, Scheduler
from llmgw.scheduling.scorers import LatencyScorer
from llmgw.scheduling.strategies import PRESETS
from llmgw.sim.metrics import ModelObservations, ServedModel, make_registry, render
from llmgw.sim.model import (
    EngineConfig,
    EngineModel,
    QueueFullError,
    RequestTooLargeError,
    SeqRequest,
)
from llmgw.sim.tokens import block_hashes, chat_prompt, count_tokens, token_ids
from llmgw.types import Decision, Outcome, RequestInfo

MODEL = "m1"
SESSION_HEADER = "x-session-id"
_TREE_CHARS = 16  # granularity of the sglang reference's prefix tree


def address(index: int) -> str:
    return f"10.0.0.{index + 1}:8000"


# -- prepared requests (shared by every contender of a cell) ------------------------------


@dataclass(slots=True)
class Prepared:
    """One (conversation, turn): what the router sees and what the engine is given."""

    info: RequestInfo
    seq: SeqRequest
    _chain: list[int] | None = None

    def chain(self) -> list[int]:
        """Chained hashes of the router-side prompt in 16-char chunks (sglang tree)."""
        if self._chain is None:
            text, h, out = self.info.prompt, 0, []
            for i in range(0, len(text) - _TREE_CHARS + 1, _TREE_CHARS):
                h = hash((h, text[i : i + _TREE_CHARS]))
                out.append(h)
            self._chain = out
        return self._chain


@dataclass
class PreparedWorkload:
    workload: Workload
    engines: tuple[EngineConfig, ...]
    requests: list[list[Prepared]]  # [conversation][turn]

    @property
    def total(self) -> int:
        return sum(len(turns) for turns in self.requests)


def router_config(
    n: int, strategy: str | dict[str, Any] = "chat", scrape_interval: float = 0.05, seed: int = 1
) -> Config:
    return load_dict(
        {
            "models": {
                MODEL: {
                    "engine": "vllm",
                    "endpoints": [address(i) for i in range(n)],
                    "strategy": strategy,
                }
            },
            "scrape": {"interval": scrape_interval},
            "seed": seed,
        }
    )


def prepare(
    workload: Workload, engines: Sequence[EngineConfig], chars_per_token: float = 4.0
) -> PreparedWorkload:
    """Build every request once: the JSON body -> RequestInfo (the edges' code) and the
    engine's SeqRequest (the HTTP replica's code). The block size must be the same.
    `chars_per_token`: how the engines' tokenizer counts (the router estimates chars / 4)."""
    sizes = {e.block_size for e in engines}
    if len(sizes) != 1:
        raise ValueError("every engine of a fleet must use one block size")
    block_size = sizes.pop()
    caching = all(e.enable_prefix_caching for e in engines)
    config = router_config(len(engines))
    requests: list[list[Prepared]] = []
    for conv in workload.conversations:
        turns: list[Prepared] = []
        for k, turn in enumerate(conv.turns):
            messages = conv.messages(k)
            body = orjson.dumps(
                {
                    "model": MODEL,
                    "messages": messages,
                    "max_tokens": turn.max_tokens,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            )
            headers = {"content-type": "application/json"}
            if conv.session_id is not None:
                headers[SESSION_HEADER] = conv.session_id
            info = build_request(
                config, headers, "/v1/chat/completions", body, request_id=f"c{conv.index}-t{k}"
            )
            prompt = chat_prompt(messages)  # type: ignore[arg-type]
            hashes = block_hashes(prompt, block_size, chars_per_token) if caching else ()
            tokens = count_tokens(prompt, chars_per_token)
            turns.append(Prepared(info, SeqRequest(tokens, turn.max_tokens, hashes)))
        requests.append(turns)
    return PreparedWorkload(workload, tuple(engines), requests)


# -- contenders ---------------------------------------------------------------------------


class RouteError(Exception):
    """The router refused the request (an llmgw error: 429 shed, 503...)."""


class Contender(Protocol):
    name: str
    uses_registry: bool

    def bind(self, n: int, registry: Registry | None, seed: int) -> None: ...

    def route(self, p: Prepared) -> tuple[int, Lease | None]: ...

    def done(self, index: int) -> None: ...


class LlmgwContender:
    """The real Scheduler with a strategy (preset name or strategy dict).

    `routers` > 1: that many router replicas (a Scheduler each, own prefix index) behind a
    plain load balancer that picks one per request at random; they share the Registry
    (load, scrapes: optimistic for all alike) and, with KV events, the exact index (each
    router subscribes to the same engines). `split`: each router has its own Registry, as
    deployed (each scrapes the engines and counts only its own requests in flight);
    `shared` shares their prefix-index inserts and `share_load` their load (`peers:`).

    `engine_kv_model=False`: the latency scorer's approximate index ignores each engine's
    KV size (`cache_config_info`) and keeps up to its default capacity per endpoint: an
    index that believes every block it routed is still cached (llm-d's "approximate")."""

    uses_registry = True

    def __init__(
        self,
        name: str,
        strategy: str | dict[str, Any],
        scrape_interval: float = 0.05,
        first_tokens: bool = True,
        routers: int = 1,
        engine_kv_model: bool = True,
        shared: bool = False,
        split: bool = False,
        share_load: bool = False,
    ) -> None:
        self.name = name
        self.strategy = strategy
        self.routers = routers
        self.shared = shared
        self.split = split
        self.share_load = share_load
        self.registries: list[Registry] = []
        self.engine_kv_model = engine_kv_model
        self.schedulers: list[Scheduler] = []
        # A scorer with a tokenizer matches on the engines' KV events: feed them.
        self.uses_kv_events = isinstance(strategy, dict) and any(
            isinstance(spec, dict) and (spec.get("params") or {}).get("tokenizer")
            for spec in strategy.get("scorers", {}).values()
        )
        self.scrape_interval = scrape_interval
        # False stands for Envoy with `response_body_mode: NONE`: the edge never hears first
        # tokens, so the router drains its own queue estimate with time.
        self.first_tokens = first_tokens
        self.scheduler: Scheduler | None = None
        self.last_decision: Decision | None = None  # the last pick's (for probes)
        self._index: dict[str, int] = {}

    def bind(self, n: int, registry: Registry | None, seed: int) -> None:
        config = router_config(n, self.strategy, self.scrape_interval, seed)
        self.config = config
        if self.split and registry is not None:
            extra = [Registry(clock=registry.clock) for _ in range(self.routers - 1)]
            self.registries = [registry, *extra]
        registries: list[Registry | None] = [*self.registries] or [registry] * self.routers
        self.schedulers = [
            Scheduler(config, registries[k], seed=seed + k) for k in range(self.routers)
        ]
        self.scheduler = self.schedulers[0]
        if self.shared:
            share_indexes(self.schedulers)
        if self.share_load:
            share_load([s.registry for s in self.schedulers])
        if not self.engine_kv_model:
            for scheduler in self.schedulers:
                for scorer, _ in scheduler.router(MODEL).scorers:
                    if isinstance(scorer, LatencyScorer):
                        # The index's per-endpoint capacity stays its default (16,384 blocks).
                        scorer.kv_sized = False
        self._balancer = random.Random(seed * 31 + 7)
        self._index = {address(i): i for i in range(n)}

    def route(self, p: Prepared) -> tuple[int, Lease | None]:
        assert self.scheduler is not None
        scheduler = self.scheduler
        if self.routers > 1:
            scheduler = self.schedulers[self._balancer.randrange(self.routers)]
        try:
            decision = scheduler.pick(p.info)
        except LlmgwError as exc:
            raise RouteError(f"{exc.status} {exc.code}") from None
        lease = scheduler.acquire(decision)
        self.last_decision = decision
        return self._index[decision.endpoint.address], lease

    def done(self, index: int) -> None:
        pass

    def index_of(self, endpoint_id: str) -> int:
        """The replica an endpoint id (its address) stands for."""
        return self._index[endpoint_id]


def share_indexes(schedulers: list[Scheduler]) -> None:
    """Each router's prefix-index inserts applied to the others' at once: `peers:`
    (llmgw/runtime/peers.py) over a network with no delay or loss."""
    applying = [False]
    for k, scheduler in enumerate(schedulers):
        others = schedulers[:k] + schedulers[k + 1 :]
        for model, index in peer_indexes(scheduler):

            def told(
                endpoint: str,
                hashes: list[int],
                key: str | None,
                model: str = model,
                chars: int = index.block_chars,
                others: list[Scheduler] = others,
            ) -> None:
                if applying[0]:
                    return
                applying[0] = True
                try:
                    for other in others:
                        apply_peer(
                            other, (model, endpoint, key, chars, hashes), other.registry.clock()
                        )
                finally:
                    applying[0] = False

            index.on_insert = told


def share_load(registries: list[Registry]) -> None:
    """Each router's load (in flight, prefill queued; `registry.own_load`) counted by the
    others at once: `peers:` load sharing over a network with no delay or loss."""
    remotes = [RemoteLoad() for _ in registries]
    for k, registry in enumerate(registries):
        sender = bytes([k])
        others = [(r, remotes[j]) for j, r in enumerate(registries) if j != k]

        def told(
            model: str,
            state: EndpointState,
            sender: bytes = sender,
            others: list[tuple[Registry, RemoteLoad]] = others,
        ) -> None:
            inflight, pending = own_load(state)
            for other, remote in others:
                remote.update(other, sender, (model, state.id, inflight, pending), 0.0)

        registry.on_load = told


class _Local:
    """Base of the reference policies: router-local in-flight counts, no scrapes."""

    uses_registry = False
    name = "local"

    def bind(self, n: int, registry: Registry | None, seed: int) -> None:
        self.n = n
        self.inflight = [0] * n
        self.rng = random.Random(seed)

    def pick(self, p: Prepared) -> int:
        raise NotImplementedError

    def route(self, p: Prepared) -> tuple[int, Lease | None]:
        i = self.pick(p)
        self.inflight[i] += 1
        return i, None

    def done(self, index: int) -> None:
        self.inflight[index] -= 1


class ConsistentHash(_Local):
    """Client-side consistent hashing: Ray's ring on the session id (request id without
    one), no fallback, no load awareness."""

    name = "consistent-hash"

    def bind(self, n: int, registry: Registry | None, seed: int) -> None:
        super().bind(n, registry, seed)
        self.ring = HashRing([address(i) for i in range(n)], num_fallback_replicas=0)
        self.by_address = {address(i): i for i in range(n)}

    def pick(self, p: Prepared) -> int:
        return self.by_address[self.ring.candidates(p.info.routing_key)[0]]


class RoundRobin(_Local):
    """Plain rotation."""

    name = "round-robin"

    def bind(self, n: int, registry: Registry | None, seed: int) -> None:
        super().bind(n, registry, seed)
        self.next = 0

    def pick(self, p: Prepared) -> int:
        i = self.next
        self.next = (i + 1) % self.n
        return i


class LeastRequests(_Local):
    """Fewest requests in flight from this router; ties broken by a seeded draw."""

    name = "least-requests"

    def pick(self, p: Prepared) -> int:
        low = min(self.inflight)
        ties = [i for i, v in enumerate(self.inflight) if v == low]
        return ties[0] if len(ties) == 1 else self.rng.choice(ties)


class SglangCacheAware(_Local):
    """Approximation of sglang-router's `cache_aware` policy (sgl-router
    src/policies/cache_aware.rs), with the defaults its CLI / RouterConfig ship
    (cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5; the Rust
    library's `CacheAwareConfig::default()` says 0.5 / 32 / 1.1 — pass them to compare).

    Imbalanced (max - min in flight > abs AND max > rel * min): least loaded. Else the
    worker whose tree matches the longest prefix of the request text if the match ratio
    is > cache_threshold, else the worker with the smallest tree; the text is inserted in
    the chosen worker's tree either way. Simplified: the per-worker tree is a set of
    chained hashes of 16-character chunks (prefix matches are 16-char granular, not
    char-exact); no LRU eviction (sglang's default max_tree_size, 67M chars, is never
    reached in these runs); where several workers hold the longest match, sglang takes the
    first tenant of the tree node (a hash-map order: arbitrary but stable), here the lowest
    index. With a shared system prompt longer than `cache_threshold` of the first turn,
    every new conversation therefore lands on the worker that saw the prompt first until
    the in-flight imbalance passes the thresholds: that is sglang's behaviour too.
    """

    name = "sglang-cache-aware"

    def __init__(
        self, cache_threshold: float = 0.3, abs_threshold: int = 64, rel_threshold: float = 1.5
    ) -> None:
        self.cache_threshold = cache_threshold
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold

    def bind(self, n: int, registry: Registry | None, seed: int) -> None:
        super().bind(n, registry, seed)
        self.trees: list[set[int]] = [set() for _ in range(n)]

    def _matched(self, tree: set[int], chain: list[int]) -> int:
        lo, hi = 0, len(chain)  # trees are prefix-closed: binary search the longest match
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if chain[mid - 1] in tree:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def pick(self, p: Prepared) -> int:
        chain = p.chain()
        loads = self.inflight
        high, low = max(loads), min(loads)
        if high - low > self.abs_threshold and high > low * self.rel_threshold:
            choice = loads.index(low)
        else:
            matched = [self._matched(t, chain) for t in self.trees]
            best = max(range(self.n), key=lambda i: matched[i])
            text_len = len(p.info.prompt)
            ratio = matched[best] * _TREE_CHARS / text_len if text_len else 0.0
            if ratio > self.cache_threshold:
                choice = best
            else:
                sizes = [len(t) for t in self.trees]
                choice = sizes.index(min(sizes))
        self.trees[choice].update(chain)
        return choice


class SglangCacheAwareLib(SglangCacheAware):
    """`SglangCacheAware` with the Rust library's `CacheAwareConfig::default()` values."""

    name = "sglang-cache-aware-lib"

    def __init__(self) -> None:
        super().__init__(cache_threshold=0.5, abs_threshold=32, rel_threshold=1.1)


class GreedyOracle(_Local):
    """Not a router: a reference with perfect information. For each request it copies
    every engine as it is at that instant (queue, batch, the step in progress, the KV
    cache), runs each copy forward until the request's first token, with no later arrivals,
    and picks the soonest (ties to the lowest index). No router sees that much: it measures
    how close a router's predictions come to greedy routing on the true times. Greedy is
    not optimal: it does not price what a pick costs the requests after it.

    `blind`: it does not know how far the step in progress has got (no router does: a
    step lasts tens of ms, a scrape is older) and takes it as half done."""

    name = "oracle-greedy"

    def __init__(self, blind: bool = False) -> None:
        self.blind = blind
        self.name = "oracle-greedy-blind" if blind else "oracle-greedy"

    def watch(
        self, engines: list[EngineModel], steps: list[list[float]], clock: Callable[[], float]
    ) -> None:
        """`steps[i]`: [start, end] of engine i's last step (in progress while `in_step`)."""
        self.engines, self.steps, self.clock = engines, steps, clock

    def forecasts(self, request: SeqRequest) -> list[float]:
        """The request's time to first token on each engine, sent now (inf: refused)."""
        now = self.clock()
        out = []
        for engine, (start, end) in zip(self.engines, self.steps, strict=True):
            step_end = now + (end - start) / 2 if self.blind else end
            out.append(self.first_token(engine, step_end, request, now) - now)
        return out

    def pick(self, p: Prepared) -> int:
        ttft = self.forecasts(p.seq)
        return min(range(len(ttft)), key=ttft.__getitem__)  # the first of equals

    @staticmethod
    def first_token(engine: EngineModel, step_end: float, request: SeqRequest, now: float) -> float:
        """When `request`, sent to `engine` at `now` and nothing after it, gets its first
        token (`step_end`: when the step in progress ends); the engine is not changed."""
        fork = copy.deepcopy(engine)
        try:
            seq = fork.submit(request, now)
        except (QueueFullError, RequestTooLargeError):
            return math.inf
        at = now
        if fork.in_step:  # the step in progress ends first
            at = step_end
            fork.complete(at)
        while seq.first_token_time is None:
            at += fork.schedule(at)
            fork.complete(at)
        return at


ORACLES: dict[str, Callable[[], Contender]] = {
    "oracle-greedy": GreedyOracle,
    "oracle-greedy-blind": lambda: GreedyOracle(blind=True),
}


REFERENCES: dict[str, Callable[[], Contender]] = {
    "consistent-hash": ConsistentHash,
    "round-robin": RoundRobin,
    "least-requests": LeastRequests,
    "sglang-cache-aware": SglangCacheAware,
    "sglang-cache-aware-lib": SglangCacheAwareLib,
}


# The latency preset matching exactly on the engines' KV events (the simulator's token ids).
LATENCY_EXACT: dict[str, Any] = {
    "name": "latency-exact",
    "scorers": {
        "latency": {"weight": 1.0, "params": {"tokenizer": "sim"}},
    },
    "filters": ["healthy", "model-serves"],
}
BUILTIN: dict[str, dict[str, Any]] = {"llmgw:latency-exact": LATENCY_EXACT}
# The approximate index without each engine's KV size (`LlmgwContender.engine_kv_model`).
NO_KV_MODEL: dict[str, str] = {"llmgw:latency-nokvsize": "latency"}
# Two router replicas behind a random load balancer (`LlmgwContender.routers`).
TWO_ROUTERS: dict[str, str | dict[str, Any]] = {
    "llmgw:latency-2routers": "latency",
    "llmgw:latency-exact-2routers": LATENCY_EXACT,
}
# The same two routers sharing what they route (`peers:`).
SHARED_ROUTERS: dict[str, str | dict[str, Any]] = {"llmgw:latency-2routers-peers": "latency"}
# Two routers as deployed: each its own registry (its own scrapes and in-flight counts);
# alone, sharing inserts only (`peers:` until session 38), and inserts and load.
SPLIT_ROUTERS: dict[str, tuple[bool, bool]] = {
    "llmgw:latency-2routers-split": (False, False),
    "llmgw:latency-2routers-split-inserts": (True, False),
    "llmgw:latency-2routers-split-peers": (True, True),
}


def contender_names() -> list[str]:
    """Every llmgw preset (as `llmgw:<name>`), built-in variants, then the references."""
    builtin = [*BUILTIN, *NO_KV_MODEL, *TWO_ROUTERS, *SHARED_ROUTERS, *SPLIT_ROUTERS]
    return [f"llmgw:{name}" for name in PRESETS] + builtin + list(REFERENCES)


def make_contender(
    name: str,
    scrape_interval: float = 0.05,
    custom: dict[str, dict[str, Any]] | None = None,
) -> Contender:
    """`llmgw:<preset>`, a reference name, or a name from `custom` (strategy dicts); an
    llmgw name ending in `@envoy` runs without the first-token signal."""
    base, _, edge = name.partition("@")
    if edge == "envoy":
        contender = make_contender(base, scrape_interval, custom)
        if isinstance(contender, LlmgwContender):
            return LlmgwContender(name, contender.strategy, scrape_interval, first_tokens=False)
        raise ValueError(f"{name!r}: only llmgw contenders have an envoy variant")
    if custom and name in custom:
        return LlmgwContender(name, custom[name], scrape_interval)
    if name in BUILTIN:
        return LlmgwContender(name, BUILTIN[name], scrape_interval)
    if name in NO_KV_MODEL:
        return LlmgwContender(name, NO_KV_MODEL[name], scrape_interval, engine_kv_model=False)
    if name in TWO_ROUTERS:
        return LlmgwContender(name, TWO_ROUTERS[name], scrape_interval, routers=2)
    if name in SHARED_ROUTERS:
        strategy = SHARED_ROUTERS[name]
        return LlmgwContender(name, strategy, scrape_interval, routers=2, shared=True)
    if name in SPLIT_ROUTERS:
        inserts, load = SPLIT_ROUTERS[name]
        return LlmgwContender(
            name, "latency", scrape_interval, routers=2, shared=inserts, split=True,
            share_load=load,
        )  # fmt: skip
    if name.startswith("llmgw:") and name[6:] in PRESETS:
        return LlmgwContender(name, name[6:], scrape_interval)
    if name in REFERENCES:
        return REFERENCES[name]()
    if name in ORACLES:
        return ORACLES[name]()
    known = ", ".join([*contender_names(), *ORACLES])
    raise ValueError(f"unknown contender {name!r}; known: {known}")


# -- the simulation -----------------------------------------------------------------------

_ARRIVAL, _WAKE, _STEP_END, _SCRAPE, _KV = 0, 1, 2, 3, 4


@dataclass
class RunResult:
    contender: str
    requests: int
    ttft_s: list[float]
    e2e_s: list[float]
    done_at: list[float]  # virtual completion times (capacity probes)
    errors: int
    error_kinds: dict[str, int]
    per_replica: list[int]
    prefix_hit_rate: float
    virtual_s: float
    finished_once: bool
    registry_inflight: list[int] = field(default_factory=list)
    scrapes: int = 0

    def row(self) -> dict[str, Any]:
        ttft = self.ttft_s
        mean = sum(self.per_replica) / len(self.per_replica) if self.per_replica else 0.0
        return {
            "contender": self.contender,
            "requests": self.requests,
            "ttft_p50_ms": _ms(percentile(ttft, 50)),
            "ttft_p90_ms": _ms(percentile(ttft, 90)),
            "ttft_p99_ms": _ms(percentile(ttft, 99)),
            "e2e_p90_ms": _ms(percentile(self.e2e_s, 90)),
            "hit_rate": round(self.prefix_hit_rate, 3),
            "max_mean": round(max(self.per_replica) / mean, 2) if mean else None,
            "errors": self.errors,
        }


def _ms(value: float) -> float | None:
    return None if math.isnan(value) else round(value * 1e3, 1)


@dataclass(slots=True)
class _Flight:
    conv: int
    turn: int
    sent: float
    engine: int
    lease: Lease | None
    first_seen: bool = False


# What a minimal engine simulator publishes: load and cache-use gauges, no histograms,
# no token counters, no cache config (the router's calibration falls back to its params).
GAUGES_ONLY = frozenset(
    {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
)
# ... plus token and request counters, no histograms (what SGLang publishes, in vLLM's names).
COUNTERS_ONLY = GAUGES_ONLY | {
    "vllm:prompt_tokens",
    "vllm:prefix_cache_hits",
    "vllm:request_success",
}
# ... plus the latency histograms most vLLM look-alikes publish (time to first token, time
# between tokens, end to end), none of the ones that split a request's time (queue,
# prefill, inference).
TTFT_ONLY = COUNTERS_ONLY | {
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
}


class AllBut(frozenset[str]):
    """Metric families as an exclusion: every family the simulator publishes but these,
    so a family it adds later is published too (`only` keeps what is not listed)."""


# Everything the simulator publishes but its KV size (`vllm:cache_config_info`): an engine
# whose cache capacity a router can only infer from what the cache does.
ALL_BUT_KV_SIZE = AllBut({"vllm:cache_config_info"})


def only(page: str, families: frozenset[str]) -> str:
    """The exposition `page` with only the samples of `families` (and their comments); with
    `AllBut` families, every sample but theirs."""
    keep_listed = not isinstance(families, AllBut)
    kept = []
    for line in page.splitlines():
        if line.startswith("#"):
            parts = line.split(maxsplit=3)
            name = parts[2] if len(parts) > 2 else ""
        else:
            name = line.split("{", 1)[0].split(" ", 1)[0]
        # Samples and a counter's comments carry a suffix the family name does not.
        for suffix in ("_bucket", "_sum", "_count", "_total", "_created"):
            if name.endswith(suffix) and name[: -len(suffix)] in families:
                name = name[: -len(suffix)]
        if (name in families) == keep_listed:
            kept.append(line)
    return "\n".join(kept) + "\n"


def simulate(
    prepared: PreparedWorkload,
    contender: Contender,
    *,
    seed: int = 1,
    scrape_interval: float = 0.05,
    scrape_jitter: float = 0.1,
    kv_event_lag: float = 0.002,
    max_events: int = 50_000_000,
    metrics: frozenset[str] | None = None,
) -> RunResult:
    """Replay the workload through `contender` onto fresh engines; deterministic.
    `metrics`: the metric families the engines publish (None: all the simulator has), to
    stand for engines that publish less (`GAUGES_ONLY`)."""
    n = len(prepared.engines)
    now = 0.0
    registry: Registry | None = None
    if contender.uses_registry:
        registry = Registry(clock=lambda: now)
    contender.bind(n, registry, seed)
    contender_first_tokens = getattr(contender, "first_tokens", True)
    # Router replicas with a registry each (`LlmgwContender.split`) scrape the engines each.
    registries: list[Registry] = getattr(contender, "registries", None) or (
        [registry] if registry is not None else []
    )
    scrapers: list[Scraper] = []
    if registry is not None:
        config = getattr(contender, "config", None) or router_config(n, seed=seed)
        for each in registries:
            each.staleness = config.scrape.staleness
            scrapers.append(Scraper(config, each))
    targets = [s.targets() for s in scrapers]

    kv_events = registry is not None and bool(getattr(contender, "uses_kv_events", False))
    engines = [
        EngineModel(replace(cfg, kv_events=True) if kv_events else cfg) for cfg in prepared.engines
    ]
    kv_seq = [0] * n
    kv_wire: dict[int, tuple[int, bytes]] = {}  # event id -> (seq, payload) in flight
    kv_ids = itertools.count()

    def publish(index: int) -> None:
        events = engines[index].drain_kv_events()
        if events:
            eid = next(kv_ids)
            kv_wire[eid] = (kv_seq[index], msgpack.packb([now, events]))
            kv_seq[index] += 1
            push(now + kv_event_lag, _KV, index, eid)

    observations = [ModelObservations(max_model_len=e.config.max_model_len) for e in engines]
    pages = [
        make_registry("vllm", [ServedModel(MODEL, engines[i], observations[i])]) for i in range(n)
    ]
    stepping = [False] * n
    steps = [[0.0, 0.0] for _ in range(n)]  # each engine's last step: [start, end]
    watch = getattr(contender, "watch", None)
    if watch is not None:  # an oracle: it reads the engines themselves
        watch(engines, steps, lambda: now)
    flights: dict[tuple[int, int], _Flight] = {}  # (engine, seq_id) -> flight
    rng = random.Random(seed * 7919 + 17)
    events: list[tuple[float, int, int, int, int]] = []
    counter = itertools.count()

    def push(t: float, kind: int, a: int, b: int = 0) -> None:
        heapq.heappush(events, (t, next(counter), kind, a, b))

    for conv in prepared.workload.conversations:
        push(conv.start_s, _ARRIVAL, conv.index, 0)
    conv_pos = {c.index: i for i, c in enumerate(prepared.workload.conversations)}
    if scrapers:
        for i in range(n):
            push(rng.uniform(0, scrape_interval), _SCRAPE, i)

    ttft: list[float] = []
    e2e: list[float] = []
    done_at: list[float] = []
    per_replica = [0] * n
    errors = 0
    error_kinds: dict[str, int] = {}
    outstanding = prepared.total
    finished: set[tuple[int, int]] = set()
    finished_once = True
    scrapes = 0

    def end_request(conv: int, turn: int) -> None:
        nonlocal outstanding, finished_once
        key = (conv, turn)
        if key in finished:
            finished_once = False
        finished.add(key)
        outstanding -= 1
        turns = prepared.workload.conversations[conv_pos[conv]].turns
        if turn + 1 < len(turns):
            push(now + turns[turn].think_s, _ARRIVAL, conv, turn + 1)

    def error(kind: str) -> None:
        nonlocal errors
        errors += 1
        error_kinds[kind] = error_kinds.get(kind, 0) + 1

    processed = 0
    while events and outstanding > 0:
        processed += 1
        if processed > max_events:
            raise RuntimeError("event budget exhausted (a stuck engine?)")
        now, _, kind, a, b = heapq.heappop(events)
        if kind == _ARRIVAL:
            p = prepared.requests[conv_pos[a]][b]
            try:
                index, lease = contender.route(p)
            except RouteError as exc:
                error(str(exc))
                end_request(a, b)
                continue
            per_replica[index] += 1
            seq_request = p.seq
            if kv_events:  # token ids only while needed (they are large)
                seq_request = replace(
                    seq_request, token_ids=token_ids(chat_prompt(p.info.raw_prompt))
                )
            try:
                seq = engines[index].submit(seq_request, now)
            except (QueueFullError, RequestTooLargeError) as exc:
                too_large = isinstance(exc, RequestTooLargeError)
                if lease is not None:
                    lease.finish(Outcome.FAILURE if too_large else Outcome.BACKPRESSURE)
                contender.done(index)
                error("400 too large" if too_large else "429 queue full")
                end_request(a, b)
                continue
            flights[(index, seq.seq_id)] = _Flight(a, b, now, index, lease)
            if not stepping[index]:
                stepping[index] = True
                push(now, _WAKE, index)
        elif kind == _WAKE:
            engine = engines[a]
            steps[a] = [now, now + engine.schedule(now)]
            push(steps[a][1], _STEP_END, a)
            if kv_events:
                publish(a)
        elif kind == _STEP_END:
            engine = engines[a]
            result = engine.complete(now)
            for seq in result.emitted:
                if seq.output_tokens == 1:
                    observations[a].first_token(seq)
                flight = flights.get((a, seq.seq_id))
                if flight is None:
                    continue
                if not flight.first_seen:
                    flight.first_seen = True
                    ttft.append(now - flight.sent)
                    if flight.lease is not None and contender_first_tokens:
                        flight.lease.first_token()
                elif flight.lease is not None and flight.lease.streaming:
                    flight.lease.token()  # a later token: the edge sees the step end
            for seq in result.finished:
                flight = flights.pop((a, seq.seq_id))
                observations[a].observe(seq)
                e2e.append(now - flight.sent)
                done_at.append(now)
                if flight.lease is not None:
                    flight.lease.end(Outcome.SUCCESS)  # as Lifecycle.finish does
                contender.done(a)
                end_request(flight.conv, flight.turn)
            if engine.has_work:
                steps[a] = [now, now + engine.schedule(now)]
                push(steps[a][1], _STEP_END, a)
            else:
                stepping[a] = False
            if kv_events:
                publish(a)
        elif kind == _KV:
            assert registry is not None
            seq_no, payload = kv_wire.pop(b)
            batch = decode_batch(seq_no, msgpack.unpackb(payload))
            for each in registries:
                each.kv_index.apply_batch(address(a), batch, now)
        elif kind == _SCRAPE and scrapers:
            addr = address(a)
            page = render(pages[a]).decode()
            page = page if metrics is None else only(page, metrics)
            for reader, known in zip(scrapers, targets, strict=True):
                reader.ingest(addr, known[addr], page)
            scrapes += 1
            spread = scrape_interval * scrape_jitter
            push(now + scrape_interval + rng.uniform(-spread, spread), _SCRAPE, a)

    hits = sum(e.stats.prefix_hits_tokens for e in engines)
    queries = sum(e.stats.prefix_queries_tokens for e in engines)
    inflight = [  # each endpoint's, summed over the routers' registries
        sum(state.inflight for each in registries if (state := each.get(MODEL, s.id)))
        for s in (registry.states(MODEL) if registry is not None else [])
    ]
    return RunResult(
        contender=contender.name,
        requests=prepared.total,
        ttft_s=ttft,
        e2e_s=e2e,
        done_at=done_at,
        errors=errors,
        error_kinds=error_kinds,
        per_replica=per_replica,
        prefix_hit_rate=hits / queries if queries else 0.0,
        virtual_s=now,
        finished_once=finished_once and len(finished) == prepared.total and not flights,
        registry_inflight=inflight,
        scrapes=scrapes,
    )
