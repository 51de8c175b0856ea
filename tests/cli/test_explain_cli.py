"""`llmgw explain` against a server that does not answer as llmgw does: a clear error."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llmgw.cli.explain import main

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
