"""`llmgw proxy`: the embedded OpenAI-compatible routing proxy (no Envoy needed).

    llmgw proxy --config llmgw.yaml --host 0.0.0.0 --port 8000

The app is `llmgw.asgi.app.ProxyApp` (routes, health, metrics) around `llmgw.asgi.forwarder.Forwarder`;
`llmgw.asgi.serving` runs it under uvicorn (draining, workers).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import orjson

from llmgw.asgi.app import build_app
from llmgw.asgi.protocol import WORKER_PROTOCOL, guarded
from llmgw.asgi.serving import WORKER_ARGS, draining_server, event_loop_and_parser, supervise
from llmgw.config import load_file
from llmgw.errors import ConfigError
from llmgw.logs import configure
from llmgw.request import CLIENT_MAX_HEADERS_KB
from llmgw.runtime.cliargs import port_number, positive_int
from llmgw.runtime.controlplanes import StartError
from llmgw.runtime.router import worker_group, workers_problem


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="llmgw proxy", description="OpenAI-compatible routing proxy (no Envoy needed)."
    )
    parser.add_argument("--config", required=True, help="llmgw config file (YAML)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=8000)
    parser.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help="processes sharing the port; each routes on its own (same ring, own inflight)",
    )
    parser.add_argument("--no-scrape", action="store_true", help="do not poll /metrics")
    parser.add_argument(
        "--drain-delay",
        type=float,
        default=0.0,
        help="seconds between SIGTERM (readiness false) and closing the listener",
    )
    parser.add_argument(
        "--drain-timeout", type=float, default=10.0, help="seconds open requests get to finish"
    )
    parser.add_argument(
        "--reload-interval",
        type=float,
        default=1.0,
        help="seconds between checks of the config file for changes (0: only on SIGHUP)",
    )
    parser.add_argument(
        "--log-level", default="warning", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument("--log-format", choices=("text", "json"), default="text")
    args = parser.parse_args(argv)
    configure(args.log_level, args.log_format)
    try:
        config = load_file(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    problem = workers_problem(config, args.workers)
    if problem is not None:
        print(f"llmgw proxy: {problem}", file=sys.stderr)
        return 2
    import uvicorn  # noqa: PLC0415

    loop, http = event_loop_and_parser()
    options: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "loop": loop,
        "http": http,
        "lifespan": "on",
        "access_log": False,
        "log_level": args.log_level,
        "server_header": False,
        "date_header": False,
        "proxy_headers": False,  # a routing proxy forwards X-Forwarded-* untouched
        "timeout_graceful_shutdown": args.drain_timeout,
        # h11's too (the httptools protocol sets its own from the same limit)
        "timeout_keep_alive": config.limits.client_idle_timeout,
    }
    if args.log_format == "json":  # no text handlers of uvicorn's: its lines reach ours
        options["log_config"] = None
    if http == "httptools":  # with the head limits uvicorn lacks (llmgw.asgi.protocol)
        options["http"] = WORKER_PROTOCOL if args.workers > 1 else guarded(config.limits)
    else:  # h11 bounds the head's size itself, not its time
        options["h11_max_incomplete_event_size"] = CLIENT_MAX_HEADERS_KB * 1024
    if args.workers > 1:
        os.environ[WORKER_ARGS] = orjson.dumps(
            {
                "config": os.path.abspath(args.config),
                "scrape": not args.no_scrape,
                "reload_interval": args.reload_interval,
                "drain_delay": args.drain_delay,
                "log_level": args.log_level,
                "log_format": args.log_format,
                "parent": os.getpid(),  # the workers exit with it
            }
        ).decode()
        with worker_group(args.workers):  # the workers peer (share what they route)
            return supervise(
                uvicorn.Config(
                    "llmgw.asgi.serving:worker_app",
                    factory=True,
                    workers=args.workers,
                    **options,
                )
            )
    app = build_app(
        config,
        scrape=not args.no_scrape,
        config_path=args.config,
        reload_interval=args.reload_interval,
    )
    if http == "httptools":  # its errors counted with the app's
        options["http"] = guarded(config.limits, app.telemetry.error)
    server = draining_server(uvicorn.Config(app, **options), app, args.drain_delay)
    try:
        server.run()
    except KeyboardInterrupt:  # Ctrl+C: uvicorn has shut down, then re-raised the signal
        pass
    except SystemExit:  # uvicorn exits (code 3) when the lifespan startup failed
        if not isinstance(app.start_error, StartError):
            raise
    if isinstance(app.start_error, StartError):  # Kubernetes discovery refused (RBAC)
        print(f"llmgw proxy: cannot start: {app.start_error}", file=sys.stderr)
        return 3  # as `llmgw extproc`
    return 0 if server.started else 1
