"""Read one HTTP/1.1 message from a blocking socket: test stand-ins and raw clients that
must see exactly what went over the wire (no client library between)."""

from __future__ import annotations

import re
import socket

_CONTENT_LENGTH = re.compile(rb"(?im)^content-length:\s*(\d+)\s*$")


def read_http_message(sock: socket.socket) -> tuple[bytes, bytes]:
    """(head, body): the head up to its blank line, then as much body as its
    content-length says (none without one). Shorter if the peer closes first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data, b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    match = _CONTENT_LENGTH.search(head)
    length = int(match.group(1)) if match else 0
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head, body
