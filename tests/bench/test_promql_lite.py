"""bench/promql_lite.py: the PromQL subset the dashboard PNG is drawn with."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.promql_lite import Store, evaluate

V = {"$model": ".*", "$__rate_interval": "10s"}


def page(n: int, b: int) -> str:
    return f"""# TYPE x counter
x_total{{model="m1",endpoint="a"}} {n}
x_total{{model="m1",endpoint="b"}} {2 * n}
# TYPE h histogram
h_bucket{{model="m1",le="0.1"}} {b}
h_bucket{{model="m1",le="1.0"}} {2 * b}
h_bucket{{model="m1",le="+Inf"}} {2 * b}
h_sum{{model="m1"}} {b}
h_count{{model="m1"}} {2 * b}
"""


@pytest.fixture
def store() -> Store:
    s = Store()
    for t in range(21):
        s.ingest(float(t), page(10 * t, 5 * t))
    return s


def test_rate_and_increase_by_label(store: Store) -> None:
    expr = 'sum by (endpoint) (rate(x_total{model=~"$model"}[$__rate_interval]))'
    assert evaluate(expr, store, 20, V) == {(("endpoint", "a"),): 10.0, (("endpoint", "b"),): 20.0}
    assert evaluate("sum (increase(x_total[5s]))", store, 20, V) == {(): 120.0}


def test_histogram_quantile_interpolates_within_the_bucket(store: Store) -> None:
    expr = "histogram_quantile(0.75, sum by (le, model) (rate(h_bucket[10s])))"
    assert evaluate(expr, store, 20, V) == {(("model", "m1"),): pytest.approx(0.55)}


def test_vector_division_and_matchers(store: Store) -> None:
    mean = "sum by (model) (rate(h_sum[10s])) / sum by (model) (rate(h_count[10s]))"
    assert evaluate(mean, store, 20, V) == {(("model", "m1"),): 0.5}
    assert evaluate('max by (endpoint) (x_total{endpoint!="a"})', store, 20, V) == {
        (("endpoint", "b"),): 400.0
    }
