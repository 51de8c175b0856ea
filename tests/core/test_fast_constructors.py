"""The per-pick constructors of `llmgw.types` build the very objects the dataclass
constructors build: every field set, equal, still frozen."""

from __future__ import annotations

import dataclasses

import pytest

from llmgw.types import (
    Decision,
    Endpoint,
    Rationale,
    ScorerColumn,
    new_decision,
    new_rationale,
    new_scorer_column,
)


def test_fast_constructors_build_equal_frozen_values_with_every_field_set() -> None:
    column_args = ("latency", 1.0, (0.5, 1.0), ("ttft_s",), [(0.1,), (0.2,)])
    column = new_scorer_column(*column_args)
    assert column == ScorerColumn(*column_args)
    why_args = ("latency", "max-score", ("a", "b"), (column,), (0.5, 1.0), (("healthy", 0),), 2)
    why = new_rationale(*why_args)
    assert why == Rationale(*why_args)
    endpoint = Endpoint("10.0.0.1:8000", "m")
    decision_args = ("m", endpoint, (Endpoint("10.0.0.2:8000", "m"),), why, 1.5, 0.25, 128.0, 9.0)
    decision = new_decision(*decision_args)
    assert decision == Decision(*decision_args)
    for value, args in ((column, column_args), (why, why_args), (decision, decision_args)):
        fields = [f.name for f in dataclasses.fields(value)]
        assert len(fields) == len(args)  # a new field must be added to its constructor too
        assert [getattr(value, f) for f in fields] == list(args)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, fields[0], None)
