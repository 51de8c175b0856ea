"""Suite-wide: the header says whether the scheduler's compiled modules run (`llmgw/native.py`)."""

from __future__ import annotations

from llmgw import native


def pytest_report_header() -> str:
    return f"llmgw scheduler modules: {native.STATUS.reason}"
