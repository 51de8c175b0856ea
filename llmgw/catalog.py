"""`GET /v1/models` in OpenAI's list shape, for both edges (pure: the caller passes state).

Every configured model is listed; an on-demand model also says its activation state
(`llmgw.state`: stopped, starting, running, failed...), so a client can tell a model it
may call from one that will make it wait. Extra fields are allowed by OpenAI's schema.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson

from llmgw.config import Config, model_mode
from llmgw.errors import LlmgwError, ModelNotFound

MODELS_PATH = "/v1/models"


def _entry(
    name: str, config: Config, status: Mapping[str, Mapping[str, object]]
) -> dict[str, object]:
    extra: dict[str, object] = {"mode": model_mode(config.models[name]).value}
    state = status.get(name, {}).get("state")
    if state is not None:
        extra["state"] = state
    return {"id": name, "object": "model", "created": 0, "owned_by": "llmgw", "llmgw": extra}


def model_list(config: Config, status: Mapping[str, Mapping[str, object]] | None = None) -> bytes:
    """The `/v1/models` body; `status`: per on-demand model its activation status."""
    status = status or {}
    data = [_entry(name, config, status) for name in config.models]
    return orjson.dumps({"object": "list", "data": data})


def model_entry(
    config: Config, model: str, status: Mapping[str, Mapping[str, object]] | None = None
) -> bytes:
    """The `/v1/models/{model}` body; raises ModelNotFound (404) for an unknown model."""
    if model not in config.models:
        raise ModelNotFound.unknown(model, config.models)
    return orjson.dumps(_entry(model, config, status or {}))


def is_catalog_path(path: str) -> bool:
    return path == MODELS_PATH or path.startswith(MODELS_PATH + "/")


def catalog_answer(
    config: Config, path: str, status: Mapping[str, Mapping[str, object]] | None = None
) -> tuple[int, bytes] | None:
    """(HTTP status, JSON body) for `GET /v1/models` and `/v1/models/{model}` on either
    edge; None for any other path."""
    if path == MODELS_PATH:
        return 200, model_list(config, status)
    if not is_catalog_path(path):
        return None
    try:
        return 200, model_entry(config, path[len(MODELS_PATH) + 1 :], status)
    except LlmgwError as exc:
        return exc.status, exc.body()
