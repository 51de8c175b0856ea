"""`llmgw check-config`: a bad file is a path-named report and exit status 2, never a
traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.cli import main

CRASHERS = {
    "launch-attribute-placeholder": (
        "models:\n  big:\n    launch: {command: 'vllm serve x --port {port.foo}'}\n"
        "    scaling: {max: 1}\n",
        "models.big.launch.command: unknown placeholder {port.foo}",
    ),
    "launch-index-placeholder": (
        "models:\n  big:\n    launch: {command: 'vllm serve x --port {port[0]}'}\n"
        "    scaling: {max: 1}\n",
        "models.big.launch.command: unknown placeholder {port[0]}",
    ),
    "picker-shorthand-params-list": (
        "models:\n  chat:\n    endpoints: [10.0.0.1:8000]\n"
        "    strategy: {picker: {type: softmax, temperature: 0.2, params: [1]}}\n",
        "models.chat.strategy.picker.params: Input should be a valid dictionary",
    ),
}


@pytest.mark.parametrize(("text", "problem"), list(CRASHERS.values()), ids=list(CRASHERS))
def test_check_config_reports_a_malformed_file_instead_of_a_traceback(
    text: str, problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each escaped as a raw AttributeError or TypeError traceback (found by a review
    helper)."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "invalid" in err and problem in err


def test_a_reader_that_left_is_exit_1_without_a_traceback(tmp_path: Path) -> None:
    """`llmgw explain --json | head` (any command whose output is cut short by its reader)
    ended in a BrokenPipeError traceback (found by a review helper)."""
    path = tmp_path / "c.yaml"
    path.write_text("models: {m: {endpoints: ['10.0.0.1:8000']}}\n")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before a byte is written
    try:
        done = subprocess.run(
            [sys.executable, "-m", "llmgw.cli", "check-config", str(path)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert done.returncode == 1
    assert b"Traceback" not in done.stderr, done.stderr.decode()
