"""One table test per filter, in the style of the Gateway API Inference Extension plugin tests."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from llmgw.breaker import BreakerSettings
from llmgw.errors import LlmgwError, NoCapacity, NoHealthyEndpoint
from llmgw.registry import EndpointState
from llmgw.scheduling.filters import (
    BlindImbalanceFilter,
    FreshMetricsFilter,
    HealthyFilter,
    ModelServesFilter,
    NotSaturatedFilter,
)
from llmgw.scheduling.interfaces import Filter
from llmgw.scheduling.plugins import FILTERS

from .helpers import context, model_spec, state

NOW = 10.0
TRIP = BreakerSettings(failure_threshold=1, base_cooldown=5.0, half_open_probes=1)


def loaded(
    *inflight: int, fresh: int | None = None, first_tokens: int | None = None
) -> list[EndpointState]:
    """Endpoints with these in-flight counts; `fresh` has fresh metrics, `first_tokens`'s
    edge reports first tokens."""
    states = []
    for i, n in enumerate(inflight):
        s = state(f"e{i}:1", inflight=n, waiting=0 if i == fresh else None, scraped_at=NOW)
        s.reports_first_token = i == first_tokens
        states.append(s)
    return states


def closed() -> EndpointState:
    return state("a:1", breaker=TRIP)


def opened(at: float, address: str = "b:1") -> EndpointState:
    s = state(address, breaker=TRIP)
    s.breaker.record(False, at)
    return s


def half_open_busy() -> EndpointState:
    s = opened(0.0)
    assert s.breaker.available(NOW)
    s.breaker.on_dispatch()
    return s


@dataclass
class Case:
    name: str
    filter: Filter
    candidates: list[EndpointState]
    want: list[int]  # indices of the candidates that must survive
    spec_fields: dict[str, object] = field(default_factory=dict)


CASES = [
    Case("healthy/closed-kept", HealthyFilter(), [closed()], [0]),
    Case("healthy/open-dropped", HealthyFilter(), [closed(), opened(NOW - 1)], [0]),
    Case("healthy/open-cooldown-over-kept-as-half-open", HealthyFilter(), [opened(NOW - 5)], [0]),
    Case(
        "healthy/half-open-probe-slots-full-dropped",
        HealthyFilter(),
        [closed(), half_open_busy()],
        [0],
    ),
    Case("healthy/all-open-empty", HealthyFilter(), [opened(NOW), opened(NOW, "c:1")], []),
    Case(
        "model-serves/unknown-and-yes-kept-no-dropped",
        ModelServesFilter(),
        [state("a:1", serves=None), state("b:1", serves=True), state("c:1", serves=False)],
        [0, 1],
    ),
    Case(
        "not-saturated/below-ceilings-kept",
        NotSaturatedFilter(),
        [state("a:1", waiting=63, kv=0.97, scraped_at=NOW)],
        [0],
    ),
    Case(
        "not-saturated/queue-at-ceiling-dropped",
        NotSaturatedFilter(),
        [state("a:1", waiting=64, scraped_at=NOW), state("b:1", waiting=0, scraped_at=NOW)],
        [1],
    ),
    Case(
        "not-saturated/kv-at-ceiling-dropped",
        NotSaturatedFilter(),
        [state("a:1", waiting=0, kv=0.98, scraped_at=NOW), state("b:1", waiting=0, scraped_at=NOW)],
        [1],
    ),
    Case(
        "not-saturated/configured-ceilings",
        NotSaturatedFilter(),
        [state("a:1", waiting=5, scraped_at=NOW), state("b:1", waiting=4, kv=0.5, scraped_at=NOW)],
        [1],
        {"saturation": {"queue_ceiling": 5, "kv_ceiling": 0.6}},
    ),
    Case(
        "not-saturated/stale-saturation-is-not-trusted",
        NotSaturatedFilter(),
        [state("a:1", waiting=500, kv=1.0, scraped_at=NOW - 3), state("b:1")],
        [0, 1],
    ),
    Case(
        "staleness/fresh-kept-stale-and-unscraped-dropped",
        FreshMetricsFilter(),
        [
            state("a:1", waiting=0, scraped_at=NOW - 1),
            state("b:1", waiting=0, scraped_at=NOW - 3),
            state("c:1"),
        ],
        [0],
    ),
    Case(
        "staleness/none-fresh-keeps-all",
        FreshMetricsFilter(),
        [state("a:1", waiting=0, scraped_at=NOW - 3), state("b:1")],
        [0, 1],
    ),
    # Imbalanced: 30 - 2 > max(8, 2 x mean 12.5); kept: within half the gap (12.5) of the
    # least loaded, so 15 goes too.
    Case("blind-imbalance/herd-leaves", BlindImbalanceFilter(), loaded(30, 2, 3, 15), [1, 2]),
    *(
        Case(f"blind-imbalance/{name}-keeps-all", BlindImbalanceFilter(), states, [0, 1, 2, 3])
        for name, states in (
            ("gap-below-8", loaded(10, 3, 3, 3)),
            ("big-batches-need-a-gap-over-twice-the-mean", loaded(40, 10, 10, 10)),
            ("one-fresh-scrape", loaded(20, 2, 3, 6, fresh=3)),
            ("first-tokens-seen", loaded(20, 2, 3, 6, first_tokens=0)),
        )
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_filter(case: Case) -> None:
    ctx = context(case.candidates, spec=model_spec(**case.spec_fields), now=NOW, staleness=2.0)
    got = case.filter.filter(ctx, list(case.candidates))
    assert got == [case.candidates[i] for i in case.want]


@pytest.mark.parametrize(
    ("name", "error", "phrase"),
    [
        ("healthy", NoHealthyEndpoint, "every endpoint of model 'm' is failing"),
        ("model-serves", NoHealthyEndpoint, "no endpoint currently serves model 'm'"),
        ("not-saturated", NoCapacity, "every endpoint of model 'm' is saturated"),
        ("staleness", NoHealthyEndpoint, "no endpoint of model 'm' has fresh metrics"),
        ("blind-imbalance", NoCapacity, "every endpoint of model 'm' is overloaded"),
    ],
)
def test_filter_carries_the_error_its_emptying_the_set_means(
    name: str, error: type[LlmgwError], phrase: str
) -> None:
    flt = FILTERS[name]()
    assert flt.name == name
    assert flt.when_empty is error
    assert phrase in flt.empty_message.format(model="m")


def test_every_registered_filter_names_an_error_with_a_status() -> None:
    for name, factory in FILTERS.items():
        flt = factory()
        assert issubclass(flt.when_empty, LlmgwError), name
        assert flt.when_empty.status >= 400, name
        assert "{model!r}" in flt.empty_message, name
