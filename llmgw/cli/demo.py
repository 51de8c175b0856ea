"""`llmgw demo` (`make demo`): 4 simulated vLLM replicas, the ext_proc server and a real
Envoy on free loopback ports; a short multi-turn chat workload through Envoy with the
`openai` client; a table of what happened; everything stopped again.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from llmgw.config import TraceSpec
from llmgw.scheduling.strategies import PRESETS


@dataclass(frozen=True)
class Turn:
    session: str | None
    replica: str
    ttft_ms: float
    total_ms: float
    status: int


def _chat_turn(client: Any, session: str | None, history: list[dict[str, str]]) -> Turn:
    headers = {"x-session-id": session} if session else {}
    started = time.perf_counter()
    raw = client.chat.completions.with_raw_response.create(
        model="m1", messages=history, stream=True, max_tokens=24, extra_headers=headers
    )
    ttft: float | None = None
    text: list[str] = []
    for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - started
            text.append(chunk.choices[0].delta.content)
    total = time.perf_counter() - started
    history.append({"role": "assistant", "content": "".join(text)})
    return Turn(
        session=session,
        replica=raw.headers.get("x-sim-replica", "?"),
        ttft_ms=(ttft if ttft is not None else total) * 1e3,
        total_ms=total * 1e3,
        status=raw.status_code,
    )


# Each user opens with their own trip notes (`--context-tokens`, ~400 by default), as real
# chats carry context: the history is then worth keeping where it is cached, so a turn moves
# only when its first token is predicted sooner elsewhere, the history's prefill included.
_PLACES = ("Alfama", "Belem", "Sintra", "Cascais", "Baixa", "Chiado", "LX Factory", "Oceanario")


def _trip_notes(session: str, tokens: int) -> str:
    """About `tokens` tokens (4 characters each) of `session`'s own notes; "" for 0."""
    lines: list[str] = []
    size = 0
    while size < 4 * tokens:
        d = len(lines)
        lines.append(
            f"Day {d + 1}: morning in {_PLACES[(d + len(session)) % len(_PLACES)]}, lunch near "
            f"{_PLACES[(d * 3 + 1) % len(_PLACES)]}, an evening walk, a budget of {40 + 7 * d} "
            f"euros, a note for {session} about trams, tickets and opening hours."
        )
        size += len(lines[-1]) + 1
    return f"My trip notes ({session}):\n" + "\n".join(lines) if lines else ""


def _conversation(client: Any, session: str, turns: int, context_tokens: int) -> list[Turn]:
    history = [{"role": "system", "content": "You are a concise travel assistant."}]
    notes = _trip_notes(session, context_tokens)
    if notes:
        history += [
            {"role": "user", "content": notes},
            {"role": "assistant", "content": "Noted. Ask me anything about the trip."},
        ]
    out = []
    for i in range(turns):
        history.append({"role": "user", "content": f"{session}: question {i + 1} about Lisbon?"})
        out.append(_chat_turn(client, session, history))
    return out


def _pct(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def _reasons(telemetry: Any) -> Counter[str]:
    counts: Counter[str] = Counter()
    for metric in telemetry.registry.collect():
        if metric.name == "llmgw_decisions":
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels["reason"]] += int(sample.value)
    return counts


