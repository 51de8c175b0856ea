"""Scheduler.pick: filter -> score -> pick, returning a Decision that explains itself."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass

from llmgw.config import Config, ModelMode, ModelSpec, endpoints_of, model_mode
from llmgw.errors import LlmgwError, ModelNotFound
from llmgw.hashring import HashRing
from llmgw.registry import EndpointState, PendingPrefill, Registry
from llmgw.scheduling.interfaces import (
    ExplainsScores,
    Filter,
    ForgetsEndpoints,
    LearnsFromChoice,
    Picker,
    Scorer,
)
from llmgw.scheduling.picking import run_pick
from llmgw.scheduling.plugins import make_filter, make_picker, make_scorer
from llmgw.scheduling.strategies import resolve
from llmgw.types import Decision, Endpoint, Outcome, RequestInfo


class ModelRouter:
    """Per-model plugins and ring. Rebuilt when the model's endpoint set changes."""

    def __init__(self, name: str, spec: ModelSpec) -> None:
        self.name = name
        self.spec = spec
        self.mode = model_mode(spec)
        strategy = resolve(spec.strategy)
        self.strategy_name = strategy.name
        self.filters: list[Filter] = [make_filter(f) for f in strategy.filters]
        self.scorers: list[tuple[Scorer, float]] = [
            (make_scorer(n, s.params), s.weight) for n, s in strategy.scorers.items()
        ]
        # Optional capabilities, found once: only scorers that declare them are called.
        self.observers: list[LearnsFromChoice] = [
            s for s, _ in self.scorers if isinstance(s, LearnsFromChoice)
        ]
        self.forgetters: list[ForgetsEndpoints] = [
            s for s, _ in self.scorers if isinstance(s, ForgetsEndpoints)
        ]
        self.scoring = self._scoring()
        self.picker: Picker = make_picker(strategy.picker.type, strategy.picker.params)
        self.limit = 1 + spec.session.num_fallback_replicas  # the primary and its fallbacks
        self.ring = HashRing(
            [],
            num_virtual_nodes=spec.session.num_virtual_nodes,
            num_fallback_replicas=spec.session.num_fallback_replicas,
        )
        self._ring_states: list[EndpointState] | None = None
        # The ids of the last full candidate list (filters hand the list back when they
        # drop nothing): most picks reuse them instead of walking every endpoint again.
        self._ids_states: list[EndpointState] | None = None
        self._ids: tuple[str, ...] = ()
        # The registry's restart epoch as of the last pick, and each endpoint's restarts
        # as last seen here: a restarted engine's cache is empty, so the prefix indexes
        # forget it (as if it had left and come back).
        self.restart_epoch = 0
        self._restarts_seen: dict[str, int] = {}

    def shadow(self) -> ModelRouter:
        """A twin for `Scheduler.explain`: its own plugin copies (their per-pick scratch, a
        round-robin position) and ring cache, so explaining moves nothing of this router;
        prefix indexes are shared and only read (it never observes or forgets: the caller
        runs this router's restart and ring catch-up first)."""
        twin = copy.copy(self)
        twin.scorers = [(copy.copy(s), w) for s, w in self.scorers]
        twin.picker = copy.copy(self.picker)
        twin.observers, twin.forgetters = [], []
        twin._restarts_seen = dict(self._restarts_seen)  # its own: it forgets nothing
        twin.scoring = twin._scoring()
        return twin

    def _scoring(self) -> list[tuple[Scorer, float, ExplainsScores | None]]:
        """Each scorer, its weight and itself again if it explains its scores: found once,
        not looked up by id per scorer on every pick."""
        return [(s, w, s if isinstance(s, ExplainsScores) else None) for s, w in self.scorers]

    def ids_of(self, candidates: list[EndpointState]) -> tuple[str, ...]:
        if candidates is self._ids_states:
            return self._ids
        ids = tuple([s.id for s in candidates])
        if candidates is self._ring_states:  # the registry's list: stable until replaced
            self._ids_states, self._ids = candidates, ids
        return ids

    def forget_restarted(self, states: list[EndpointState], epoch: int) -> None:
        for s in states:
            if s.restarts != self._restarts_seen.get(s.id, 0):
                self._restarts_seen[s.id] = s.restarts
                for scorer in self.forgetters:
                    scorer.forget(s.id)
        self.restart_epoch = epoch

    def ring_for(self, states: list[EndpointState]) -> HashRing:
        # The registry replaces a model's list on every set_endpoints: same list, same set.
        if states is self._ring_states:
            return self.ring
        self._ring_states = states
        ids = frozenset([s.id for s in states])
        if ids != self.ring.replica_ids:
            # Endpoints that left (an on-demand replica on a new port each start) must not
            # keep their share of the prefix index.
            for gone in self.ring.replica_ids - ids:
                for scorer in self.forgetters:
                    scorer.forget(gone)
            self.ring = HashRing(
                sorted(ids),
                num_virtual_nodes=self.spec.session.num_virtual_nodes,
                num_fallback_replicas=self.spec.session.num_fallback_replicas,
            )
        return self.ring


