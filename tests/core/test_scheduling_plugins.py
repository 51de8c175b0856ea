"""The plugin registry: params checked by name and type, alike with or without the compiled
modules."""

from __future__ import annotations

import ast
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from llmgw.native import source_of
from llmgw.scheduling import plugins
from llmgw.scheduling.pickers import SoftmaxPicker
from llmgw.scheduling.plugins import PICKERS, SCORERS, PluginError, make_picker, make_scorer

PACKAGE = Path(plugins.__file__).resolve().parents[1]
FACTORIES: dict[str, Callable[..., Any]] = {
    **{f"scorer {n}": f for n, f in SCORERS.items()},
    **{f"picker {n}": f for n, f in PICKERS.items()},
}


def declared(factory: Callable[..., Any]) -> dict[str, tuple[str, type]]:
    """Each __init__ param's annotation and its default's type, read from the source (a
    compiled class keeps neither annotations nor its source)."""
    tree = ast.parse(source_of(PACKAGE, factory.__module__).read_text())
    cls = next(
        n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == factory.__name__
    )
    init = next(
        (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None
    )
    if init is None:
        return {}
    args = init.args.args[1:]
    defaults = [None] * (len(args) - len(init.args.defaults)) + list(init.args.defaults)
    out: dict[str, tuple[str, type]] = {}
    for arg, default in zip(args, defaults, strict=True):
        assert arg.annotation is not None and default is not None, arg.arg
        out[arg.arg] = (ast.unparse(arg.annotation), type(ast.literal_eval(default)))
    return out


@pytest.mark.parametrize("factory", list(FACTORIES.values()), ids=list(FACTORIES))
def test_every_param_has_one_kind_in_the_sources_and_the_compiled_build(
    factory: Callable[..., Any],
) -> None:
    """The sources' annotations and the compiled class's defaults (all mypyc keeps) must
    name one type, or a config would load with one build and not the other."""
    kinds = plugins._params(factory)
    assert kinds is not None
    for name, (annotation, default) in declared(factory).items():
        assert annotation == default.__name__, f"{name}: {annotation} = a {default.__name__}"
        assert kinds[name] is default, name
    assert set(kinds) == set(declared(factory))


@pytest.mark.parametrize(
    ("name", "params", "param", "message"),
    [
        ("latency", {"step_ms": "30"}, "step_ms", "must be a number, got '30'"),
        ("latency", {"step_ms": True}, "step_ms", "must be a number, got True"),
        ("latency", {"step_ms": math.nan}, "step_ms", "must be a finite number, got nan"),
        ("latency", {"step_ms": math.inf}, "step_ms", "must be a finite number, got inf"),
        ("latency", {"calibrate": "false"}, "calibrate", "must be true or false, got 'false'"),
        ("latency", {"calibrate": 0}, "calibrate", "must be true or false, got 0"),
        ("latency", {"block_tokens": 64.0}, "block_tokens", "must be a whole number, got 64.0"),
        ("latency", {"block_tokens": True}, "block_tokens", "must be a whole number, got True"),
        ("latency", {"tokenizer": 3}, "tokenizer", "must be a string, got 3"),
        ("session", {"bounded_load": True}, "bounded_load", "must be a number, got True"),
        (
            "session",
            {"abstain_without_session": "no"},
            "abstain_without_session",
            "must be true or false, got 'no'",
        ),
    ],
)
def test_a_param_of_the_wrong_type_is_refused_naming_it(
    name: str, params: dict[str, Any], param: str, message: str
) -> None:
    """The Python sources took any type (`calibrate: "false"`, a string, left calibration
    on; `session` `bounded_load: true` raised on every pick), the compiled build refused it
    in words not naming the param (found by a review helper)."""
    with pytest.raises(PluginError) as info:
        make_scorer(name, params)
    assert (info.value.param, str(info.value)) == (param, message)


def test_an_int_for_a_float_param_reaches_the_plugin_as_a_float() -> None:
    picker = make_picker("softmax", {"temperature": 1})
    assert isinstance(picker, SoftmaxPicker) and type(picker.temperature) is float
