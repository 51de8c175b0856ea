"""What `/healthz` and `/readyz` mean, on both edges.

- `/healthz`: the process is alive and answers (always 200 `{"status": "ok"}`).
- `/readyz`: 200 when started (config loaded, Kubernetes discovery listed) and not draining
  (SIGTERM); else 503. Not when the model servers are down: every router replica shares
  them, so all would leave their Service at once, and clients would get connection errors
  (through Envoy, 500s) instead of llmgw's 503 `no_healthy_endpoint` with Retry-After, and
  the routers would come back a probe period after the servers (GIE's picker reads ready
  the same way: its pool synced). The body lists per model its mode, endpoints and
  available endpoints, and `routable`: whether any model can take a request somewhere.
"""

from __future__ import annotations

import orjson

from llmgw.config import ModelMode, model_mode
from llmgw.runtime.router import Router

HEALTHZ_BODY = b'{"status":"ok"}'


def is_ready(*, started: bool, draining: bool) -> bool:
    """`/readyz`'s answer without its body (gRPC health asks it on every check)."""
    return started and not draining


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
    ready = is_ready(started=started, draining=draining)
    return ready, orjson.dumps(
        {"ready": ready, "draining": draining, "routable": routable, "models": models}
    )
