"""The pick itself (filter -> score -> pick -> Decision), apart from `Scheduler` so that it
compiles (`llmgw/native.py`): `Scheduler` stays a Python class that tests and tools may
patch, and calls this once per pick. Compiled with the filters and pickers, a 16-endpoint
`latency` pick takes 0.82x the time (`bench/results/pick_latency_s27.txt`).
"""

from __future__ import annotations

import ipaddress
import random
from collections.abc import Callable
from functools import lru_cache
from itertools import repeat
from operator import add, mul
from typing import Protocol

from llmgw.breaker import BreakerState
from llmgw.config import ModelMode, ModelSpec, canonical_address
from llmgw.errors import LlmgwError, ModelDisabled, ModelNotReady, NoHealthyEndpoint
from llmgw.hashring import HashRing
from llmgw.registry import EndpointState, Registry
from llmgw.scheduling.interfaces import (
    ExplainsScores,
    Filter,
    LearnsFromChoice,
    PickContext,
    Picker,
    Scorer,
)
from llmgw.types import (
    Decision,
    RequestInfo,
    ScorerColumn,
    new_decision,
    new_rationale,
    new_scorer_column,
)


class ModelRouter(Protocol):
    """What a pick reads of `scheduler.ModelRouter` (which imports this module)."""

    mode: ModelMode
    spec: ModelSpec
    strategy_name: str
    filters: list[Filter]
    scoring: list[tuple[Scorer, float, ExplainsScores | None]]
    observers: list[LearnsFromChoice]
    picker: Picker
    limit: int

    restart_epoch: int

    def ring_for(self, states: list[EndpointState]) -> HashRing: ...

    def forget_restarted(self, states: list[EndpointState], epoch: int) -> None: ...

    def ids_of(self, candidates: list[EndpointState]) -> tuple[str, ...]: ...


def _left_out(before: list[EndpointState], after: list[EndpointState]) -> tuple[str, ...]:
    """The ids of `before` that are not in `after` (an explanation's dropped endpoints)."""
    keep = {s.id for s in after}
    return tuple([s.id for s in before if s.id not in keep])


def run_pick(
    registry: Registry,
    request: RequestInfo,
    router: ModelRouter,
    rng: random.Random,
    dropped: list[tuple[str, tuple[str, ...]]] | None,
) -> Decision:
    """`Scheduler._pick`: `dropped` None is a real pick (the chosen endpoint is observed);
    else an explanation, which collects each filter's dropped ids and learns nothing."""
    if router.mode is ModelMode.OFF:
        raise ModelDisabled(
            f"model {request.model!r} is configured but disabled (scaling max is 0 or no "
            "scaling stanza); enable it in the config"
        )
    states = registry.states(request.model)
    if router.restart_epoch != registry.restart_epoch:  # an engine restarted somewhere
        router.forget_restarted(states, registry.restart_epoch)
    # A subset hint limits the candidates; the model's endpoints stay its endpoints: the
    # ring, its costs and speeds, the load bound are theirs (a ring over the hint forgot
    # the others' prefix-index entries, and its costs priced the next picks).
    ring = router.ring_for(states)
    # No replica yet comes first: an on-demand model is started whatever the gateway's
    # subset hint says (checked once it runs), or a hinting gateway never starts one.
    if not states:
        if router.mode in (ModelMode.ON_DEMAND, ModelMode.ALWAYS_ON):
            raise ModelNotReady(f"model {request.model!r} has no ready replica yet")
        raise NoHealthyEndpoint(f"model {request.model!r} has no endpoints")
    offered = states
    if request.subset is not None:
        offered = [s for s in states if _in_subset(s.endpoint.address, request.subset)]
        if dropped is not None:  # an explanation names every reason an endpoint sat out
            dropped.append(("subset", _left_out(states, offered)))
        if not offered:
            raise NoHealthyEndpoint(
                f"none of the gateway's subset hint ({', '.join(sorted(request.subset))}) "
                f"is an endpoint of model {request.model!r}"
            )
    # Positional: keywords cost a lookup each (this runs per pick).
    ctx = PickContext(
        request,
        router.spec,
        registry.clock(),
        registry.staleness,
        ring,
        states,
        rng,
        None,  # fresh metrics: computed on first use
        registry.kv_index,
    )
    candidates = offered
    drops: list[tuple[str, int]] = []
    explained = len(dropped) if dropped is not None else 0  # the subset's entry stays
    cap = registry.warmup_inflight
    if cap is not None and registry.warming(request.model):
        # New replicas not scraped yet take a bounded share (their ring arcs overflow
        # to the next replica), unless nothing else is left.
        kept = [s for s in offered if not (s.warming and s.inflight + s.remote_inflight >= cap)]
        if kept and len(kept) < len(offered):
            drops.append(("warmup", len(offered) - len(kept)))
            if dropped is not None:
                dropped.append(("warmup", _left_out(offered, kept)))
            candidates = kept
    try:
        candidates = _filtered(router.filters, ctx, candidates, drops, dropped)
    except LlmgwError:
        if candidates is offered:
            raise
        # Nothing else is left once filtered (the others failing, saturated or not serving
        # the model): the warming replicas past their cap take it. Capped first, a healthy
        # new replica's model answered 503 with the failing ones' Retry-After.
        del drops[:]
        if dropped is not None:
            del dropped[explained:]
        candidates = _filtered(router.filters, ctx, offered, drops, dropped)

    columns: list[ScorerColumn] = []
    n = len(candidates)
    totals: list[float] | None = None
    for scorer, weight, explainer in router.scoring:
        raw = scorer.score(ctx, candidates)
        if len(raw) != n:
            raise ValueError(f"scorer {scorer.name!r} returned {len(raw)} scores for {n}")
        if explainer is None:
            columns.append(new_scorer_column(scorer.name, weight, tuple(raw), (), ()))
        else:
            columns.append(
                new_scorer_column(
                    scorer.name, weight, tuple(raw), explainer.term_names, explainer.term_rows()
                )
            )
        if weight:  # C-level maps: this runs per endpoint per scorer on every pick
            # 1.0 * x is x, and the first column needs no sum (x rather than 0.0 + x:
            # equal under ==, -0.0 would stay -0.0), so one pass less per pick.
            weighted = raw if weight == 1.0 else map(mul, repeat(weight, n), raw)
            totals = list(weighted) if totals is None else list(map(add, totals, weighted))
    if totals is None:
        totals = [0.0] * n

    order = router.picker.order(ctx, totals, router.limit)
    chosen = candidates[order[0]]
    if dropped is None:
        for observer in router.observers:
            observer.observe(ctx, chosen)
    why = new_rationale(
        router.strategy_name,
        router.picker.name,
        router.ids_of(candidates),
        tuple(columns),
        tuple(totals),
        tuple(drops),
        len(offered),
    )
    ready_at, ttft, tokens = ctx.prediction or (None, None, None)
    # Fallbacks only where the breaker is closed: a half-open endpoint takes its probes as
    # a primary. Listed, every concurrent request listed it, and Envoy's retries (which
    # ask no breaker) landed as many probes there as primaries failed.
    closed = BreakerState.CLOSED
    return new_decision(
        request.model,
        chosen.endpoint,
        tuple([candidates[i].endpoint for i in order[1:] if candidates[i].breaker.state is closed]),
        why,
        ready_at,
        ttft,
        tokens,
        ctx.now,
    )


