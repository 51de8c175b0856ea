"""One table test per picker, plus the properties every picker shares."""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.scheduling.interfaces import PickContext, Picker
from llmgw.scheduling.pickers import (
    MaxScorePicker,
    PowerOfTwoPicker,
    RandomPicker,
    RoundRobinPicker,
    SoftmaxPicker,
)
from llmgw.scheduling.plugins import PICKERS, PluginError, make_picker

from .helpers import context, state


def ctx_for(n: int, seed: int = 0) -> PickContext:
    return context([state(f"h{i}:1") for i in range(n)], seed=seed)


@dataclass
class Case:
    name: str
    picker: Picker
    totals: list[float]
    limit: int
    want: list[int]


CASES = [
    Case("max-score/highest-first-then-fallbacks", MaxScorePicker(), [0.1, 0.9, 0.5], 3, [1, 2, 0]),
    Case("max-score/limit-cuts-the-fallbacks", MaxScorePicker(), [0.1, 0.9, 0.5, 0.7], 2, [1, 3]),
    Case("max-score/single-candidate", MaxScorePicker(), [0.3], 3, [0]),
    Case(
        "softmax/zero-temperature-is-argmax",
        SoftmaxPicker(temperature=0.0),
        [0.2, 0.1, 3.0],
        3,
        [2, 0, 1],
    ),
    Case("p2c/two-candidates-the-better-wins", PowerOfTwoPicker(), [0.4, 0.6], 2, [1, 0]),
    Case("p2c/single-candidate", PowerOfTwoPicker(), [0.4], 3, [0]),
    Case("round-robin/first-call-starts-at-zero", RoundRobinPicker(), [0.0, 9.0, 1.0], 2, [0, 1]),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_picker(case: Case) -> None:
    assert case.picker.order(ctx_for(len(case.totals)), case.totals, case.limit) == case.want


@pytest.mark.parametrize(
    ("name", "params", "phrase"),
    [
        ("softmax", {"temperature": -0.1}, "temperature must be >= 0"),
        ("softmax", {"temp": 1.0}, "unknown param 'temp' (accepted: temperature)"),
        ("max-score", {"temperature": 1.0}, "unknown param 'temperature' (accepted: none)"),
    ],
)
def test_picker_rejects_bad_params(name: str, params: dict[str, float], phrase: str) -> None:
    with pytest.raises(PluginError, match=re.escape(phrase)):
        make_picker(name, params)


def test_picker_params_reach_the_picker() -> None:
    picker = make_picker("softmax", {"temperature": 0.7})
    assert isinstance(picker, SoftmaxPicker)
    assert picker.temperature == 0.7


def test_max_score_breaks_ties_at_random() -> None:
    picker = MaxScorePicker()
    firsts = Counter(picker.order(ctx_for(3, seed), [1.0, 1.0, 0.0], 1)[0] for seed in range(200))
    assert set(firsts) == {0, 1}
    assert min(firsts.values()) > 60


def test_p2c_never_chooses_the_worst_and_prefers_the_best() -> None:
    picker = PowerOfTwoPicker()
    ctx = ctx_for(3, seed=7)
    firsts = Counter(picker.order(ctx, [0.0, 0.5, 1.0], 3)[0] for _ in range(3000))
    assert firsts[0] == 0
    # The best wins any pair it is in: 2 pairs of 3.
    assert firsts[2] / 3000 == pytest.approx(2 / 3, abs=0.04)


def test_softmax_samples_in_proportion_to_exp_score_over_temperature() -> None:
    picker = SoftmaxPicker(temperature=0.5)
    totals = [0.0, 0.5, 1.0]
    ctx = ctx_for(3, seed=11)
    n = 6000
    firsts = Counter(picker.order(ctx, totals, 1)[0] for _ in range(n))
    weights = [math.exp(t / 0.5) for t in totals]
    for i, w in enumerate(weights):
        assert firsts[i] / n == pytest.approx(w / sum(weights), abs=0.03)


def test_round_robin_cycles_through_the_candidates() -> None:
    picker = RoundRobinPicker()
    ctx = ctx_for(3)
    assert [picker.order(ctx, [0.0] * 3, 1)[0] for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_random_picker_covers_every_candidate() -> None:
    picker = RandomPicker()
    ctx = ctx_for(4, seed=3)
    assert {picker.order(ctx, [5.0, 0.0, 0.0, 0.0], 1)[0] for _ in range(200)} == {0, 1, 2, 3}


def test_same_seed_same_order() -> None:
    totals = [1.0, 1.0, 1.0, 0.5, 0.5]
    for name, factory in PICKERS.items():
        a = factory().order(ctx_for(5, seed=5), totals, 3)
        b = factory().order(ctx_for(5, seed=5), totals, 3)
        assert a == b, name


@settings(max_examples=80, deadline=None)
@given(
    totals=st.lists(st.floats(0, 10), min_size=1, max_size=20),
    limit=st.integers(1, 6),
    seed=st.integers(0, 2**32),
    temperature=st.floats(0, 5),
)
def test_every_picker_returns_distinct_valid_indices_up_to_the_limit(
    totals: list[float], limit: int, seed: int, temperature: float
) -> None:
    pickers: list[Picker] = [f() for n, f in PICKERS.items() if n != "softmax"]
    pickers.append(SoftmaxPicker(temperature=temperature))
    for picker in pickers:
        order = picker.order(
            context([state(f"h{i}:1") for i in range(len(totals))], seed=seed), totals, limit
        )
        assert len(order) == min(limit, len(totals)), picker.name
        assert len(set(order)) == len(order)
        assert all(0 <= i < len(totals) for i in order)


def test_max_score_fallbacks_are_best_first() -> None:
    rng = random.Random(1)
    for _ in range(50):
        totals = [rng.random() for _ in range(8)]
        order = MaxScorePicker().order(ctx_for(8), totals, 4)
        assert [totals[i] for i in order] == sorted(totals, reverse=True)[:4]


def test_ties_across_the_fallback_places_are_drawn_uniformly() -> None:
    picker = MaxScorePicker()
    n, runs = 10, 3000
    firsts: Counter[int] = Counter()
    seconds: Counter[int] = Counter()
    ctx = ctx_for(n)
    for seed in range(runs):
        ctx.rng = random.Random(seed)
        order = picker.order(ctx, [1.0] * n, 3)
        assert len(set(order)) == 3
        firsts[order[0]] += 1
        seconds[order[1]] += 1
    for counts in (firsts, seconds):
        assert set(counts) == set(range(n))
        assert all(abs(c - runs / n) < 0.3 * runs / n for c in counts.values())


def test_a_tie_below_the_best_is_broken_at_random_too() -> None:
    picker = MaxScorePicker()
    lasts: Counter[int] = Counter()
    ctx = ctx_for(5)
    for seed in range(400):
        ctx.rng = random.Random(seed)
        order = picker.order(ctx, [1.0, 1.0, 1.0, 0.5, 0.5], 4)
        assert set(order[:3]) == {0, 1, 2}
        lasts[order[3]] += 1
    assert set(lasts) == {3, 4} and min(lasts.values()) > 120
