"""Error types: each carries the HTTP status to answer with and a stable machine code.

Both edges turn these into the same OpenAI-style JSON body, so there is one copy of the
wording and of the status mapping.
"""

from __future__ import annotations

from collections.abc import Iterable

import orjson


class LlmgwError(Exception):
    status: int = 500
    code: str = "internal_error"
    type: str = "server_error"
    # The rest of the request may still be on its way: the connection cannot carry another.
    closes: bool = False

    def __init__(
        self,
        message: str,
        *,
        headers: dict[str, str] | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.headers: dict[str, str] = dict(headers or {})
        if retry_after is not None:  # whole seconds, at least 1 (RFC 9110 delay-seconds)
            self.headers["retry-after"] = str(max(1, retry_after))

    def body(self) -> bytes:
        """The OpenAI-style error body: {"error": {"message", "type", "code"}}."""
        return orjson.dumps(
            {"error": {"message": self.message, "type": self.type, "code": self.code}}
        )

    def response_headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json", **self.headers}
        if self.closes:
            headers["connection"] = "close"
        return headers


class BadRequest(LlmgwError):
    status = 400
    code = "invalid_request"
    type = "invalid_request_error"


class MalformedRequest(BadRequest):
    """Not valid HTTP/1.1 (framing, header syntax, a missing Host), or a protocol switch
    the proxy does not make: the connection cannot carry another request."""

    closes = True


class UpgradeRequired(LlmgwError):
    """HTTP/1.0: Envoy's answer (426) on both edges; streamed answers need HTTP/1.1."""

    status = 426
    code = "invalid_request"
    type = "invalid_request_error"
    closes = True

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"upgrade": "HTTP/1.1"})


class BodyTooLarge(LlmgwError):
    """Answered before the body's end: the rest is not read, the connection is closed."""

    status = 413
    code = "body_too_large"
    type = "invalid_request_error"
    closes = True


class ModelNotFound(LlmgwError):
    status = 404
    code = "model_not_found"
    type = "invalid_request_error"

    @classmethod
    def unknown(cls, model: str, known: Iterable[str]) -> ModelNotFound:
        """The 404 for a name no model has; a long name is cut (the client sent it)."""
        shown = (
            repr(model)
            if len(model) <= _SHOWN_NAME
            else (f"{model[:_SHOWN_NAME]!r}... ({len(model)} characters)")
        )
        listed = ", ".join(sorted(known)) or "none"
        return cls(f"model {shown} does not exist (configured models: {listed})")


_SHOWN_NAME = 128  # characters of an unknown model name echoed in the 404


class RequestTimeout(LlmgwError):
    """The client stopped sending its request (head or body) for too long."""

    status = 408
    code = "request_timeout"
    type = "invalid_request_error"
    closes = True


class HeadersTooLarge(LlmgwError):
    status = 431
    code = "headers_too_large"
    type = "invalid_request_error"
    closes = True


class NoCapacity(LlmgwError):
    """Every endpoint is saturated (queue or KV ceiling), or the request was shed."""

    status = 429
    code = "all_saturated"
    type = "rate_limit_error"


class NoHealthyEndpoint(LlmgwError):
    status = 503
    code = "no_healthy_endpoint"
    type = "service_unavailable"


class RouterDraining(LlmgwError):
    """The proxy is shutting down and its `--drain-timeout` ended before this request's answer
    began: the client may retry at once, on another router replica."""

    status = 503
    code = "router_draining"
    type = "service_unavailable"
    closes = True  # the server is going away

    def __init__(self, message: str) -> None:
        super().__init__(message, retry_after=1)


class ModelDisabled(LlmgwError):
    """Configured but off (`max: 0` or no scaling stanza for a launched model): never started."""

    status = 503
    code = "model_disabled"
    type = "service_unavailable"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"x-should-retry": "false"})


class ModelLoading(LlmgwError):
    """An on-demand model is starting; the caller should retry after `retry_after` seconds."""

    status = 503
    code = "model_loading"
    type = "service_unavailable"

    def __init__(self, message: str, *, retry_after: int) -> None:
        retry_after = max(1, min(60, retry_after))
        super().__init__(message, retry_after=retry_after)
        self.retry_after = retry_after


class ModelNotReady(LlmgwError):
    """An on-demand model has no ready endpoint yet: the runtime activator handles this."""

    status = 503
    code = "model_not_ready"
    type = "service_unavailable"


class ModelFailed(LlmgwError):
    """The last start of an on-demand model failed; the reason is in the message."""

    status = 503
    code = "model_start_failed"
    type = "service_unavailable"


class InternalError(LlmgwError):
    """A bug in the router: answered as 500 rather than a broken request."""


class UpstreamUnreachable(LlmgwError):
    """No endpoint of the Decision answered (connect error, reset, timeout, a broken head)."""

    status = 502
    code = "upstream_unreachable"
    type = "server_error"


class RouteNotFound(LlmgwError):
    status = 404
    code = "route_not_found"
    type = "invalid_request_error"


class MethodNotAllowed(LlmgwError):
    status = 405
    code = "method_not_allowed"
    type = "invalid_request_error"


class ConfigError(ValueError):
    """Invalid configuration; `problems` are `path: message` lines, e.g.
    `models.chat.scaling.max: must be >= min (1)`."""

    def __init__(self, problems: list[str], source: str = "config") -> None:
        self.problems = problems
        self.source = source
        super().__init__(f"invalid {source}:\n  " + "\n  ".join(problems))


class MetricsError(ValueError):
    """A /metrics page that does not satisfy the metric contract (stale data, not a breaker trip)."""
