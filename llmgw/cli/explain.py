"""`llmgw explain`: ask a running router where a request would go now, and why.

    llmgw explain --url http://127.0.0.1:9004 --model chat --session u1 --prompt "hi"
    llmgw explain --url http://127.0.0.1:8000 --body request.json --json

`--url` is the ext_proc server's health port or the proxy's port; the server needs
`admin: {explain: true}` in its config. Nothing is charged or learned by asking.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from llmgw.explain import EXPLAIN_PATH, render_table


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmgw explain", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--url", required=True, help="ext_proc health port or proxy base URL (http://host:port)"
    )
    parser.add_argument("--model", help="the model (overrides the body file's)")
    parser.add_argument("--session", help="session key (sent in the model's session header)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="prompt text, sent as one user message")
    source.add_argument("--body", type=Path, help="a JSON request body file (OpenAI format)")
    parser.add_argument("--path", default="/v1/chat/completions", help="request path")
    parser.add_argument(
        "--header", action="append", default=[], metavar="NAME:VALUE", help="extra header"
    )
    parser.add_argument("--json", action="store_true", help="print the JSON answer")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    return parser


def query_of(args: argparse.Namespace) -> dict[str, Any]:
    """The explain query; raises ValueError with what to fix."""
    query: dict[str, Any] = {"path": args.path}
    if args.model:
        query["model"] = args.model
    if args.session is not None:
        query["session"] = args.session
    if args.body is not None:
        try:
            query["body"] = json.loads(args.body.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"--body {args.body}: cannot read a JSON body: {exc}") from None
    else:
        if not args.model:
            raise ValueError("give --model (or --body with a file naming one)")
        query["prompt"] = args.prompt or ""
    headers: dict[str, str] = {}
    for item in args.header:
        name, sep, value = item.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"--header {item!r}: write NAME:VALUE")
        headers[name.strip()] = value.strip()
    if headers:
        query["headers"] = headers
    return query


def ask(url: str, query: dict[str, Any], timeout: float) -> tuple[int, dict[str, Any]]:
    """POST the query; (status, JSON answer). Raises OSError when nothing answers."""
    request = urllib.request.Request(
        url.rstrip("/") + EXPLAIN_PATH,
        data=json.dumps(query).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            return exc.code, json.loads(body)
        except ValueError:
            return exc.code, {"error": {"message": body.decode("utf-8", "replace")}}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv or [])
    try:
        query = query_of(args)
    except ValueError as exc:
        print(f"llmgw explain: {exc}", file=sys.stderr)
        return 2
    try:
        status, answer = ask(args.url, query, args.timeout)
    except http.client.InvalidURL as exc:  # a typo in the port
        print(f"llmgw explain: --url {args.url}: {exc}", file=sys.stderr)
        return 1
    except http.client.HTTPException as exc:  # not HTTP/1.1: the ext_proc gRPC port
        print(
            f"llmgw explain: no HTTP answer from {args.url} ({type(exc).__name__}: {exc}): "
            "is this llmgw's health port (ext_proc) or the proxy's port, not the gRPC port?",
            file=sys.stderr,
        )
        return 1
    except (OSError, ValueError) as exc:
        print(f"llmgw explain: no answer from {args.url}: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        error = answer.get("error") if isinstance(answer, dict) else None
        message = error.get("message", error) if isinstance(error, dict) else error or answer
        print(f"llmgw explain: {status}: {message}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    try:
        print(render_table(answer))
    except (KeyError, TypeError, AttributeError, ValueError):
        print(
            f"llmgw explain: {args.url} answered 200 but not an llmgw explanation: is this "
            "llmgw's health port (ext_proc) or the proxy's port, with admin: {explain: true}?",
            file=sys.stderr,
        )
        return 1
    return 0
