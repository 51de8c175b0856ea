"""An engine stand-in for activator tests: answers `GET /health` 200 and ignores SIGTERM
(an engine slow to drain). Usage: python stubborn_engine.py PORT"""

from __future__ import annotations

import signal
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, format: str, *args: object) -> None:
        pass


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    HTTPServer(("127.0.0.1", int(sys.argv[1])), _Health).serve_forever()
