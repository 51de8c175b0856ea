"""Name -> factory registry for filters, scorers and pickers (the config refers to these names)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from llmgw.scheduling import filters, pickers, scorers
from llmgw.scheduling.interfaces import Filter, Picker, Scorer

FILTERS: dict[str, Callable[[], Filter]] = {
    "healthy": filters.HealthyFilter,
    "model-serves": filters.ModelServesFilter,
    "not-saturated": filters.NotSaturatedFilter,
    "staleness": filters.FreshMetricsFilter,
    "bounded-load": filters.BoundedLoadFilter,
}

SCORERS: dict[str, Callable[..., Scorer]] = {
    "queue": scorers.QueueScorer,
    "inflight": scorers.InflightScorer,
    "load": scorers.LoadScorer,
    "kv": scorers.KvScorer,
    "weight": scorers.WeightScorer,
    "session": scorers.SessionScorer,
    "prefix": scorers.PrefixScorer,
    "latency": scorers.LatencyScorer,
}

PICKERS: dict[str, Callable[..., Picker]] = {
    "max-score": pickers.MaxScorePicker,
    "p2c": pickers.PowerOfTwoPicker,
    "softmax": pickers.SoftmaxPicker,
    "round-robin": pickers.RoundRobinPicker,
    "random": pickers.RandomPicker,
}


def make_scorer(name: str, params: Mapping[str, Any]) -> Scorer:
    try:
        return SCORERS[name](**params)
    except TypeError as exc:
        raise ValueError(f"scorers.{name}.params: {exc}") from None
