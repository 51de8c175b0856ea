"""`/v1/models` in OpenAI's list shape, with on-demand models' activation state."""

from __future__ import annotations

import orjson
import pytest

from llmgw.catalog import model_entry, model_list
from llmgw.config import load_dict
from llmgw.errors import ModelNotFound

CONFIG = load_dict(
    {
        "models": {
            "static": {"endpoints": ["10.0.0.1:8000"]},
            "lazy": {"launch": {"command": "true {port}"}, "scaling": {"min": 0, "max": 1}},
        }
    }
)


def test_lists_every_model_in_openai_shape_with_on_demand_state() -> None:
    body = orjson.loads(model_list(CONFIG, {"lazy": {"state": "starting", "waiters": 2}}))
    assert body["object"] == "list"
    by_id = {m["id"]: m for m in body["data"]}
    assert set(by_id) == {"static", "lazy"}
    assert all(m["object"] == "model" and m["owned_by"] == "llmgw" for m in body["data"])
    assert by_id["lazy"]["llmgw"] == {"mode": "on_demand", "state": "starting"}
    assert by_id["static"]["llmgw"] == {"mode": "static"}


def test_one_model_or_404_naming_the_configured_ones() -> None:
    assert orjson.loads(model_entry(CONFIG, "static"))["id"] == "static"
    with pytest.raises(ModelNotFound, match="configured models: lazy, static") as caught:
        model_entry(CONFIG, "nope")
    assert caught.value.status == 404
