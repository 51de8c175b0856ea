"""Structured logging: `--log-format json` gives one JSON object a line; decisions at debug."""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson

from llmgw.types import Decision

# uvicorn passes its message again with ANSI colours (`color_message`): not for a log line.
_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "color_message",
}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _RESERVED})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def configure(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    own = logging.getLogger("llmgw")
    own.handlers[:] = [handler]
    own.setLevel(level.upper())
    own.propagate = False
    if fmt == "json":
        # Every other library's records too (uvicorn's, asyncio's, grpc's, aiohttp's): one
        # JSON object a line means all lines; the edges hand uvicorn no text handlers.
        root = logging.getLogger()
        root.handlers[:] = [handler]
        root.setLevel(max(logging.WARNING, own.level))  # others' info lines: not ours
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):  # no text handlers
            uvicorn = logging.getLogger(name)
            uvicorn.handlers[:] = []
            uvicorn.propagate = True
        logging.getLogger("uvicorn").setLevel(own.level)  # its start-up lines, as before


_decisions = logging.getLogger("llmgw.decision")


def log_decision(decision: Decision, request_id: str, edge: str) -> None:
    """One debug line per decision, with the rationale (cheap when debug is off)."""
    if _decisions.isEnabledFor(logging.DEBUG):
        _decisions.debug(
            "decision",
            extra={
                "edge": edge,
                "request_id": request_id,
                "model": decision.model,
                "endpoint": decision.endpoint.address,
                "fallbacks": [e.address for e in decision.fallbacks],
                "rationale": decision.rationale.as_dict(),
            },
        )
