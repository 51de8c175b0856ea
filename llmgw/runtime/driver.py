"""The async step of a request's lifecycle: wait (bounded) for an on-demand model once.

result = lifecycle.route(headers, path, body)
if isinstance(result, AwaitActivation):
    result = await activate(lifecycle, result)    # Decision | LlmgwError
"""

from __future__ import annotations

from llmgw.errors import LlmgwError
from llmgw.lifecycle import AwaitActivation, Lifecycle
from llmgw.types import Decision


async def activate(lifecycle: Lifecycle, pending: AwaitActivation) -> Decision | LlmgwError:
    """Start the model if nobody has (a waiter that gives up does not cancel the start),
    wait up to `activation_timeout`, then pick once more."""
    activation = lifecycle.gateway.activation
    assert activation is not None  # `route` asks for activation only of managed models
    try:
        await activation.ensure_ready(pending.model)
    except LlmgwError as exc:
        return lifecycle.refuse(exc)
    return lifecycle.activated()
