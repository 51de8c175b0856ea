"""A strategy as the config names it: filters, weighted scorers and a picker, each with
params, every name and every params dict checked against the plugin registry at load."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    field_validator,
    model_validator,
)

from llmgw.scheduling.plugins import (
    FILTERS,
    PICKERS,
    SCORERS,
    PluginError,
    make_picker,
    make_scorer,
)

# Any value: the plugin's own signature says which type each param takes (`plugins._build`);
# a union here put pydantic's member names in the paths (`params.step_ms.float`, `.int`, ...).
Params = dict[str, Any]


def _at(exc: PluginError) -> str:
    return f".{exc.param}" if exc.param is not None else ""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class PickerSpec(_Strict):
    type: str = "max-score"
    params: Params = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _params_shorthand(cls, value: Any) -> Any:
        # `{type: softmax, temperature: 0.2}` means `{type: softmax, params: {temperature: 0.2}}`.
        if isinstance(value, str):
            return {"type": value}
        if isinstance(value, Mapping) and set(value) - {"type", "params"}:
            params = {k: v for k, v in value.items() if k not in ("type", "params")}
            given = value.get("params")
            if given is None:
                given = {}
            if not isinstance(given, Mapping):  # left for pydantic to say (a TypeError here)
                return {"type": value.get("type", "max-score"), "params": given}
            twice = sorted(set(params) & set(given))
            if twice:  # one of the two silently won
                raise ValueError(f"params.{twice[0]}: given twice, beside type and in params")
            return {"type": value.get("type", "max-score"), "params": {**params, **given}}
        return value


class ScorerSpec(_Strict):
    weight: StrictFloat = Field(default=1.0, ge=0)
    params: Params = Field(default_factory=dict)


class StrategySpec(_Strict):
    """Explicit scorer weights (`{queue: 1, kv: {weight: 2, params: {ceiling: 0.9}}}`) + picker."""

    # It goes into the x-llmgw-decision header and metric labels: a token, not free text
    # (a newline in it broke every response with debug headers on).
    name: str = Field(default="custom", pattern=r"^[A-Za-z0-9._-]{1,64}$")
    scorers: dict[str, ScorerSpec] = Field(default_factory=dict)
    picker: PickerSpec = PickerSpec()
    filters: tuple[str, ...] = ("healthy", "model-serves", "not-saturated")

    @field_validator("scorers", mode="before")
    @classmethod
    def _weights(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: {"weight": v} if isinstance(v, int | float) else v for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _known_plugins(self) -> StrategySpec:
        # Bad names and params fail here, with a path, not when the scheduler starts.
        for name, scorer in self.scorers.items():
            if name not in SCORERS:
                raise ValueError(f"scorers.{name}: unknown scorer (known: {', '.join(SCORERS)})")
            try:
                make_scorer(name, scorer.params)
            except PluginError as exc:
                raise ValueError(f"scorers.{name}.params{_at(exc)}: {exc}") from None
        if self.picker.type not in PICKERS:
            raise ValueError(
                f"picker.type: unknown picker {self.picker.type!r} (known: {', '.join(PICKERS)})"
            )
        try:
            make_picker(self.picker.type, self.picker.params)
        except PluginError as exc:
            raise ValueError(f"picker.params{_at(exc)}: {exc}") from None
        for i, name in enumerate(self.filters):
            if name not in FILTERS:
                raise ValueError(
                    f"filters.{i}: unknown filter {name!r} (known: {', '.join(FILTERS)})"
                )
        return self