def demo_fleet() -> Any:
    """The demo's 4 simulated vLLM replicas (a `ThreadedFleet`; tests and replay use it)."""
    from llmgw.sim import SimFleet  # noqa: PLC0415

    return SimFleet.start_in_thread(
        replicas=4, model="m1", seed=1, decode_ms=4.0, default_output_tokens=(12, 24)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmgw demo", description=__doc__)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--anonymous", type=int, default=12, help="requests without a session")
    parser.add_argument(
        "--context-tokens",
        type=int,
        default=400,
        help="each conversation opens with about this many tokens of its own notes (0: none)",
    )
    parser.add_argument(
        "--strategy",
        default="latency",
        choices=tuple(PRESETS),
        help="strategy preset (default latency)",
    )
    parser.add_argument(
        "--trace", help="write the decision trace here (JSONL; `llmgw replay` reads it)"
    )
    parser.add_argument(
        "--edge",
        choices=("envoy", "proxy"),
        default="envoy",
        help="route through Envoy + the ext_proc server (default) or the embedded proxy",
    )
    args = parser.parse_args(argv or [])
    if args.context_tokens < 0:
        parser.error("--context-tokens must be >= 0")
    try:  # (the runtime's trace needs prometheus_client, not in the base install either)
        import openai  # noqa: PLC0415

        import llmgw.sim  # noqa: F401, PLC0415 (checked here, used by demo_fleet)
        from llmgw.runtime.trace import trace_problem  # noqa: PLC0415
        from llmgw.testing.extproc import (  # noqa: PLC0415
            EnvoyProcess,
            ExtProcThread,
            fleet_config,
            loopback_bootstrap,
        )
    except ImportError as exc:
        print(f"llmgw demo needs the extproc, sim and dev extras: {exc}", file=sys.stderr)
        return 2
    if args.trace:  # before the fleet starts, not a warning in the log and a claimed trace
        problem = trace_problem(TraceSpec(path=args.trace), 1)
        if problem is not None:
            parser.error(problem.replace("trace.path", "--trace"))

    began = time.monotonic()
    front = "Envoy, the ext_proc server" if args.edge == "envoy" else "the llmgw proxy"
    print(f"starting 4 simulated vLLM replicas and {front} ...")
    fleet = demo_fleet()
    extproc: ExtProcThread | None = None
    envoy: EnvoyProcess | None = None
    proxy: Any = None
    try:
        trace = {"trace": {"path": args.trace}} if args.trace else {}
        # override-host: Envoy retries down the Decision's fallbacks, so list them.
        config = fleet_config(fleet, strategy=args.strategy, destination_fallbacks=True, **trace)
        if args.edge == "proxy":
            from llmgw.testing.proxy import ProxyThread  # noqa: PLC0415 (needs the asgi extra)

            proxy = ProxyThread(config)
            base_url, telemetry = proxy.url, proxy.app.telemetry
        else:
            extproc = ExtProcThread(config)
            envoy = EnvoyProcess(
                loopback_bootstrap(
                    config,
                    extproc.address,
                    shape="override-host",
                )
            )
            base_url, telemetry = envoy.url, extproc.server.telemetry
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="demo", max_retries=0)
        sessions = [f"user-{i + 1}" for i in range(args.sessions)]
        with ThreadPoolExecutor(max_workers=max(1, args.sessions)) as pool:
            conversations = list(
                pool.map(
                    lambda s: _conversation(client, s, args.turns, args.context_tokens), sessions
                )
            )
            anonymous = list(
                pool.map(
                    lambda i: _chat_turn(
                        client, None, [{"role": "user", "content": f"one-off question {i}"}]
                    ),
                    range(args.anonymous),
                )
            )
        client.close()
        turns = [t for conv in conversations for t in conv] + anonymous
        print(_report(conversations, anonymous, turns, _reasons(telemetry)))
        if envoy is not None and extproc is not None:
            print(
                "\nwhere to look (while it runs; `llmgw extproc` + `llmgw envoy-config` for real):"
            )
            print(f"  Envoy listener    {envoy.url}/v1/chat/completions")
            print(f"  Envoy admin       {envoy.admin_url}/stats/prometheus")
            print(f"  llmgw metrics     http://127.0.0.1:{extproc.ports['metrics']}/metrics")
            print(f"  llmgw health      http://127.0.0.1:{extproc.ports['health']}/readyz")
        failed = sum(1 for t in turns if t.status != 200)
        print(f"\n{len(turns)} requests, {failed} failed, {time.monotonic() - began:.1f} s")
        if args.trace:
            print(f"decision trace in {args.trace}: try `llmgw replay {args.trace} --strategies")
            print("  latency,chat,round-robin --engine-args replicas=4,decode_ms=4`")
        return 0 if failed == 0 else 1
    finally:
        if proxy is not None:
            proxy.stop()
        if envoy is not None:
            envoy.stop()
        if extproc is not None:
            extproc.stop()
        fleet.stop()
        print(f"stopped {front} and the simulated replicas")


def _report(
    conversations: list[list[Turn]],
    anonymous: list[Turn],
    turns: list[Turn],
    reasons: Counter[str],
) -> str:
    per_replica = Counter(t.replica for t in turns)
    sticky = sum(1 for conv in conversations for t in conv if t.replica == conv[0].replica)
    session_turns = sum(len(conv) for conv in conversations)
    ttft = [t.ttft_ms for t in turns]
    lines = ["", "requests per replica"]
    for replica in sorted(per_replica):
        sessions = sorted({t.session for t in turns if t.replica == replica and t.session})
        lines.append(
            f"  replica {replica}: {per_replica[replica]:3d} requests"
            f"   sessions: {', '.join(s or '' for s in sessions) or '-'}"
        )
    lines += [
        "",
        f"session stickiness     {100.0 * sticky / max(1, session_turns):5.1f} %"
        f"  ({sticky}/{session_turns} turns on their session's first replica)",
        "  (a turn moves only when its first token is predicted sooner elsewhere, its"
        " history's prefill there included)",
        f"no-session spread      {len({t.replica for t in anonymous})} replicas"
        f" for {len(anonymous)} requests",
        f"TTFT p50 / p90         {_pct(ttft, 50):6.1f} / {_pct(ttft, 90):6.1f} ms",
        f"latency p50 / p90      {_pct([t.total_ms for t in turns], 50):6.1f} / "
        f"{_pct([t.total_ms for t in turns], 90):6.1f} ms",
        "decision reasons       "
        + ", ".join(f"{reason}: {n}" for reason, n in reasons.most_common()),
        "  (the scorer that put the chosen replica ahead: latency = predicted fastest first"
        " token, session = the ring broke a near-tie, max-score = an exact tie)",
    ]
    return "\n".join(lines)
