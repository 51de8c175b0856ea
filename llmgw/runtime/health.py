"""What `/healthz` and `/readyz` mean, on both edges.

- `/healthz`: the process is alive and answers (always 200 `{"status": "ok"}`).
- `/readyz`: 200 when started, not draining (SIGTERM), and at least one model can take a request
  somewhere (an available endpoint, or it starts on demand); else 503. The body lists
  per model its mode, endpoints and available endpoints.
"""

from __future__ import annotations

import orjson

from llmgw.config import ModelMode, model_mode
from llmgw.runtime.router import Router

HEALTHZ_BODY = b'{"status":"ok"}'


def readiness(router: Router, *, started: bool, draining: bool) -> tuple[bool, bytes]:
    """(ready, JSON body) for `/readyz`."""
    registry = router.registry
    now = registry.clock()
    models: dict[str, dict[str, object]] = {}
    routable = False
    for name, spec in router.config.models.items():
        mode = model_mode(spec)
        states = registry.states(name)
        available = sum(1 for s in states if s.breaker.available(now))
        models[name] = {"mode": mode.value, "endpoints": len(states), "available": available}
        routable |= available > 0 or mode is ModelMode.ON_DEMAND
    ready = started and routable and not draining
    return ready, orjson.dumps({"ready": ready, "draining": draining, "models": models})
