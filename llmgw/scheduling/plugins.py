"""Name -> factory registry for filters, scorers and pickers (the config refers to these names).

A plugin describes itself: a filter carries the error its emptying the set means, a scorer
declares its optional capabilities (`interfaces.NeedsPrompt`, ...), scorers and pickers take
their params as keyword arguments and reject bad ones with a ValueError.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from llmgw.scheduling import filters, pickers, scorers
from llmgw.scheduling.interfaces import Filter, Picker, Scorer

FILTERS: dict[str, Callable[[], Filter]] = {
    "healthy": filters.HealthyFilter,
    "model-serves": filters.ModelServesFilter,
    "not-saturated": filters.NotSaturatedFilter,
    "staleness": filters.FreshMetricsFilter,
    "bounded-load": filters.BoundedLoadFilter,
    "blind-imbalance": filters.BlindImbalanceFilter,
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

P = TypeVar("P")


class PluginError(ValueError):
    """A plugin rejected its params (unknown name, wrong type or value)."""


def _accepted(factory: Callable[..., Any]) -> list[str] | None:
    """The param names a plugin takes, or None where its signature cannot be read."""
    try:
        return [
            p.name
            for p in inspect.signature(factory).parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return None


def _build(factory: Callable[..., P], params: Mapping[str, Any]) -> P:
    # Unknown names first, in one message of our own: Python and the compiled plugins
    # (`llmgw/native.py`) word a bad keyword differently.
    accepted = _accepted(factory)
    if accepted is not None:
        unknown = [name for name in params if name not in accepted]
        if unknown:
            raise PluginError(
                f"unknown param{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(repr(u) for u in unknown)} (accepted: {', '.join(accepted) or 'none'})"
            )
    try:
        return factory(**params)
    except (TypeError, ValueError) as exc:
        raise PluginError(str(exc)) from None


def make_scorer(name: str, params: Mapping[str, Any]) -> Scorer:
    return _build(SCORERS[name], params)


def make_picker(name: str, params: Mapping[str, Any]) -> Picker:
    return _build(PICKERS[name], params)


def make_filter(name: str) -> Filter:
    return FILTERS[name]()
