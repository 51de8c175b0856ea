"""Just enough PromQL to draw deploy/grafana/llmgw.json without a Prometheus server.

Hand-written because nothing here can evaluate PromQL (no Prometheus binary; the PyPI
packages found only build queries or call a server), and the dashboard uses 9 constructs:
selectors with =, !=, =~, !~ matchers; `[range]`; rate, increase; sum/max/min/avg `by`;
histogram_quantile; + - * / between vectors with the same labels, or with a number.

    store = Store(); store.ingest(t, text, {"instance": "10.0.0.1:8000"})
    series = evaluate(expr, store, t, variables={"$model": ".*", "$__rate_interval": "10s"})
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
Vector = dict[Labels, float]

_TOKEN = re.compile(
    r"\s*(?:(?P<num>\d+(?:\.\d+)?(?![\w:]))|(?P<dur>\d+[smhd])|(?P<name>[A-Za-z_:][\w:]*)"
    r'|(?P<str>"(?:[^"\\]|\\.)*")|(?P<op>=~|!~|!=|[-+*/(){}\[\],=]))'
)
_AGGS: dict[str, Callable[[list[float]], float]] = {
    "sum": sum,
    "max": max,
    "min": min,
    "avg": lambda v: sum(v) / len(v),
}
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass
class Store:
    """Samples by series: (name, labels) -> [(t, value)] in time order."""

    series: dict[tuple[str, Labels], list[tuple[float, float]]] = field(
        default_factory=lambda: defaultdict(list)
    )

    def ingest(self, t: float, text: str, extra: dict[str, str] | None = None) -> None:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = {**sample.labels, **(extra or {})}
                key = (sample.name, tuple(sorted(labels.items())))
                self.series[key].append((t, float(sample.value)))


def tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr.rstrip()):
        m = _TOKEN.match(expr, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"cannot read {expr[pos : pos + 20]!r}")
        kind = m.lastgroup or "op"
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, expr: str) -> None:
        self.toks = tokens(expr)
        self.i = 0

    def peek(self) -> str | None:
        return self.toks[self.i][1] if self.i < len(self.toks) else None

    def take(self, want: str | None = None) -> str:
        _, value = self.toks[self.i]
        if want is not None and value != want:
            raise ValueError(f"expected {want!r}, got {value!r}")
        self.i += 1
        return value

    def expr(self) -> Any:
        node = self.term()
        while self.peek() in ("+", "-"):
            node = ("bin", self.take(), node, self.term())
        return node

    def term(self) -> Any:
        node = self.unary()
        while self.peek() in ("*", "/"):
            node = ("bin", self.take(), node, self.unary())
        return node

    def unary(self) -> Any:
        kind, value = self.toks[self.i]
        if kind == "num":
            self.i += 1
            return ("num", float(value))
        if value == "(":
            self.take("(")
            node = self.expr()
            self.take(")")
            return node
        self.i += 1
        if value in _AGGS:
            by: list[str] = []
            if self.peek() == "by":
                self.take("by")
                by = self.labels()
            self.take("(")
            inner = self.expr()
            self.take(")")
            return ("agg", value, tuple(by), inner)
        if self.peek() == "(":
            self.take("(")
            args = [self.expr()]
            while self.peek() == ",":
                self.take(",")
                args.append(self.expr())
            self.take(")")
            return ("call", value, args)
        matchers: list[tuple[str, str, str]] = []
        if self.peek() == "{":
            self.take("{")
            while self.peek() != "}":
                label, op = self.take(), self.take()
                matchers.append((label, op, self.take()[1:-1]))
                if self.peek() == ",":
                    self.take(",")
            self.take("}")
        window = None
        if self.peek() == "[":
            self.take("[")
            dur = self.take()
            window = float(dur[:-1]) * _SECONDS[dur[-1]]
            self.take("]")
        return ("sel", value, tuple(matchers), window)

    def labels(self) -> list[str]:
        self.take("(")
        out = [self.take()]
        while self.peek() == ",":
            self.take(",")
            out.append(self.take())
        self.take(")")
        return out


def _matches(labels: dict[str, str], matchers: tuple[tuple[str, str, str], ...]) -> bool:
    for label, op, value in matchers:
        have = labels.get(label, "")
        ok = {
            "=": have == value,
            "!=": have != value,
            "=~": re.fullmatch(value, have) is not None,
            "!~": re.fullmatch(value, have) is None,
        }[op]
        if not ok:
            return False
    return True


def _eval(node: Any, store: Store, t: float, lookback: float) -> Vector | float:
    kind = node[0]
    if kind == "num":
        return float(node[1])
    if kind == "sel":
        _, name, matchers, window = node
        out: Vector = {}
        for (series, labels), points in store.series.items():
            if series != name or not _matches(dict(labels), matchers):
                continue
            span = [p for p in points if t - abs(window or lookback) < p[0] <= t]
            if not span:
                continue
            if window is None:
                out[labels] = span[-1][1]
            elif len(span) >= 2:  # the rise over the window (no extrapolation), and its slope
                rise = span[-1][1] - span[0][1]
                out[labels] = rise if window < 0 else rise / (span[-1][0] - span[0][0])
        return out
    if kind == "call":
        _, func, args = node
        if func in ("rate", "increase"):
            _, name, matchers, window = args[0]
            # A negative window asks the selector for the rise instead of the slope.
            vec = _eval(("sel", name, matchers, -window if func == "increase" else window),
                        store, t, lookback)  # fmt: skip
            assert isinstance(vec, dict)
            return vec
        if func == "histogram_quantile":
            q = _eval(args[0], store, t, lookback)
            vec = _eval(args[1], store, t, lookback)
            assert isinstance(q, float) and isinstance(vec, dict)
            return _quantile(q, vec)
        raise ValueError(f"unsupported function {func}")
    if kind == "agg":
        _, op, by, inner = node
        vec = _eval(inner, store, t, lookback)
        assert isinstance(vec, dict)
        groups: dict[Labels, list[float]] = defaultdict(list)
        for labels, value in vec.items():
            groups[tuple((a, b) for a, b in labels if a in by)].append(value)
        return {k: _AGGS[op](v) for k, v in groups.items()}
    _, op, left_node, right_node = node
    left = _eval(left_node, store, t, lookback)
    right = _eval(right_node, store, t, lookback)
    return _binary(op, left, right)


def _apply(op: str, a: float, b: float) -> float:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a / b if b else math.nan


def _binary(op: str, left: Vector | float, right: Vector | float) -> Vector | float:
    if isinstance(left, float) and isinstance(right, float):
        return _apply(op, left, right)
    if isinstance(left, float):
        assert isinstance(right, dict)
        return {k: _apply(op, left, v) for k, v in right.items()}
    if isinstance(right, float):
        return {k: _apply(op, v, right) for k, v in left.items()}
    return {k: _apply(op, v, right[k]) for k, v in left.items() if k in right}


def _quantile(q: float, vec: Vector) -> Vector:
    groups: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
    for labels, value in vec.items():
        bound = dict(labels).get("le")
        if bound is None:
            continue
        groups[tuple((a, b) for a, b in labels if a != "le")].append((float(bound), value))
    out: Vector = {}
    for labels, buckets in groups.items():
        buckets.sort()
        total = buckets[-1][1]
        if total <= 0:
            continue
        rank, prev_le, prev_count = q * total, 0.0, 0.0
        for le, count in buckets:
            if count >= rank:
                if math.isinf(le):
                    out[labels] = prev_le
                else:
                    width = count - prev_count
                    lower = prev_le if prev_le or le > 0 else le
                    share = (rank - prev_count) / width if width else 1.0
                    out[labels] = lower + (le - lower) * share
                break
            prev_le, prev_count = le, count
    return out


def evaluate(expr: str, store: Store, t: float, variables: dict[str, str]) -> Vector:
    """The instant vector of `expr` at `t` (variables replaced textually first)."""
    for name, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(name, value)
    parser = _Parser(expr)
    node = parser.expr()
    result = _eval(node, store, t, lookback=30.0)
    return result if isinstance(result, dict) else {(): result}