@dataclass(slots=True)
class Lease:
    """One dispatched request: `finish` releases the inflight slot and feeds the breaker;
    `first_token` marks the first response byte (once; calls `on_first_token` if set)."""

    registry: Registry
    model: str
    endpoint_id: str
    probe: int  # the half-open period it probes (`Breaker.on_dispatch`), 0: not a probe
    started: float | None = None
    ready_at: float | None = None
    prefill_tokens: float | None = None  # counted as pending prefill there until done
    ahead: float = 0.0  # prefill tokens pending there when it was sent (this router's)
    done: bool = False
    first_token_seen: bool = False
    # The first token was seen (not inferred at the end): the response streams tokens,
    # and each later chunk ends an engine step (`token`).
    streaming: bool = False
    on_first_token: Callable[[], None] | None = None
    # The registry clock when the first token and the end took effect: a trace records
    # them so a replay orders them against picks as the router did (µs margins).
    first_at: float | None = None
    ended_at: float | None = None
    # Its entry among the endpoint's prefills that the engine's first-token count has not
    # closed (`Registry.record_scrape`); closed here at the latest.
    prefill: PendingPrefill | None = None
    # Counted in flight there (False: the endpoint was gone, not even draining, when the
    # request moved to it: its end is charged nowhere, not to a state added there since).
    counted: bool = True

    def first_token(self, observed: bool = True, counted: bool = True) -> None:
        """The first response body byte arrived (the engine finished this prefill); with
        `observed` False the request ended without the edge seeing one (Envoy without body
        events): its prefill is over, but that says nothing about the edge. `counted`: the
        engine produced a first token for it (its next scrape counts it), not an error."""
        if self.first_token_seen or self.done:
            return
        self.first_token_seen = True
        self.streaming = observed
        self.first_at = self.registry.clock()
        if self.ready_at is not None:
            tokens = self.prefill_tokens or 0.0
            waited = None
            if observed and self.started is not None:
                waited = (self.ahead, tokens, self.first_at - self.started)
            self.registry.first_token(
                self.model,
                self.endpoint_id,
                self.ready_at,
                tokens,
                observed=observed,
                waited=waited,
                prefill=self.prefill,
                sent_at=self.started,
                counted=counted,
            )
        if observed:  # a first token ends an engine step too
            self.registry.saw_token(self.model, self.endpoint_id)
        if self.on_first_token is not None:
            self.on_first_token()

    def answered(self) -> None:
        """A half-open probe got a good answer's head: its verdict now, and its slot free;
        the rest of the request counts as any other's."""
        if self.probe and not self.done:
            self.registry.probe_answered(self.model, self.endpoint_id, self.probe)
            self.probe = 0

    def token(self) -> None:
        """A later token of the stream reached the edge: the engine ended a step now (the
        latency scorer's step phase, `EndpointState.token_at`)."""
        self.registry.saw_token(self.model, self.endpoint_id)

    def end(self, outcome: Outcome, counted: bool | None = None) -> None:
        """The request is over: its prefill is done by now (inferred, not seen: a no-op if
        the first byte was seen, and an edge without body events keeps the time-drained
        queue estimate), then `finish`. A fallback's failed attempt uses `finish` alone.
        `counted`: the engine produced a first token for it (default: a success)."""
        if counted is None:
            counted = outcome is Outcome.SUCCESS
        self.first_token(observed=False, counted=counted)
        self.finish(outcome)

    def finish(self, outcome: Outcome) -> None:
        if self.done:
            return
        self.done = True
        self.ended_at = self.registry.clock()
        if not self.counted:
            return
        if not self.first_token_seen and self.ready_at is not None:
            # A failed attempt (a fallback follows): its prefill never ran there, so its
            # predicted share of that engine's queue goes too (left, the primary's queue
            # term held a long prompt's whole prefill after the retry answered elsewhere).
            self.registry.prefill_withdrawn(self.model, self.endpoint_id, self.ready_at)
        pending = 0.0 if self.first_token_seen else self.prefill_tokens or 0.0
        self.registry.release(
            self.model,
            self.endpoint_id,
            outcome,
            probe=self.probe,
            prefill_tokens=pending,
            prefill=self.prefill,
        )


