"""`llmgw sim` / `python -m llmgw.sim`: serve simulated engine replicas until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from llmgw.sim.faults import METRICS_MODES, Faults, FaultSpecError
from llmgw.sim.fleet import SimFleet, build_options, write_ready_file
from llmgw.sim.metrics import ENGINES


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port: give 0-65535 (0: ephemeral)")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmgw sim",
        description="Simulated LLM engine servers (vLLM/SGLang/TensorRT-LLM-like API).",
    )
    net = parser.add_argument_group("listening")
    net.add_argument("--host", default="127.0.0.1")
    ports = net.add_mutually_exclusive_group()
    ports.add_argument("--port", type=_port, help="port of a single replica (0 = ephemeral)")
    ports.add_argument(
        "--base-port",
        type=_port,
        default=8100,
        help="replica i listens on base-port+i (0 = ephemeral)",
    )
    net.add_argument("--replicas", type=_positive_int, default=1)
    net.add_argument("--ready-file", help="write {host, ports, pid} JSON here once listening")

    served = parser.add_argument_group("served models")
    models = served.add_mutually_exclusive_group()
    models.add_argument("--model", default=None, help="served model name (default m1)")
    models.add_argument("--models", default=None, help="comma-separated served model names")
    served.add_argument(
        "--engine",
        choices=ENGINES,
        default="vllm",
        help="which engine's /metrics names and labels to expose",
    )

    engine = parser.add_argument_group("engine model")
    engine.add_argument("--max-num-seqs", type=_positive_int, default=64)
    engine.add_argument("--max-queue", type=int, default=256)
    engine.add_argument("--kv-blocks", type=_positive_int, default=2048)
    engine.add_argument("--block-size", type=_positive_int, default=16)
    engine.add_argument("--max-model-len", type=_positive_int, default=8192)
    engine.add_argument("--prefill-us-per-token", type=_non_negative_float, default=50.0)
    engine.add_argument("--decode-ms", type=_non_negative_float, default=10.0)
    engine.add_argument(
        "--decode-batch-factor",
        type=_non_negative_float,
        default=0.02,
        help="decode step slowdown per extra running sequence",
    )
    engine.add_argument(
        "--time-scale",
        type=_non_negative_float,
        default=1.0,
        help="wall seconds per simulated second (0 = no latency)",
    )
    engine.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        default=None,
        help="token budget per step: chunked prefill, as vLLM v1 (default: off)",
    )
    engine.add_argument("--no-prefix-caching", action="store_true")
    engine.add_argument(
        "--kv-events",
        action="store_true",
        help="publish vLLM KV-cache events over ZMQ (a free port per replica; "
        "GET /kv_event_sources says which)",
    )
    engine.add_argument("--seed", type=int, default=0)

    faults = parser.add_argument_group("faults (also at run time: POST /admin/faults)")
    faults.add_argument("--error-rate", type=float, default=0.0, help="share answered 500")
    faults.add_argument(
        "--fault-status",
        type=int,
        default=None,
        help="answer every inference request with this status (503, 429)",
    )
    faults.add_argument("--hang", action="store_true", help="accept, never answer")
    faults.add_argument("--slowdown", type=float, default=1.0, help="latency multiplier")
    faults.add_argument("--metrics-fault", choices=METRICS_MODES, default="ok")
    faults.add_argument("--health-status", type=int, default=None)
    faults.add_argument(
        "--crash-after-chunks",
        type=int,
        default=None,
        help="cut streamed answers after this many SSE chunks",
    )
    return parser


def _fleet(args: argparse.Namespace) -> SimFleet:
    faults = Faults(
        error_rate=args.error_rate,
        status=args.fault_status,
        hang=args.hang,
        slowdown=args.slowdown,
        metrics=args.metrics_fault,
        health_status=args.health_status,
        crash_after_chunks=args.crash_after_chunks,
    )
    faults.validate()
    models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
    options = build_options(
        model=args.model,
        models=models,
        engine=args.engine,
        seed=args.seed,
        faults=faults,
        crash_exits_process=True,
        kv_events_port=0 if args.kv_events else None,
        max_num_seqs=args.max_num_seqs,
        max_queue=args.max_queue,
        kv_blocks=args.kv_blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        prefill_us_per_token=args.prefill_us_per_token,
        decode_ms=args.decode_ms,
        decode_batch_factor=args.decode_batch_factor,
        time_scale=args.time_scale,
        enable_prefix_caching=not args.no_prefix_caching,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    if args.port is not None:
        if args.replicas != 1:
            raise ValueError("--port serves one replica; use --base-port with --replicas")
        base_port = args.port
    else:
        base_port = args.base_port
    return SimFleet(args.replicas, host=args.host, base_port=base_port, options=options)


async def _serve(fleet: SimFleet, ready_file: str | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signum, stop.set)
    async with fleet:
        summary = {
            "sim": "listening",
            "engine": fleet.options.engine,
            "models": list(fleet.options.models),
            "urls": fleet.urls,
        }
        print(json.dumps(summary), flush=True)
        if ready_file:
            write_ready_file(ready_file, fleet.host, fleet.ports)
        await stop.wait()


def _run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.port is None and args.base_port and args.base_port + args.replicas - 1 > 65535:
        parser.error(
            f"--base-port {args.base_port} with --replicas {args.replicas} passes port 65535"
        )
    try:
        fleet = _fleet(args)
    except (ValueError, FaultSpecError) as exc:
        parser.error(str(exc))
    try:
        _run(lambda: _serve(fleet, args.ready_file))
    except OSError as exc:
        print(f"llmgw sim: {exc}", file=sys.stderr)
        return 1
    return 0
