"""The embedded proxy against its peers, in one run, on the same simulated upstreams.

    python bench/asgi_proxy.py                      # everything; prints a table, writes JSON
    python bench/asgi_proxy.py --only llmgw,vllm-router --seconds 5

Proxies (each in its own process, one at a time, on the same `llmgw sim` replicas):
- `llmgw`: `llmgw proxy` (uvicorn + uvloop + httptools, `SchedulerMiddleware`, the lean
  upstream client of `llmgw.asgi.upstream`), strategy `ring` (consistent hashing), `llmgw-chat`
  (the default `chat` strategy) and `llmgw-2w` (`ring`, `--workers 2`: the Rust routers
  use every core);
- `vllm-router` (Rust, `--policy consistent_hash`) and `sglang-router` (Rust,
  `--policy round_robin`: it has no consistent hashing), pip-installed by this script into
  `.venv-peers/` (never into the project's `.venv`);
- baselines, plain Starlette forwarding round-robin with no scheduling: `starlette+httpx`,
  `starlette+aiohttp`, and `starlette+lean` (the same app with `llmgw.asgi.upstream`), which
  isolate the cost of the HTTP client.

Load: h2load over HTTP/1.1, `--clients` connections, `--seconds` per scenario after a
warm-up, a small chat-completions body; `stream` asks for 16 SSE chunks. Reported per
proxy and scenario: req/s, latency p50/p99 (from h2load's per-request log) and the proxy
process tree's CPU-seconds per 1,000 requests. Other work on the machine moves absolute
numbers: compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._tools import find_load_tool, format_table, write_results  # noqa: E402
from bench.peers import add_install_option, ensure_peers  # noqa: E402
from llmgw.runtime.ports import free_port  # noqa: E402

MODEL = "m1"
BODIES = {
    "non-stream": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello to the benchmark."}],
        "max_tokens": 8,
    },
    "stream": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello to the benchmark."}],
        "max_tokens": 16,
        "stream": True,
    },
}
ALL = (
    "llmgw",
    "llmgw-chat",
    "llmgw-2w",
    "vllm-router",
    "sglang-router",
    "starlette+httpx",
    "starlette+aiohttp",
    "starlette+lean",
)


@dataclass
class Row:
    proxy: str
    scenario: str
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_s_per_1k: float
    requests: int
    failed: int
    ratio_vs_vllm_router: float | None = None

    def table(self) -> dict[str, Any]:
        return {
            "proxy": self.proxy,
            "scenario": self.scenario,
            "req/s": round(self.rps),
            "p50 ms": round(self.p50_ms, 2),
            "p99 ms": round(self.p99_ms, 2),
            "CPU s/1k req": round(self.cpu_s_per_1k, 3),
            "x vllm-router": None
            if self.ratio_vs_vllm_router is None
            else round(self.ratio_vs_vllm_router, 2),
            "failed": self.failed,
        }


# -- processes ----------------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` and every descendant (threads are counted in their process)."""
    ticks = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    total = 0.0
    stack = [pid]
    while stack:
        current = stack.pop()
        try:
            stat = Path(f"/proc/{current}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        total += (int(fields[11]) + int(fields[12])) / ticks
        stack.extend(children.get(current, []))
    return total


def _post(url: str, body: bytes, timeout: float = 2.0) -> int:
    request = urllib.request.Request(
        url, data=body, headers={"content-type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
            status: int = response.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


@contextlib.contextmanager
def running(command: list[str], url: str, probe: bytes, timeout: float = 60.0) -> Iterator[int]:
    """Start `command`, wait until `url` answers `probe` with 200, yield its pid, stop it."""
    log = tempfile.NamedTemporaryFile(prefix="bench-proxy-", suffix=".log", delete=False)  # noqa: SIM115 (outlives this frame's with-blocks)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + timeout
        while _post(url, probe) != 200:
            if process.poll() is not None:
                raise RuntimeError(
                    f"{command[0]} exited with {process.returncode}:\n"
                    + Path(log.name).read_text()[-2000:]
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"{command[0]} did not answer within {timeout} s")
            time.sleep(0.2)  # polling a starting process; bounded by the deadline
        yield process.pid
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        log.close()
        os.unlink(log.name)


def proxy_command(
    name: str, port: int, upstreams: list[str], peers: dict[str, str], scratch: Path
) -> list[str] | None:
    python = str(ROOT / ".venv" / "bin" / "python")
    if not Path(python).exists():
        python = sys.executable
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if name in ("llmgw", "llmgw-chat", "llmgw-2w"):
        config = scratch / f"{name}.yaml"
        strategy = "chat" if name == "llmgw-chat" else "ring"
        workers = ["--workers", "2"] if name == "llmgw-2w" else []
        endpoints = ", ".join(f'"{u.removeprefix("http://")}"' for u in upstreams)
        config.write_text(
            f"models:\n  {MODEL}:\n    endpoints: [{endpoints}]\n    strategy: {strategy}\n"
        )
        return [python, "-m", "llmgw.cli", "proxy", "--config", str(config), *workers, *host]
    if name == "vllm-router":
        if name not in peers:
            return None
        return [
            peers[name],
            "--worker-urls",
            *upstreams,
            "--policy",
            "consistent_hash",
            "--log-level",
            "warning",
            "--prometheus-port",
            str(free_port()),
            *host,
        ]
    if name == "sglang-router":
        if name not in peers:
            return None
        return [
            peers[name],
            "launch",
            "--worker-urls",
            *upstreams,
            "--policy",
            "round_robin",
            "--log-level",
            "warn",
            "--prometheus-port",
            str(free_port()),
            *host,
        ]
    if name.startswith("starlette+"):
        client = name.removeprefix("starlette+")
        return [
            python,
            __file__,
            "--serve-baseline",
            client,
            "--port",
            str(port),
            "--upstreams",
            ",".join(upstreams),
        ]
    raise ValueError(name)


# -- load ---------------------------------------------------------------------------------


def h2load(
    tool: str, url: str, body: bytes, clients: int, seconds: float, scratch: Path
) -> tuple[int, int, float, list[float]]:
    """(requests done, failed, elapsed seconds, latencies in ms) of one timed run."""
    body_file = scratch / "body.json"
    body_file.write_bytes(body)
    log_file = scratch / "h2load.log"
    log_file.unlink(missing_ok=True)  # h2load appends to an existing log
    command = [
        tool,
        "--h1",
        "-c",
        str(clients),
        "-t",
        "1",
        "-D",
        f"{round(seconds * 1000)}ms",
        "--warm-up-time",
        "1",
        "-d",
        str(body_file),
        "-H",
        "content-type: application/json",
        "--log-file",
        str(log_file),
        url,
    ]
    started = time.monotonic()
    out = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60, check=False)
    elapsed = time.monotonic() - started
    if out.returncode != 0:
        raise RuntimeError(f"h2load failed: {out.stderr or out.stdout}")
    latencies: list[float] = []
    failed = 0
    for line in log_file.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) < 3 or parts[1] in ("0", "-1"):
            continue  # still open when the timed run ended: cut by h2load, not failed
        if not parts[1].startswith("2"):
            failed += 1
        latencies.append(int(parts[2]) / 1000)
    return len(latencies), failed, elapsed, latencies


def measure(
    tool: str,
    name: str,
    pid: int,
    url: str,
    scenario: str,
    clients: int,
    seconds: float,
    scratch: Path,
) -> Row:
    body = json.dumps(BODIES[scenario]).encode()
    cpu_before = _cpu_seconds(pid)
    wall_before = time.monotonic()
    done, failed, _, latencies = h2load(tool, url, body, clients, seconds, scratch)
    wall = time.monotonic() - wall_before
    cpu = _cpu_seconds(pid) - cpu_before
    # h2load logs only the measured period; CPU covers warm-up too: scale by the share.
    measured_share = seconds / wall if wall > seconds else 1.0
    quantiles = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [0.0] * 99
    return Row(
        proxy=name,
        scenario=scenario,
        rps=done / seconds,
        p50_ms=quantiles[49],
        p99_ms=quantiles[98],
        cpu_s_per_1k=(cpu * measured_share) / max(done, 1) * 1000,
        requests=done,
        failed=failed,
    )


# -- the baselines (Starlette + a client, round-robin, no scheduling) ---------------------


def serve_baseline(client: str, port: int, upstreams: list[str]) -> None:
    import itertools  # noqa: PLC0415

    import uvicorn  # noqa: PLC0415
    from starlette.applications import Starlette  # noqa: PLC0415
    from starlette.background import BackgroundTask  # noqa: PLC0415
    from starlette.requests import Request  # noqa: PLC0415
    from starlette.responses import Response, StreamingResponse  # noqa: PLC0415
    from starlette.routing import Route  # noqa: PLC0415

    hop = {"connection", "keep-alive", "transfer-encoding", "host", "content-length"}
    turn = itertools.cycle(upstreams)
    state: dict[str, Any] = {}

    async def forward(request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k not in hop}
        url = next(turn) + request.url.path
        if client == "httpx":
            upstream = state["client"].build_request("POST", url, content=body, headers=headers)
            response = await state["client"].send(upstream, stream=True)
            return StreamingResponse(
                response.aiter_raw(),
                status_code=response.status_code,
                headers={k: v for k, v in response.headers.items() if k not in hop},
                background=BackgroundTask(response.aclose),
            )
        if client == "aiohttp":
            response = await state["client"].post(url, data=body, headers=headers)
            return StreamingResponse(
                response.content.iter_any(),
                status_code=response.status,
                headers={k: v for k, v in response.headers.items() if k.lower() not in hop},
                background=BackgroundTask(response.release),
            )
        from llmgw.asgi.upstream import UpstreamPool  # noqa: PLC0415

        pool: UpstreamPool = state["client"]
        address = url.removeprefix("http://").split("/", 1)[0]
        raw = [(k.encode(), v.encode()) for k, v in headers.items()]
        lean = await pool.request(address, "POST", request.url.path, raw, body)

        async def chunks() -> Any:
            while data := await lean.next_chunk():
                yield data
            lean.release()

        return StreamingResponse(
            chunks(),
            status_code=lean.status,
            headers={k.decode(): v.decode() for k, v in lean.headers if k.decode() not in hop},
            background=BackgroundTask(lean.close),
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> Any:
        if client == "httpx":
            import httpx  # noqa: PLC0415

            limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
            state["client"] = httpx.AsyncClient(limits=limits, timeout=60)
        elif client == "aiohttp":
            import aiohttp  # noqa: PLC0415

            connector = aiohttp.TCPConnector(limit=512)
            state["client"] = aiohttp.ClientSession(connector=connector)
        else:
            from llmgw.asgi.upstream import UpstreamPool  # noqa: PLC0415

            state["client"] = UpstreamPool()
        yield
        if client == "lean":
            await state["client"].aclose()
        else:
            await state["client"].aclose() if client == "httpx" else await state["client"].close()

    app = Starlette(
        routes=[Route("/v1/chat/completions", forward, methods=["POST"])], lifespan=lifespan
    )
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
    )


# -- main ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default=",".join(ALL), help="comma-separated proxies")
    parser.add_argument("--scenarios", default="non-stream,stream")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=6.0, help="measured seconds per run")
    parser.add_argument("--replicas", type=int, default=4)
    add_install_option(parser)
    parser.add_argument(
        "--serve-baseline", choices=["httpx", "aiohttp", "lean"], help=argparse.SUPPRESS
    )
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--upstreams", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_baseline:
        serve_baseline(args.serve_baseline, args.port, args.upstreams.split(","))
        return 0

    from llmgw.sim.fleet import spawn  # noqa: PLC0415

    tool = find_load_tool(("h2load",))
    if tool is None:
        print("h2load not found (Debian package nghttp2-client)", file=sys.stderr)
        return 2
    peers = ensure_peers(install=args.install_peers)
    names = [n for n in args.only.split(",") if n]
    scenarios = [s for s in args.scenarios.split(",") if s]
    rows: list[Row] = []
    skipped: list[str] = []
    sim_args = ["--replicas", str(args.replicas), "--base-port", "0", "--time-scale", "0",
                "--max-num-seqs", "1024", "--max-queue", "100000"]  # fmt: skip
    with spawn(sim_args) as sim, tempfile.TemporaryDirectory(prefix="bench-asgi-") as tmp:
        scratch = Path(tmp)
        for name in names:
            port = free_port()
            command = proxy_command(name, port, sim.urls, peers, scratch)
            if command is None:
                skipped.append(name)
                continue
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            probe = json.dumps(BODIES["non-stream"]).encode()
            print(f"-- {name}", file=sys.stderr, flush=True)
            with running(command, url, probe) as pid:
                for scenario in scenarios:
                    row = measure(
                        tool.path, name, pid, url, scenario, args.clients, args.seconds, scratch
                    )
                    rows.append(row)
                    print(f"   {scenario}: {row.rps:.0f} req/s", file=sys.stderr, flush=True)
    reference = {r.scenario: r.rps for r in rows if r.proxy == "vllm-router"}
    for row in rows:
        if row.scenario in reference and reference[row.scenario] > 0:
            row.ratio_vs_vllm_router = row.rps / reference[row.scenario]
    print(f"\nh2load --h1 -c {args.clients}, {args.seconds:g} s per run, {args.replicas} sim replicas, "
          f"{os.cpu_count()} cores shared by load tool, proxy and upstreams\n")  # fmt: skip
    print(format_table([r.table() for r in rows]))
    if skipped:
        print(f"\nskipped (not installed): {', '.join(skipped)}")
    path = write_results(
        "asgi_proxy",
        {
            "clients": args.clients,
            "seconds": args.seconds,
            "replicas": args.replicas,
            "cores": os.cpu_count(),
            "rows": [asdict(r) for r in rows],
            "skipped": skipped,
        },
    )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
