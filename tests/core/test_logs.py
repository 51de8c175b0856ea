from __future__ import annotations

import io
import logging

import orjson

from llmgw.config import load_dict
from llmgw.logs import JsonFormatter, log_decision
from llmgw.scheduling.scheduler import Scheduler
from llmgw.types import RequestInfo


def test_decision_is_logged_as_one_json_line_with_its_rationale() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("llmgw.decision")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        config = load_dict({"models": {"m": {"endpoints": ["127.0.0.1:1", "127.0.0.1:2"]}}})
        decision = Scheduler(config, seed=3).pick(RequestInfo(model="m", request_id="r1"))
        log_decision(decision, "r1", "test")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    entry = orjson.loads(lines[0])
    assert entry["request_id"] == "r1" and entry["endpoint"] == decision.endpoint.address
    assert set(entry["rationale"]["scores"]) == {"127.0.0.1:1", "127.0.0.1:2"}
    assert entry["rationale"]["filter_drops"] == {
        "healthy": 0,
        "model-serves": 0,
        "blind-imbalance": 0,
    }
