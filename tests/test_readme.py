"""The README, the user's manual, against the code: every config example loads, every
`llmgw` command line in it parses with that command's own parser (sections written by
different people drift: flags renamed, config keys moved)."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

import llmgw.cli
from llmgw.config import load_dict
from llmgw.errors import ConfigError

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
