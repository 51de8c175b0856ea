"""One table test per scorer; every score stays in [0, 1] whatever the state (hypothesis)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.hashring import HashRing
from llmgw.registry import EndpointState
from llmgw.scheduling.interfaces import LearnsFromChoice, Scorer
from llmgw.scheduling.plugins import SCORERS
from llmgw.scheduling.scorers import (
    InflightScorer,
    KvScorer,
    LoadScorer,
    PrefixScorer,
    QueueScorer,
    SessionScorer,
    WeightScorer,
)
from llmgw.types import RequestInfo

from .helpers import context, model_spec, state

NOW = 10.0
STALE = NOW - 5.0


@dataclass
class Case:
    name: str
    scorer: Scorer
    candidates: list[EndpointState]
    want: list[float]
    request: RequestInfo = field(default_factory=lambda: RequestInfo("m", "r-1"))


def rel(values: list[float], c: float) -> list[float]:
    """The documented relative score: (min + c) / (x + c)."""
    low = min(values) + c
    return [low / (v + c) for v in values]


CASES = [
    Case(
        "queue/fewer-waiting-scores-higher",
        QueueScorer(),
        [
            state("a:1", waiting=0, scraped_at=NOW),
            state("b:1", waiting=1, scraped_at=NOW),
            state("c:1", waiting=3, scraped_at=NOW),
        ],
        rel([0, 1, 3], 1.0),
    ),
    Case(
        "queue/stale-metrics-fall-back-to-inflight",
        QueueScorer(),
        [state("a:1", waiting=0, scraped_at=STALE, inflight=2), state("b:1", inflight=0)],
        rel([2, 0], 1.0),
    ),
    Case(
        "queue/requests-sent-since-the-scrape-count-as-queue",
        QueueScorer(),
        [
            state("a:1", waiting=0, running=2, inflight=5, scraped_at=NOW),
            state("b:1", waiting=1, scraped_at=NOW),
        ],
        rel([3, 1], 1.0),
    ),
    Case(
        "queue/equal-queues-score-one",
        QueueScorer(smoothing=0.5),
        [state("a:1", waiting=7, scraped_at=NOW), state("b:1", waiting=7, scraped_at=NOW)],
        [1.0, 1.0],
    ),
    Case(
        "inflight/fewer-inflight-scores-higher",
        InflightScorer(),
        [state("a:1", inflight=0), state("b:1", inflight=1), state("c:1", inflight=4)],
        rel([0, 1, 4], 1.0),
    ),
    Case(
        "load/engine-load-or-local-inflight-whichever-larger",
        LoadScorer(),
        [
            state("a:1", waiting=1, running=3, inflight=1, scraped_at=NOW),
            state("b:1", inflight=2),
            state("c:1", waiting=0, running=0, inflight=6, scraped_at=NOW),
        ],
        rel([4, 2, 6], 2.0),
    ),
    Case(
        "kv/free-cache-scores-higher-and-ceiling-is-a-hard-zero",
        KvScorer(ceiling=0.9),
        [
            state("a:1", waiting=0, kv=0.2, scraped_at=NOW),
            state("b:1", waiting=0, kv=0.9, scraped_at=NOW),
            state("c:1", waiting=0, kv=0.95, scraped_at=NOW),
            state("d:1", waiting=0, kv=0.0, scraped_at=NOW),
        ],
        [0.8, 0.0, 0.0, 1.0],
    ),
    Case(
        "kv/unknown-usage-is-neutral",
        KvScorer(),
        [state("a:1", waiting=0, kv=0.99, scraped_at=STALE), state("b:1")],
        [0.5, 0.5],
    ),
    Case(
        "weight/relative-to-the-heaviest",
        WeightScorer(),
        [state("a:1", weight=1), state("b:1", weight=2), state("c:1", weight=4)],
        [0.25, 0.5, 1.0],
    ),
    Case(
        "prefix/no-prompt-scores-zero",
        PrefixScorer(),
        [state("a:1"), state("b:1")],
        [0.0, 0.0],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_scorer(case: Case) -> None:
    ctx = context(case.candidates, request=case.request, now=NOW)
    assert case.scorer.score(ctx, case.candidates) == pytest.approx(case.want)


ADDRESSES = [f"10.0.0.{i}:8000" for i in range(1, 7)]


@pytest.mark.parametrize("session", ["alice", "bob", "carol", "dave"])
def test_session_scores_the_ring_primary_one_then_decreasing_fallbacks(session: str) -> None:
    states = [state(a) for a in ADDRESSES]
    ctx = context(states, request=RequestInfo("m", "r", session_key=session))
    scores = dict(zip(ADDRESSES, SessionScorer().score(ctx, states), strict=True))
    ring = HashRing(ADDRESSES, num_fallback_replicas=2).candidates(session)
    ranked = [scores[a] for a in ring]
    assert ranked[0] == 1.0
    assert ranked == sorted(ranked, reverse=True) and len(set(ranked)) == 3 and ranked[-1] > 0
    assert all(scores[a] == 0.0 for a in ADDRESSES if a not in ring)


def test_session_ranks_follow_a_candidate_list_refilled_in_place_between_picks() -> None:
    # Scorers index candidates by position; a filter may hand back one list object it
    # refills each pick, so only the pick's own endpoint list may be indexed once.
    states = [state(a) for a in ADDRESSES]
    ctx = context(states, request=RequestInfo("m", "r", session_key="alice"))
    primary = HashRing(ADDRESSES, num_fallback_replicas=2).candidates("alice")[0]
    scorer = SessionScorer()
    kept = list(states)
    for order in (states, states[::-1], states[2:] + states[:2]):
        kept[:] = order
        scores = scorer.score(ctx, kept)
        assert scores[[s.id for s in kept].index(primary)] == 1.0


def test_session_without_a_session_key_uses_the_request_id() -> None:
    states = [state(a) for a in ADDRESSES]
    ctx = context(states, request=RequestInfo("m", "req-77"))
    scores = SessionScorer().score(ctx, states)
    primary = HashRing(ADDRESSES).candidates("req-77")[0]
    assert scores[ADDRESSES.index(primary)] == 1.0


def test_session_with_bounded_load_passes_over_an_overloaded_primary() -> None:
    states = [state(a) for a in ADDRESSES]
    ring = HashRing(ADDRESSES, num_fallback_replicas=2).candidates("alice")
    by_id = {s.id: s for s in states}
    by_id[ring[0]].inflight = 12  # 12 in flight over 6: capacity ceil(1.25 * 13 / 6) = 3
    spec = model_spec(endpoints=ADDRESSES, session={"bounded_load": 1.25})
    ctx = context(states, request=RequestInfo("m", "r", session_key="alice"), spec=spec)
    scores = dict(zip(ADDRESSES, SessionScorer().score(ctx, states), strict=True))
    assert scores[ring[1]] == 1.0
    assert scores[ring[0]] < 1.0


@pytest.mark.parametrize(
    ("factory", "params"),
    [
        (QueueScorer, {"smoothing": 0}),
        (InflightScorer, {"smoothing": -1}),
        (LoadScorer, {"smoothing": 0}),
        (KvScorer, {"ceiling": 0}),
        (SessionScorer, {"bounded_load": 0.5}),
    ],
)
def test_params_that_would_break_the_zero_one_range_are_rejected(
    factory: Callable[..., Scorer], params: dict[str, float]
) -> None:
    with pytest.raises(ValueError, match=next(iter(params))):
        factory(**params)


metric_states = st.lists(
    st.tuples(
        st.one_of(st.none(), st.floats(0, 1e4)),  # waiting (None: never scraped)
        st.floats(0, 1e4),  # running
        st.floats(0, 1),  # kv usage
        st.integers(0, 1000),  # inflight
        st.floats(0.01, 100),  # weight
        st.floats(0, 10),  # age of the scrape
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(
    rows=metric_states,
    session=st.one_of(st.none(), st.text(max_size=8)),
    prompt=st.text(max_size=1200),
)
def test_every_scorer_scores_in_zero_one(
    rows: list[tuple[float | None, float, float, int, float, float]],
    session: str | None,
    prompt: str,
) -> None:
    states = [
        state(
            f"10.0.{i}.1:80",
            waiting=w,
            running=r,
            kv=kv,
            inflight=n,
            weight=wt,
            scraped_at=NOW - age,
        )
        for i, (w, r, kv, n, wt, age) in enumerate(rows)
    ]
    spec = model_spec(endpoints=[s.id for s in states], session={"bounded_load": 1.25})
    ctx = context(
        states,
        request=RequestInfo("m", "r", session_key=session, prompt=prompt),
        spec=spec,
        now=NOW,
    )
    for name, factory in SCORERS.items():
        scorer = factory()
        if isinstance(scorer, LearnsFromChoice):
            scorer.observe(ctx, states[0])
        scores = scorer.score(ctx, states)
        assert len(scores) == len(states)
        assert all(0.0 <= x <= 1.0 for x in scores), (name, scores)
