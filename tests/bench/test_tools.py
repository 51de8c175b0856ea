"""bench/_tools.py: the load tools' outputs parsed into one shape."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench._tools import parse_h2load

H2LOAD = (
    "finished in 1.00s, 90.00 req/s, 10KB/s\n"
    "requests: 100 total, 100 started, 100 done, 85 succeeded, 15 failed, 10 errored, "
    "0 timeout\n"
    "status codes: 85 2xx, 0 3xx, 0 4xx, 5 5xx\n"
)


def test_h2load_failed_counts_errored_requests_once() -> None:
    """h2load's `errored` is a subset of its `failed` (the 5xx answers and the network
    errors); they were added: 10 errors read as 20 more failures. (found by a review
    helper)"""
    parsed = parse_h2load(H2LOAD)
    assert (parsed["requests"], parsed["succeeded"], parsed["failed"]) == (100, 85, 15)
    assert parsed["status_non_2xx"] == 5
