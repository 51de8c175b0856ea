"""`llmgw demo` refuses a bad strategy or trace path before it starts anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.cli.demo import main


@pytest.mark.parametrize(
    ("argv", "phrase"),
    [
        (["--strategy", "bogus"], "invalid choice: 'bogus'"),
        (["--trace", "{missing}/x.jsonl"], "does not exist"),
        (["--trace", "{tmp}"], "is a directory"),
    ],
)
def test_bad_arguments_exit_2_before_the_fleet_starts(
    argv: list[str], phrase: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad --strategy was a ConfigError traceback after the fleet started; a bad --trace
    lost every line, then the demo said where the trace was."""
    args = [a.format(missing=tmp_path / "missing", tmp=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert phrase in captured.err and "starting" not in captured.out
