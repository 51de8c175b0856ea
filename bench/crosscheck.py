"""Routers on an engine and workloads that llmgw was not tuned on (`bench/xsim/`).

    .venv/bin/python bench/crosscheck.py                       # every workload (20) x 5 contenders, ~97 min
    .venv/bin/python bench/crosscheck.py --workloads chat-moderate --only envoy:latency
    .venv/bin/python bench/crosscheck.py --metrics minimal     # engines publish gauges only
    .venv/bin/python bench/crosscheck.py --metrics none        # engines publish nothing
    .venv/bin/python bench/crosscheck.py --cache-info          # engines say their KV size
    .venv/bin/python bench/crosscheck.py --role-chunk at-once  # a role-only chunk at once
    .venv/bin/python bench/crosscheck.py --replicas 8          # 8 replicas, rates x 2
    .venv/bin/python bench/crosscheck.py --seeds 1,2,3 --workloads chat-moderate  # pooled

`bench/routing.py` ranks routers on llmgw's own simulator and regime grid; this runs the
same contenders (started by routing.py's own code: llmgw through a real Envoy, `llmgw
proxy`, the peer routers, client-side hashing and round-robin) on
`bench/xsim/engine.py` (its own tokenizer, scheduler, costs and metrics subset) with
`bench/xsim/workloads.py`. TTFT is timed at the client's first content chunk. Prints TTFT
p90 per contender x workload with the ratio to the best, writes
bench/results/<out>.json and <out>.txt. One run: compare within it; each p90 has a 95 %
interval, and `--seeds` pools several runs' requests per workload (a single run's p90
moves by more than a few percent).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench._tools import FAIL, format_table, write_results  # noqa: E402
from bench.peers import PEER_POLICIES, add_install_option, ensure_peers  # noqa: E402
from bench.routing import (  # noqa: E402
    Contender,
    _picker,
    _python,
    above_best,
    add_body_mode_option,
    add_try_option,
    all_contenders,
    base_port,
    best_p90,
    body_mode_contenders,
    fell_on_failure,
    pool,
    pooled_text,
    records_file,
    run_one,
    seed_records,
    seeds_of,
    start_contender,
    try_contenders,
    warm_up,
)
from bench.workloads import Workload  # noqa: E402
from bench.xsim.workloads import FLEET_KV_BLOCKS, SPECS, build  # noqa: E402

DEFAULT_CONTENDERS = (
    "envoy:latency",
    "asgi:default",
    "sglang-router:cache_aware",
    "client:ring",
    "client:round-robin",
)


class Fleet:
    """`bench/xsim/engine.py` in a child process; `urls` once it says READY."""

    def __init__(
        self,
        replicas: int,
        kv_blocks: int,
        metrics: str,
        cache_info: bool,
        engine_args: tuple[str, ...] = (),
    ) -> None:
        cmd = [_python(), "-m", "bench.xsim.engine", "--replicas", str(replicas)]
        cmd += ["--base-port", str(base_port(replicas) or 18600)]
        cmd += ["--kv-blocks", str(kv_blocks)]
        cmd += ["--metrics", metrics] + (["--cache-info"] if cache_info else [])
        cmd += engine_args
        self.proc = subprocess.Popen(cmd, cwd=HERE.parent, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            self.proc.kill()
            raise RuntimeError(f"xsim engine did not start: {line!r}")
        self.urls = line.split()[1:]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workloads", default=",".join(SPECS))
    parser.add_argument("--only", default=",".join(DEFAULT_CONTENDERS))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--seeds",
        help="comma-separated seeds: every workload once per seed, then each workload's "
        "requests of all seeds pooled (p90 with a 95%% interval); instead of --seed",
    )
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument(
        "--scale", type=float, default=None, help="arrival rates x this (default replicas / 4)"
    )
    parser.add_argument("--metrics", choices=("full", "minimal", "none"), default="full")
    parser.add_argument("--cache-info", action="store_true")
    parser.add_argument(
        "--role-chunk",
        choices=("with-token", "at-once"),
        default="with-token",
        help="engines send the chat stream's role chunk with the first token (vLLM) or at once",
    )
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--out", default="crosscheck")
    add_install_option(parser)
    add_body_mode_option(parser)
    add_try_option(parser)
    args = parser.parse_args(argv)
    names = args.workloads.split(",")
    unknown = [n for n in names if n not in SPECS]
    if unknown:
        parser.error(f"unknown workloads {unknown} (known: {', '.join(SPECS)})")
    extra = body_mode_contenders(args.body_modes) + try_contenders(parser, args.tries)
    by_name = {c.name: c for c in all_contenders() + extra}
    # --try and --body-mode contenders always run; --only may name them too
    wanted = list(dict.fromkeys(args.only.split(",") + [c.name for c in extra]))
    missing = [n for n in wanted if n not in by_name]
    if missing:
        parser.error(f"unknown contenders {missing} (known: {', '.join(by_name)})")
    if args.replicas < 1:
        parser.error("--replicas must be at least 1")
    if args.scale is not None and not args.scale > 0:
        parser.error("--scale must be > 0")
    peers = ensure_peers(install=args.install_peers)
    contenders = []
    for n in wanted:
        if by_name[n].edge in PEER_POLICIES and by_name[n].edge not in peers:
            print(f"skipping {n}: not installed (`make bench` or --install-peers installs it)")
        else:
            contenders.append(by_name[n])
    scale = args.scale if args.scale is not None else args.replicas / 4
    seeds = seeds_of(args)
    started = time.monotonic()
    texts: list[str] = []
    by_seed: dict[str, Any] = {}
    with seed_records(seeds) as folders:
        for seed, folder in zip(seeds, folders, strict=True):
            if len(seeds) > 1:
                print(f"\n######## seed {seed} ########")
            results = _run_seed(args, seed, scale, names, contenders, peers, folder)
            by_seed[str(seed)] = results
            texts.append(f"## seed {seed}\n" + format_table(_rows(results, names, contenders)))
        root = folders[0].parent if folders[0] is not None else None
        pooled = pool(root, seeds, names, contenders) if root is not None else None
    if pooled is not None:
        texts.append(pooled_text(pooled, seeds, contenders))
    command = "python bench/crosscheck.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = (
        f"# {command.strip()}\n# engines: bench/xsim, {args.replicas} replicas, rates x {scale:g} "
        f"(metrics {args.metrics}, cache info "
        f"{args.cache_info}, role chunk {args.role_chunk}); TTFT p90 ms (x the best in the column; * its 95% interval wholly "
        f"above the best's, and with seeds pooled slower than it in every seed; fail: the p90 "
        f"fell on a failed request; -: not run); "
        f"{time.monotonic() - started:.0f} s\n" + "\n\n".join(texts)
    )
    print(text)
    (HERE / "results" / f"{args.out}.txt").write_text(text + "\n")
    data: dict[str, Any] = {"args": vars(args), "results": by_seed[str(seeds[0])]}
    if pooled is not None:
        data |= {"results_by_seed": by_seed, "pooled": pooled}
    write_results(args.out, data)
    return 0


def _run_seed(
    args: argparse.Namespace,
    seed: int,
    scale: float,
    names: list[str],
    contenders: list[Contender],
    peers: dict[str, str],
    records: Path | None,
) -> dict[str, dict[str, dict[str, Any]]]:
    """Every contender on every workload of one seed (one engine process per fleet)."""
    workloads = {n: build(n, seed, scale) for n in names}
    for n, wl in workloads.items():
        print(f"{n}: {wl.description}, {wl.requests} requests, {wl.params['offered_req_s']} req/s")
    results: dict[str, dict[str, dict[str, Any]]] = {n: {} for n in names}
    # One engine process per (KV size, fault flags): workloads that share both share it.
    fleets = sorted({(SPECS[n].fleet, SPECS[n].engine_args()) for n in names})
    for fleet_name, engine_args in fleets:
        group = [
            n
            for n in names
            if (SPECS[n].fleet, SPECS[n].engine_args()) == (fleet_name, engine_args)
        ]
        kv = FLEET_KV_BLOCKS[fleet_name]
        role = ("--role-chunk", args.role_chunk) if args.role_chunk != "with-token" else ()
        fleet = Fleet(args.replicas, kv, args.metrics, args.cache_info, (*engine_args, *role))
        try:
            with tempfile.TemporaryDirectory(prefix="crosscheck-") as scratch:
                for contender in contenders:
                    try:
                        _run_contender(
                            args, contender, fleet, group, workloads, peers, Path(scratch),
                            records, results,
                        )  # fmt: skip
                    except RuntimeError as exc:  # as routing.py's grid: the others still run
                        print(f"  {contender.name}: failed: {exc}", flush=True)
        finally:
            fleet.close()
    return results


def _run_contender(
    args: argparse.Namespace,
    contender: Contender,
    fleet: Fleet,
    group: list[str],
    workloads: dict[str, Workload],
    peers: dict[str, str],
    scratch: Path,
    records: Path | None,
    results: dict[str, dict[str, dict[str, Any]]],
) -> None:
    """One contender on the workloads of one fleet; RuntimeError if it fails to start (or a
    run finds the fleet still busy)."""
    with start_contender(contender, fleet.urls, peers, scratch) as base:
        if base:
            asyncio.run(warm_up(base))
        for n in group:
            to = None if records is None else records_file(records, contender.name, n)
            summary = asyncio.run(
                run_one(base, fleet.urls, workloads[n], args.timeout,
                        _picker(contender, fleet.urls, base), "/xsim/metrics", to)
            )  # fmt: skip
            summary.pop("load_samples", None)
            results[n][contender.name] = summary
            print(
                f"  {contender.name:28s} {n:15s} TTFT p50/p90 "
                f"{summary['ttft_p50_ms']}/{summary['ttft_p90_ms']} ms, hit "
                f"{summary['prefix_hit_rate']}, busy {summary['busy_max_mean']}"
                f", errors {summary['errors']}, unread tokens "
                f"{summary['unread_tokens']}",
                flush=True,
            )


def _rows(
    results: dict[str, dict[str, dict[str, Any]]], names: list[str], contenders: list[Contender]
) -> list[dict[str, Any]]:
    rows = []
    for c in contenders:
        row: dict[str, Any] = {"contender": c.name}
        for n in names:
            s = results[n].get(c.name)
            best = best_p90(results[n])  # the one `*` compares with, as routing.py's tables
            mark = "*" if s is not None and above_best(s, results[n]) else ""
            if s is not None and fell_on_failure(s):
                row[n] = FAIL + mark  # slower than any answer; `-` is "not run"
            elif s is None or not s.get("ttft_p90_ms") or not best:
                row[n] = None
            else:
                row[n] = f"{s['ttft_p90_ms']:.0f} ({s['ttft_p90_ms'] / best:.2f}x){mark}"
        rows.append(row)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
