"""Suite-wide: the header says whether the scheduler's compiled modules run (`llmgw/native.py`);
the `ci` Hypothesis profile."""

from __future__ import annotations

import os

from hypothesis import settings

from llmgw import native

# CI gates a landing: there the property tests draw the same examples on every run, so a
# failure is a change's, reproducible, and not a draw's luck. Elsewhere (`make test` on a
# developer's machine) each run draws new examples; what one finds becomes a named test.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("LLMGW_CI"):
    settings.load_profile("ci")


def pytest_report_header() -> str:
    mode = "derandomized (LLMGW_CI)" if os.environ.get("LLMGW_CI") else "random"
    return f"llmgw scheduler modules: {native.STATUS.reason}\nhypothesis examples: {mode}"
