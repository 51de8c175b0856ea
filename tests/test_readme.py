"""The README, the user's manual, against the code: every config example loads, every
`llmgw` command line in it parses with that command's own parser (sections written by
different people drift: flags renamed, config keys moved)."""

from __future__ import annotations

import argparse
import re
import shlex
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

import llmgw.cli
from llmgw.config import load_dict
from llmgw.errors import ConfigError, NoCapacity
from llmgw.registry import Registry
from llmgw.request import build_request
from llmgw.scheduling.scheduler import Scheduler
from llmgw.types import EngineMetrics, Outcome, RequestInfo

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# Where the examples' model files (/models/...) are looked for: a path in the repository that
# is never there, so that no test reads outside it.
ABSENT = ROOT / ".scratch" / "readme-absent"
STUB_MODEL = {"stub": {"endpoints": ["127.0.0.1:8000"]}}


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def command_lines() -> list[str]:
    """`llmgw ...` lines of the shell examples: continuations joined, `[optional]` parts and
    comments dropped."""
    lines = []
    for block in blocks("sh"):
        for raw in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\[[^\]]*\]", "", raw).strip()
            if line.startswith("llmgw "):
                lines.append(line)
    return lines


class Parsed(Exception):
    """Raised instead of running the command once its arguments parsed."""


def test_the_readme_has_config_and_command_examples() -> None:
    assert len(blocks("yaml")) >= 3 and len(command_lines()) >= 5


@pytest.mark.parametrize("text", blocks("yaml"))
def test_every_config_example_loads(text: str) -> None:
    data: dict[str, Any] = yaml.safe_load(text.replace(" /models/", f" {ABSENT}/models/"))
    data.setdefault("models", STUB_MODEL)  # a fragment: one section of the config
    try:
        load_dict(data)
    except ConfigError as exc:
        # A file the example names on the user's machine (a model's tokenizer.json) is the one
        # thing it may miss here; every other problem is the example's.
        problems = [p for p in exc.problems if not re.search(r"cannot load '/[^']+'", p)]
        assert not problems, problems


@pytest.mark.parametrize("line", command_lines())
def test_every_command_line_parses(line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise Parsed(parse(self, *args, **kwargs))  # exits 2 on an unknown flag

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    argv = shlex.split(line, comments=True)[1:]
    with pytest.raises(Parsed):
        llmgw.cli.main(argv)


def configuration_example() -> dict[str, Any]:
    """The first YAML block under '## Configuration', as a user copies it."""
    section = README.split("## Configuration", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None
    example: dict[str, Any] = yaml.safe_load(block.group(1))
    return example


def test_the_configuration_examples_settings_are_read_by_their_models_strategies() -> None:
    """The example's `chat` (strategy latency) showed `saturation` ("429 when all"), an
    endpoint `weight: 2` and `session.bounded_load`, none of which its strategy reads
    (found by a review helper)."""
    example = configuration_example()
    config = load_dict(example)
    for name, raw in example["models"].items():
        strategy = config.models[name].strategy
        weighted = any(isinstance(e, dict) and "weight" in e for e in raw.get("endpoints", []))
        if weighted:
            assert "weight" in strategy.scorers, name
        if "saturation" in raw:
            assert "not-saturated" in strategy.filters, name
        if "bounded_load" in raw.get("session", {}):
            ring = strategy.scorers.get("session")
            reads = ring is not None and not ring.params.get("bounded_load")
            assert reads or "bounded-load" in strategy.filters, name


def _example_model(setting: str) -> tuple[str, dict[str, Any]]:
    """The example's model showing `setting` (its routing alone: no launch, no discovery)."""
    for name, raw in configuration_example()["models"].items():
        if setting in raw or any(isinstance(e, dict) and setting in e for e in raw["endpoints"]):
            return name, raw
    raise AssertionError(f"no model of the Configuration example shows {setting!r}")


def _scheduler(name: str, raw: dict[str, Any]) -> Scheduler:
    return Scheduler(load_dict({"models": {name: raw}}), Registry(clock=lambda: 1000.0), seed=7)


def _request(scheduler: Scheduler, name: str, text: str) -> RequestInfo:
    body = orjson.dumps({"model": name, "messages": [{"role": "user", "content": text}]})
    return build_request(scheduler.config, {}, "/v1/chat/completions", body)


def test_the_configuration_examples_saturation_gives_429_when_every_endpoint_is_past_it() -> None:
    """It sat on a `latency` model, which queues instead (found by a review helper)."""
    name, raw = _example_model("saturation")
    scheduler = _scheduler(name, raw)
    for state in scheduler.registry.states(name):
        scheduler.registry.record_scrape(
            name, state.id, EngineMetrics(waiting=500, running=256, kv_usage=1.0)
        )
    with pytest.raises(NoCapacity):
        scheduler.pick(_request(scheduler, name, "hello"))


def test_the_configuration_examples_weight_2_endpoint_gets_more_traffic() -> None:
    """It sat on a `latency` model, which split 200/200 (found by a review helper)."""
    name, raw = _example_model("weight")
    heavy = next(e["address"] for e in raw["endpoints"] if isinstance(e, dict))
    scheduler = _scheduler(name, raw)
    counts: Counter[str] = Counter()
    for i in range(400):  # distinct prompts, each released before the next
        decision = scheduler.pick(_request(scheduler, name, f"question {i} " * 20))
        lease = scheduler.acquire(decision)
        counts[decision.endpoint.address] += 1
        lease.finish(Outcome.SUCCESS)
    light = next(a for a in counts if a != heavy)
    assert counts[heavy] > 1.3 * counts[light], counts
