from __future__ import annotations

import io
import logging

import orjson
import pytest

from llmgw.config import load_dict
from llmgw.logs import JsonFormatter, configure, log_decision
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


def test_json_format_covers_other_libraries_lines_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--log-format json` formatted only llmgw's loggers: uvicorn's start-up lines and other
    libraries' warnings stayed text in a stream promised as one JSON object a line. Found
    by a review helper."""
    for name in ("", "llmgw", "uvicorn", "uvicorn.error", "uvicorn.access"):  # restored after
        logger = logging.getLogger(name)
        monkeypatch.setattr(logger, "handlers", list(logger.handlers))
        monkeypatch.setattr(logger, "level", logger.level)
        monkeypatch.setattr(logger, "propagate", logger.propagate)
    configure("info", "json")
    logging.getLogger("uvicorn.error").setLevel(logging.INFO)  # uvicorn sets it (--log-level)
    logging.getLogger("uvicorn.error").info(
        "Started server process [%d]", 42, extra={"color_message": "\x1b[1m%d\x1b[0m"}
    )  # uvicorn passes its message again in colour: no field of the JSON line
    logging.getLogger("asyncio").warning("a library's warning")
    logging.getLogger("asyncio").info("a library's info line: below warning, not shown")
    logging.getLogger("llmgw.proxy").info("ours")
    lines = capsys.readouterr().err.splitlines()
    assert not any("color_message" in orjson.loads(line) for line in lines)
    assert [orjson.loads(line)["msg"] for line in lines] == [
        "Started server process [42]",
        "a library's warning",
        "ours",
    ]
