"""The proxy's HTTP/1.1 server protocol: uvicorn's httptools protocol plus the request-head
limits uvicorn does not have.

uvicorn reads a request head for as long as the client takes (a connection that sends half
a head, or nothing at all, is held until the client leaves) and of any size (a 1 MB header
is accepted whole). Envoy in front of llmgw bounds both; `llmgw proxy` alone must too:
- the head must arrive whole within `limits.client_header_timeout` s of the connection (on
  a kept-alive connection, of the request's first byte, empty lines before it not
  counted), else 408 and close (a connection that sent nothing, or only empty lines, is
  closed without a reply);
- past `CLIENT_MAX_HEADERS` headers or `CLIENT_MAX_HEADERS_KB` of request line and headers,
  431 and close, counted as the parser goes (nothing past the limit is kept), the same
  limits and the same JSON error as the generated Envoy config's;
- an answer sent before the request's body is all in (a preflight, 404, 405, 413) closes
  the connection (uvicorn read and dropped the rest, with no timer);
- a close while the request is still arriving (after a 413 or a refused head, the client
  still writing) lingers instead of resetting the connection, so the answer is read;
- what uvicorn answers in plain text or not at all gets the JSON errors Envoy's config
  gives: a malformed request 400 (uvicorn's answer also cut off the answer of a request
  before it on the same connection), HTTP/1.0 426 (uvicorn chunked streamed answers to
  HTTP/1.0 clients), a missing Host 400, and an `Upgrade` request (h2c, websocket) 400:
  the parser hands the body of such a request over as the new protocol's bytes, so the
  app read an empty body.
The body's timeout is the middleware's (`read_body`): the app reads the body, not this.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from llmgw.config import LimitsSpec
from llmgw.errors import (
    HeadersTooLarge,
    LlmgwError,
    MalformedRequest,
    RequestTimeout,
    UpgradeRequired,
)
from llmgw.request import CLIENT_MAX_HEADERS, CLIENT_MAX_HEADERS_KB, HEADERS_TOO_LARGE

_HEAD_SLACK = 4096  # raw head bytes beyond the counted ones: separators, line ends
_LINGER = 2.0  # seconds a refused connection drops what the client still sends
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets the connection


def _reply(error: LlmgwError) -> bytes:
    body = error.body()
    lines = [STATUS_LINE[error.status]]
    for name, value in error.response_headers().items():
        lines.append(f"{name}: {value}\r\n".encode("latin-1"))
    lines.append(b"content-length: %d\r\n\r\n" % len(body))
    return b"".join(lines) + body


class GuardedProtocol(HttpToolsProtocol):
    """`HttpToolsProtocol` with a head deadline and head size limits (module docstring).

    The limits are class attributes: `guarded(limits)` makes a subclass for one server;
    `WorkerProtocol` is the one `--workers N` names (set in each worker by `worker_app`).
    """

    header_timeout: float = LimitsSpec().client_header_timeout
    keep_alive: float = LimitsSpec().client_idle_timeout
    write_timeout: float = LimitsSpec().client_write_timeout
    max_headers = CLIENT_MAX_HEADERS
    max_head_bytes = CLIENT_MAX_HEADERS_KB * 1024
    # Told of each error this layer answers (the app's telemetry: `llmgw_errors_total`).
    on_error: Callable[[LlmgwError], object] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Not uvicorn's 5 s: `limits.client_idle_timeout` (seconds for `call_later`; uvicorn
        # annotates it int).
        self.timeout_keep_alive = self.keep_alive  # type: ignore[assignment]
        self._head_timer: asyncio.TimerHandle | None = None
        self._empty_lines = False  # the head timer runs for empty lines, not a head yet
        self._raw: asyncio.Transport  # the socket's transport (`transport` wraps it)
        self._head_started = False  # a byte of the current head arrived
        self._head_count = 0
        self._head_bytes = 0
        self._refused = False
        self._in_head = True  # the next bytes belong to a request head
        self._head_received = 0  # raw bytes of it so far
        self._lost = False  # the connection is closed
        # Cycles not yet answered: uvicorn's connection_lost tells only the newest (a
        # request pipelined behind a running stream), so the stream never heard it.
        self._open_cycles: list[Any] = []

    @classmethod
    def use(
        cls, limits: LimitsSpec, on_error: Callable[[LlmgwError], object] | None = None
    ) -> None:
        cls.on_error = on_error
        cls.header_timeout = limits.client_header_timeout
        cls.keep_alive = limits.client_idle_timeout
        cls.write_timeout = limits.client_write_timeout

    # -- the head deadline -------------------------------------------------------------
    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_expired)

    def _disarm(self) -> None:
        self._empty_lines = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if not self._head_started:  # an idle connection: nothing to answer
            self.transport.close()
            return
        self._refuse(
            RequestTimeout(
                f"the request head did not arrive whole within {self.header_timeout:g} s "
                "(limits.client_header_timeout)"
            )
        )

    def _refuse(self, error: LlmgwError) -> None:
        """Answer and close (lingering: the client may still be sending the rest of a 4 MB
        header). A pipelined head refused while an earlier request's answer is still going
        out gets no answer in the middle of that one: the connection closes after it."""
        self._disarm()
        if self._refused:  # refused already: one answer, one close
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            self._refused = True  # nothing more is read or parsed
            cycle.keep_alive = False
            return
        self._raw.write(_reply(error))
        on_error = type(self).on_error  # via the class: a plain function would bind self
        if on_error is not None:
            on_error(error)
        self._linger()

    def _linger(self) -> None:
        """Close without resetting the connection: a close with unread data in the socket
        sends a reset, and a client still writing its request (the rest of a body refused
        with 413, with `Connection: close`) loses the answer it was sent. So the write side
        is shut and what arrives is dropped until the client closes or `_LINGER` s pass."""
        self._refused = True
        raw = self._raw
        if raw.is_closing():
            return
        self.flow.resume_reading()  # uvicorn paused it while the unread body piled up
        if raw.can_write_eof():
            raw.write_eof()
            self.loop.call_later(_LINGER, raw.close)
        else:
            raw.close()

    def _request_unread(self) -> bool:
        """The current request's body is not all in (uvicorn closing now would reset)."""
        return not self._in_head

    # -- protocol and parser callbacks ---------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._raw = transport
        # uvicorn closes the transport itself after a response with `Connection: close`.
        self.transport = _LingeringTransport(transport, self)  # type: ignore[assignment]
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._disarm()
        for cycle in self._open_cycles:
            if not cycle.response_complete and cycle is not self.cycle:
                cycle.disconnected = True
                cycle.message_event.set()
        self._open_cycles.clear()
        super().connection_lost(exc)

    def _close_draining(self) -> None:
        """Close once what is written has gone out; a client that does not read it within
        `write_timeout` (one the proxy dropped for that) is reset, not kept: a close waits
        for the write buffer to drain, and that client's never does."""
        raw = self._raw
        raw.close()
        if raw.get_write_buffer_size():
            self.loop.call_later(self.write_timeout, self._abort_if_open)

    def _abort_if_open(self) -> None:
        if self._lost:
            return
        # A reset, not the kernel's own slow goodbye: closed with unsent data, a socket
        # lingers (probing the client's shut window) with its buffers for minutes.
        sock = self._raw.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
        self._raw.abort()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            self._head_received += len(data)
        super().data_received(data)
        # The parser keeps a header's value until its end: one that goes on past the limit
        # is refused here, after one read (64 KB) past it, not after the client is done.
        if (
            not self._refused
            and self._in_head
            and self._head_received > self.max_head_bytes + _HEAD_SLACK
        ):
            self._refuse(self._too_large())
        # Any bytes stop uvicorn's idle timer, but empty lines before a request line start
        # no message (the parser skips them): between requests, the head deadline covers
        # them, so a connection sending only CRLFs is closed as an idle one.
        if not self._refused and self._in_head and self._head_timer is None:
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                self._arm()
                self._empty_lines = True

    def on_message_begin(self) -> None:
        if self._refused:
            return
        super().on_message_begin()
        self._head_started = True
        self._head_count = 0
        self._head_bytes = 0
        if self._empty_lines:  # the head has its whole deadline from its own first byte
            self._disarm()
        self._arm()

    # Once refused, the parser still runs to the end of the read: nothing more is kept.
    def on_url(self, url: bytes) -> None:
        if self._count(len(url), 0):
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._count(len(name) + len(value), 1):
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._disarm()
        self._head_started = False
        self._in_head = False
        self._head_received = 0
        refused = self._wrong_protocol()
        if refused is not None:
            self._refuse(refused)
            return
        super().on_headers_complete()
        self._open_cycles = [c for c in self._open_cycles if not c.response_complete]
        self._open_cycles.append(self.cycle)

    def _wrong_protocol(self) -> LlmgwError | None:
        version = self.parser.get_http_version()
        if version != "1.1":
            return UpgradeRequired(f"HTTP/{version} is not served: send HTTP/1.1")
        if not any(name == b"host" for name, _ in self.headers):
            return MalformedRequest("an HTTP/1.1 request needs a Host header")
        if self.parser.should_upgrade():
            upgrade = next((v for n, v in self.headers if n == b"upgrade"), b"")
            return MalformedRequest(
                f"the proxy does not switch protocols (Upgrade: "
                f"{upgrade.decode('latin-1')[:64]}): send the request without Upgrade"
            )
        return None

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes its parser refuses (plain text, written at once)."""
        if self._refused:  # the parser ran on past a refusal in the same read
            return
        error = MalformedRequest(
            "the request is not valid HTTP/1.1 (request line, header syntax, "
            "content-length or chunked framing)"
        )
        if self.pipeline:
            # The broken body is a queued request's, behind one still being answered: it
            # never starts, and the connection closes after that answer.
            self.pipeline.clear()
            self._refused = True
            return
        cycle = self.cycle
        if not self._in_head and cycle is not None and not cycle.response_started:
            # The body of the request being read is broken: answer it now; its app stops
            # waiting for the rest (it sees the client gone) and answers nothing.
            cycle.disconnected = True
            cycle.message_event.set()
            self._disarm()
            self._raw.write(_reply(error))
            self._linger()
            return
        self._refuse(error)

    def on_response_complete(self) -> None:
        early = not self._in_head  # answered before the request's body was all in
        if not self.pipeline and not self.transport.is_closing() and (self._refused or early):
            # Refused while this answer went out; or answered before the body's end (a
            # preflight, 404, 405, 413): uvicorn would read and drop the rest with no timer,
            # however long the client sends, and a client that was never asked for the body
            # (expect-100) may skip it, its next request then read as that body.
            self.transport.close()  # lingers: the body may still be coming
        super().on_response_complete()  # its bookkeeping; it stops at a closing transport

    def _should_upgrade(self) -> bool:
        """No protocol switch, whatever is installed: refused in `on_headers_complete`."""
        return False

    def _unsupported_upgrade_warning(self) -> None:
        """uvicorn's log line for an upgrade it cannot make: refused (and said) already."""

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._in_head = True
        super().on_message_complete()

    def _count(self, size: int, headers: int) -> bool:
        """Count a piece of the head; False: refused (now or before)."""
        if self._refused:
            return False
        self._head_bytes += size
        self._head_count += headers
        if self._head_count > self.max_headers or self._head_bytes > self.max_head_bytes:
            self._refuse(self._too_large())
            return False
        return True

    def _too_large(self) -> HeadersTooLarge:
        return HeadersTooLarge(HEADERS_TOO_LARGE)


class _LingeringTransport:
    """The transport uvicorn's protocol and its request cycles write to: `close()` lingers
    (`GuardedProtocol._linger`) while the request being answered is still arriving."""

    def __init__(self, raw: asyncio.Transport, protocol: GuardedProtocol) -> None:
        self._raw = raw
        self._protocol = protocol
        self._closing = False

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self._protocol._request_unread():
            self._protocol._linger()
        else:
            self._protocol._close_draining()

    def is_closing(self) -> bool:
        return self._closing or self._raw.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def guarded(
    limits: LimitsSpec, on_error: Callable[[LlmgwError], object] | None = None
) -> type[GuardedProtocol]:
    """The protocol class for one server with these limits; `on_error` is told of each
    error it answers (`ProxyApp.telemetry.error`)."""
    protocol: type[GuardedProtocol] = type("Guarded", (GuardedProtocol,), {})
    protocol.use(limits, on_error)
    return protocol


class WorkerProtocol(GuardedProtocol):
    """The class `--workers N` names by import path: each worker process sets its limits
    (`GuardedProtocol.use`) when it loads its config."""


WORKER_PROTOCOL = f"{__name__}:WorkerProtocol"
