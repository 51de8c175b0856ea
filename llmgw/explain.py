"""`llmgw explain`: an Explanation as JSON (the admin endpoint's answer) and as a table.

    request = explain_request(config, {"model": "chat", "session": "u1", "prompt": "hi"})
    data = explanation_dict(scheduler.explain(request))     # what /admin/explain returns
    print(render_table(data))                                # what the CLI prints

Pure: the admin endpoint (llmgw.runtime.admin) and the CLI share it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from llmgw.config import Config
from llmgw.errors import BadRequest
from llmgw.request import build_request
from llmgw.scheduling.scheduler import Explanation
from llmgw.types import RequestInfo

EXPLAIN_PATH = "/admin/explain"


def explain_request(config: Config, query: Any) -> RequestInfo:
    """The RequestInfo an edge would build for the request `query` describes:

    {"model": str, "session": str?, "prompt": str? | "body": {...}?, "path": str?,
     "headers": {str: str}?}

    `session` goes in the model's first session header; without `body`, the prompt
    becomes one user message. Raises BadRequest naming the field to fix.
    """
    if not isinstance(query, Mapping):
        raise BadRequest("explain query must be a JSON object")
    model, session, prompt = query.get("model"), query.get("session"), query.get("prompt")
    body, path = query.get("body"), query.get("path", "/v1/chat/completions")
    extra = query.get("headers", {})
    if not isinstance(path, str) or not path.startswith("/"):
        raise BadRequest("field 'path' must be a path starting with '/'")
    if not isinstance(extra, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in extra.items()
    ):
        raise BadRequest("field 'headers' must map header names to string values")
    headers = {k.lower(): v for k, v in extra.items()}
    if body is None:
        if not isinstance(model, str) or not model:
            raise BadRequest("give 'model' (a string), or a 'body' naming one")
        if prompt is not None and not isinstance(prompt, str):
            raise BadRequest("field 'prompt' must be a string")
        body = {"model": model, "messages": [{"role": "user", "content": prompt or ""}]}
    elif not isinstance(body, Mapping):
        raise BadRequest("field 'body' must be a JSON object (an OpenAI request body)")
    elif isinstance(model, str) and model:
        body = {**body, "model": model}  # --model overrides the file's
    name = body.get("model")
    if session is not None:
        if not isinstance(session, str):
            raise BadRequest("field 'session' must be a string")
        spec = config.models.get(name) if isinstance(name, str) else None
        headers[spec.session.headers[0] if spec is not None else "x-session-id"] = session
    return build_request(config, headers, path, orjson.dumps(body))


def explanation_dict(explanation: Explanation) -> dict[str, Any]:
    """Per endpoint: each filter's verdict, each scorer's raw x weight, the total, the
    predicted TTFT (latency scorer), and its role (pick, fallback N, or nothing)."""
    decision, error = explanation.decision, explanation.error
    filters = [name for name, _ in explanation.dropped]
    verdicts: dict[str, dict[str, str]] = {eid: {} for eid in explanation.endpoint_ids}
    out_of_play: set[str] = set()
    for name, dropped in explanation.dropped:
        for eid, verdict in verdicts.items():
            if eid not in out_of_play:
                verdict[name] = "drop" if eid in dropped else "pass"
        out_of_play.update(dropped)
    roles: dict[str, str] = {}
    scored: dict[str, dict[str, Any]] = {}
    rationale = decision.rationale if decision is not None else None
    if decision is not None and rationale is not None:
        roles[decision.endpoint.id] = "pick"
        for i, fallback in enumerate(decision.fallbacks, 1):
            roles[fallback.id] = f"fallback {i}"
        for i, eid in enumerate(rationale.endpoint_ids):
            row: dict[str, Any] = {"total": rationale.totals[i], "scores": {}}
            for column in rationale.columns:
                terms = column.terms_at(i)
                row["scores"][column.name] = {
                    "raw": column.raw[i],
                    "weight": column.weight,
                    "weighted": column.raw[i] * column.weight,
                    **({"terms": terms} if terms else {}),
                }
                if "ttft_s" in terms:
                    row["predicted_ttft_ms"] = terms["ttft_s"] * 1e3
            scored[eid] = row
    endpoints = [
        {
            "endpoint": eid,
            "role": roles.get(eid, ""),
            "filters": verdicts[eid],
            **scored.get(eid, {"total": None, "scores": {}}),
        }
        for eid in explanation.endpoint_ids
    ]
    request = explanation.request
    return {
        "model": request.model,
        "session": request.session_key is not None,
        "prompt_tokens": request.prompt_tokens,
        "strategy": rationale.strategy if rationale is not None else None,
        "picker": rationale.picker if rationale is not None else None,
        "pick": decision.endpoint.id if decision is not None else None,
        "fallbacks": [e.id for e in decision.fallbacks] if decision is not None else [],
        "filters": filters,
        "error": (
            {"status": error.status, "code": error.code, "message": error.message}
            if error is not None
            else None
        ),
        "endpoints": endpoints,
    }


def _num(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render_table(data: Mapping[str, Any]) -> str:
    """The explanation as a plain-text table, one row per endpoint."""
    endpoints: list[Mapping[str, Any]] = data["endpoints"]
    filters: list[str] = data["filters"]
    scorers: list[str] = []
    for row in endpoints:
        scorers.extend(n for n in row["scores"] if n not in scorers)
    weights = {
        n: row["scores"][n]["weight"] for row in endpoints for n in row["scores"] if n in scorers
    }
    head = ["endpoint", *filters, *[f"{n} x{weights[n]:g}" for n in scorers]]
    head += ["total", "ttft ms", "role"]
    rows = [head]
    for row in endpoints:
        cells = [row["endpoint"], *[row["filters"].get(f, "-") for f in filters]]
        for n in scorers:
            score = row["scores"].get(n)
            cells.append("-" if score is None else f"{score['raw']:.3f} = {score['weighted']:.3f}")
        cells += [_num(row["total"], ".3f"), _num(row.get("predicted_ttft_ms"), ".1f")]
        cells.append(row["role"])
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        f"model {data['model']}  strategy {data['strategy'] or '-'}  picker "
        f"{data['picker'] or '-'}  prompt {data['prompt_tokens']} tokens  "
        f"session {'yes' if data['session'] else 'no'}",
        "",
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.append("")
    if data["error"] is not None:
        err = data["error"]
        lines.append(f"refused: {err['status']} {err['code']}: {err['message']}")
    else:
        fallbacks = ", ".join(data["fallbacks"]) or "none"
        lines.append(f"pick {data['pick']}  fallbacks {fallbacks}")
    return "\n".join(lines)
