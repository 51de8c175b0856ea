"""`llmgw explain` against a server that does not answer as llmgw does: a clear error."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llmgw.cli.explain import main
from llmgw.testing.rawhttp import read_http_message

ANSWERS: dict[str, tuple[int, bytes]] = {}


class Canned(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        status, body = ANSWERS["now"]
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        return


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Canned)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize(
    ("status", "body", "phrase"),
    [
        (404, b'{"error": "Not Found"}', "404: Not Found"),
        (404, b'["x"]', "404: ['x']"),
        (500, b'"oops"', "500: oops"),
        (200, b'{"ok": 1}', "not an llmgw explanation"),
        (200, b'{"endpoints": [{}], "filters": []}', "not an llmgw explanation"),
    ],
)
def test_an_answer_not_shaped_as_llmgws_is_named_not_a_traceback(
    server: str, status: int, body: bytes, phrase: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ANSWERS["now"] = (status, body)
    assert main(["--url", server, "--model", "m1", "--prompt", "hi", "--timeout", "5"]) == 1
    assert phrase in capsys.readouterr().err


# What a gRPC (HTTP/2-only) port answers an HTTP/1.1 request: a SETTINGS frame, then close.
HTTP2_SETTINGS = b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x03\x00\x00\x00\x64"


@pytest.fixture
def http2_only_port() -> Iterator[int]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port: int = listener.getsockname()[1]

    def serve() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            # The whole request first: closing with some of it unread resets the connection,
            # and the client may see the reset before the frame (the test then flaked).
            if not read_http_message(conn)[0]:
                return
            conn.sendall(HTTP2_SETTINGS)
            conn.shutdown(socket.SHUT_WR)  # then close once the client has read and gone
            while conn.recv(65536):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        listener.close()
        thread.join(timeout=5)


def test_the_grpc_port_is_named_not_a_traceback(
    http2_only_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """An HTTP/2-only port (ext_proc's gRPC) raised http.client.BadStatusLine out of main
    (found by a review helper)."""
    url = f"http://127.0.0.1:{http2_only_port}"
    assert main(["--url", url, "--model", "m1", "--prompt", "hi", "--timeout", "5"]) == 1
    err = capsys.readouterr().err
    assert f"no HTTP answer from {url}" in err and "gRPC port" in err


def test_a_bad_port_in_the_url_is_named_not_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A letter in the port raised http.client.InvalidURL out of main (found by a review
    helper)."""
    assert main(["--url", "http://127.0.0.1:90O4", "--model", "m1"]) == 1  # letter O
    err = capsys.readouterr().err
    assert "--url http://127.0.0.1:90O4" in err and "nonnumeric port" in err