def _filtered(
    filters: list[Filter],
    ctx: PickContext,
    candidates: list[EndpointState],
    drops: list[tuple[str, int]],
    dropped: list[tuple[str, tuple[str, ...]]] | None,
) -> list[EndpointState]:
    """`candidates` through each filter in turn, noting what each dropped; raises the error
    of the first that leaves none."""
    for flt in filters:
        kept = flt.filter(ctx, candidates)
        drops.append((flt.name, len(candidates) - len(kept)))
        if dropped is not None:
            dropped.append((flt.name, _left_out(candidates, kept)))
        if not kept:
            raise _nothing_left(flt, ctx, candidates)
        candidates = kept
    return candidates


def _nothing_left(flt: Filter, ctx: PickContext, candidates: list[EndpointState]) -> LlmgwError:
    """The error of a filter that dropped every candidate, with `Retry-After` when the
    filter can say when one comes back (its optional `retry_after(ctx, candidates)`)."""
    message = flt.empty_message.format(model=ctx.request.model)
    hint: Callable[[PickContext, list[EndpointState]], int] | None = getattr(
        flt, "retry_after", None
    )
    if hint is None:
        return flt.when_empty(message)
    return flt.when_empty(message, retry_after=hint(ctx, candidates))


def canonical_hint(entry: str) -> str:
    """An endpoint of a gateway's subset hint spelt as the registry spells addresses
    (`canonical_address`; an IP alone: bare, IPv6 compressed), so that `_in_subset`
    compares strings: `[FD00::2]:8000` and `[fd00:0::2]:8000` are `[fd00::2]:8000`. The
    edge calls it once per entry per request; an IPv4 one is returned as it is."""
    if "[" not in entry and entry.count(":") <= 1:
        return entry
    return _canonical_v6_hint(entry)


@lru_cache(maxsize=4096)
def _canonical_v6_hint(entry: str) -> str:
    if entry.startswith("["):
        host, _, port = entry[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, port = entry, ""
    try:
        if port:
            return canonical_address(f"[{host}]:{port}")
        ip = ipaddress.IPv6Address(host)
    except ValueError:
        return entry  # not an address: it matches nothing, as it is
    return str(ip.ipv4_mapped) if ip.ipv4_mapped is not None else ip.compressed


def _in_subset(address: str, subset: frozenset[str]) -> bool:
    """The gateway's hint names endpoints as ip:port, or (as GIE's reference picker reads
    it) by IP alone: every port of that IP. Its entries are `canonical_hint`s."""
    if address in subset:
        return True
    host = address.rpartition(":")[0]
    return host in subset or host.strip("[]") in subset
