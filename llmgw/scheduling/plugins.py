"""Name -> factory registry for filters, scorers and pickers (the config refers to these names).

A plugin describes itself: a filter carries the error its emptying the set means, a scorer
declares its optional capabilities (`interfaces.NeedsPrompt`, ...), scorers and pickers take
their params as keyword arguments and reject bad ones with a ValueError.
"""

from __future__ import annotations

import inspect
import math
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
    """A plugin rejected its params (unknown name, wrong type or value); `param` names the
    one param at fault when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# What a param's annotation (or, where mypyc kept none, its default) says it takes.
_KINDS: dict[str, type] = {"bool": bool, "int": int, "float": float, "str": str}
_WANTED = {
    bool: "true or false",
    int: "a whole number",
    float: "a number",
    str: "a string",
}


def _params(factory: Callable[..., Any]) -> dict[str, type | None] | None:
    """Each param a plugin takes and its kind (bool, int, float, str; None: unchecked), or
    None where its signature cannot be read. The Python sources carry annotations, the
    compiled classes (`llmgw/native.py`) their defaults alone: both give one kind
    (`tests/core/test_scheduling_plugins.py` checks they agree), so a config loads alike
    either way."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return None
    out: dict[str, type | None] = {}
    for p in parameters:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        annotation = p.annotation
        name = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
        kind = _KINDS.get(name)
        if kind is None and p.default is not p.empty:
            kind = _KINDS.get(type(p.default).__name__)
        out[p.name] = kind
    return out


def _checked(name: str, kind: type | None, value: Any) -> Any:
    """`value` as the param takes it (an int for a float param: a float), or PluginError."""
    if kind is None:
        return value
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        try:
            finite = ok and math.isfinite(value)
        except OverflowError:  # an int past a float's range
            finite = False
        if ok and not finite:
            raise PluginError(f"must be a finite number, got {value!r}", name)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise PluginError(f"must be {_WANTED[kind]}, got {value!r}", name)
    return float(value) if kind is float else value


def _build(factory: Callable[..., P], params: Mapping[str, Any]) -> P:
    # Unknown names and wrong types first, in messages of our own: the compiled plugins
    # (`llmgw/native.py`) word them differently, and the Python sources took any type
    # (`calibrate: "false"`, a string, left calibration on).
    accepted = _params(factory)
    if accepted is not None:
        unknown = [name for name in params if name not in accepted]
        if unknown:
            raise PluginError(
                f"unknown param{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(repr(u) for u in unknown)} (accepted: {', '.join(accepted) or 'none'})"
            )
        params = {name: _checked(name, accepted[name], v) for name, v in params.items()}
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