@dataclass(frozen=True, slots=True)
class Explanation:
    """`Scheduler.explain`'s answer: every endpoint of the model, the ids each filter
    dropped (in filter order), and the Decision `pick` would return, or its refusal."""

    request: RequestInfo
    endpoint_ids: tuple[str, ...]
    dropped: tuple[tuple[str, tuple[str, ...]], ...]
    decision: Decision | None
    error: LlmgwError | None


class Scheduler:
    def __init__(
        self, config: Config, registry: Registry | None = None, *, seed: int | None = None
    ) -> None:
        self.config = config
        self.registry = registry or Registry(
            breaker=config.breaker.settings(), staleness=config.scrape.staleness
        )
        self.rng = random.Random(seed if seed is not None else config.seed)
        self.routers: dict[str, ModelRouter] = {
            name: ModelRouter(name, spec) for name, spec in config.models.items()
        }
        for name, spec in config.models.items():
            if spec.endpoints and self.routers[name].mode is not ModelMode.OFF:
                self.registry.set_endpoints(name, endpoints_of(name, spec))

    def router(self, model: str) -> ModelRouter:
        router = self.routers.get(model)
        if router is None:
            raise ModelNotFound.unknown(model, self.routers)
        return router

    def pick(self, request: RequestInfo) -> Decision:
        return self._pick(request, self.router(request.model), self.rng, None)

    def explain(self, request: RequestInfo) -> Explanation:
        """What `pick` would answer now, and why, without changing anything: the same code
        on a shadow of the model's router, a copy of the random state (so the explained
        pick is the next real one), no inflight charge and no prefix-index learning.
        Raises ModelNotFound; every other refusal is returned in `error`."""
        router = self.router(request.model)
        rng = random.Random()
        rng.setstate(self.rng.getstate())
        dropped: list[tuple[str, tuple[str, ...]]] = []
        states = self.registry.states(request.model)
        ids = tuple([s.id for s in states])
        if router.mode is not ModelMode.OFF:
            # The live router's catch-up, as the next real pick would run it first
            # (`run_pick`; idempotent): a restarted engine's or a departed endpoint's
            # prefix-index entries are forgotten, or the shadow (which forgets nothing)
            # would price a cache that is gone and explain another endpoint.
            if router.restart_epoch != self.registry.restart_epoch:
                router.forget_restarted(states, self.registry.restart_epoch)
            router.ring_for(states)
        try:
            decision = self._pick(request, router.shadow(), rng, dropped)
        except LlmgwError as exc:
            return Explanation(request, ids, tuple(dropped), None, exc)
        return Explanation(request, ids, tuple(dropped), decision, None)

    def _pick(
        self,
        request: RequestInfo,
        router: ModelRouter,
        rng: random.Random,
        dropped: list[tuple[str, tuple[str, ...]]] | None,
    ) -> Decision:
        """`dropped` None: a real pick (the chosen endpoint is observed); else an
        explanation, which collects each filter's dropped ids and learns nothing."""
        return run_pick(self.registry, request, router, rng, dropped)

    def acquire(
        self, decision: Decision, endpoint: Endpoint | None = None, *, unstreamed: bool = False
    ) -> Lease:
        """Count the request as in flight on `endpoint` (default: the decision's primary).
        `unstreamed`: the answer comes whole, so no first token will mark its prefill's end."""
        target = endpoint or decision.endpoint
        probe = self.registry.acquire(decision.model, target.id)
        # The prediction holds for the primary only; a fallback's first token says nothing.
        primary = target is decision.endpoint
        tokens = decision.prefill_tokens if primary else None
        ahead, prefill = (
            self.registry.add_prefill(
                decision.model,
                target.id,
                tokens,
                unstreamed=unstreamed,
                ready_at=decision.ready_at,
            )
            if tokens
            else (0.0, None)
        )
        return Lease(
            self.registry,
            decision.model,
            target.id,
            probe or 0,
            self.registry.clock(),
            decision.ready_at if primary else None,
            tokens,
            ahead,
            prefill=prefill,
            counted=probe is not None,
        )
