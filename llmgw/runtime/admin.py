"""`POST /admin/explain` on both edges: where the request in the body would go now, and why.

Off unless the config says `admin: {explain: true}`. Read-only: `Scheduler.explain` runs
the pick on a shadow of the live router (no inflight charge, no prefix learning). It runs
on the server's event loop between two awaits, so it sees one consistent registry.
"""

from __future__ import annotations

import orjson

from llmgw.errors import BadRequest, BodyTooLarge, LlmgwError, RouteNotFound
from llmgw.explain import EXPLAIN_PATH, explain_request, explanation_dict
from llmgw.gateway import Gateway

__all__ = ["EXPLAIN_PATH", "explain"]

MAX_QUERY_BYTES = 8 * 1024 * 1024 + 65536  # a body file plus the query around it


def explain(gateway: Gateway, body: bytes) -> tuple[int, bytes]:
    """(HTTP status, JSON body) for one explain query."""
    snapshot = gateway.snapshot
    try:
        if not snapshot.config.admin.explain:
            raise RouteNotFound(
                f"{EXPLAIN_PATH} is off: set `admin: {{explain: true}}` in the config"
            )
        if len(body) > MAX_QUERY_BYTES:
            raise BodyTooLarge(f"explain query is over {MAX_QUERY_BYTES} bytes")
        try:
            query = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"explain query is not valid JSON: {exc}") from None
        request = explain_request(snapshot.config, query)
        explanation = snapshot.scheduler.explain(request)
    except LlmgwError as exc:
        return exc.status, exc.body()
    return 200, orjson.dumps(explanation_dict(explanation))
