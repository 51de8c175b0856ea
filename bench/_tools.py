"""Helpers shared by benchmarks: find (or install) an HTTP load tool, run it, parse it,
print a table, write JSON results.

    tool = find_load_tool()                       # h2load, else wrk, else hey
    result = run_load(tool, url, body=b"{...}", requests=20000, clients=32)
    print(format_table([result.row()]))
    write_results("my_bench", {"runs": [result.to_json()]})

h2load comes from the Debian package `nghttp2-client`, which `make bench` installs at set-up;
`find_load_tool(install=True)` runs `apt-get install` itself when no tool is on PATH and we
are root (only when asked: a benchmark run installs nothing by default).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# A measurement that fell on a failed request (a p90 among timeouts): the worst result,
# printed in its numeric column where `-` means no value (not run).
FAIL = "fail"
TOOLS = ("h2load", "wrk", "hey")
_APT_PACKAGES = {"h2load": "nghttp2-client", "wrk": "wrk", "hey": "hey"}


@dataclass(frozen=True)
class LoadTool:
    name: str
    path: str


@dataclass
class LoadResult:
    """One load run; latencies in milliseconds, `None` when the tool does not say."""

    tool: str
    url: str
    clients: int
    requests: int
    seconds: float
    rps: float
    succeeded: int
    failed: int
    status_2xx: int | None = None
    status_non_2xx: int | None = None
    latency_mean_ms: float | None = None
    latency_max_ms: float | None = None
    label: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        return {
            "scenario": self.label,
            "clients": self.clients,
            "requests": self.requests,
            "req/s": round(self.rps),
            "ok": self.succeeded,
            "failed": self.failed,
            "mean ms": _round(self.latency_mean_ms),
            "max ms": _round(self.latency_max_ms),
        }

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def find_load_tool(preferred: tuple[str, ...] = TOOLS, install: bool = False) -> LoadTool | None:
    """The first tool of `preferred` on PATH; installs h2load with apt when asked."""
    for name in preferred:
        path = shutil.which(name)
        if path:
            return LoadTool(name, path)
    if install and hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        package = _APT_PACKAGES[preferred[0]] if preferred else "nghttp2-client"
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=False, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", package], check=False, env=env)
        return find_load_tool(preferred, install=False)
    return None


def _duration_ms(text: str) -> float:
    """'2.24ms', '533us', '1.2s', '0.0123 secs' -> milliseconds."""
    match = re.fullmatch(r"([\d.]+)\s*(us|ms|s|secs)", text.strip())
    if not match:
        raise ValueError(f"not a duration: {text!r}")
    value, unit = float(match.group(1)), match.group(2)
    return value * {"us": 1e-3, "ms": 1.0, "s": 1e3, "secs": 1e3}[unit]


def parse_h2load(output: str) -> dict[str, Any]:
    finished = re.search(r"finished in ([\d.]+(?:us|ms|s)), ([\d.]+) req/s", output)
    counts = re.search(r"requests: (\d+) total.*?(\d+) succeeded, (\d+) failed, (\d+) errored",
                       output)  # fmt: skip
    statuses = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", output)
    latency = re.search(r"time for request:\s+(\S+)\s+(\S+)\s+(\S+)", output)
    if not (finished and counts):
        raise ValueError("unexpected h2load output:\n" + output)
    return {
        "seconds": _duration_ms(finished.group(1)) / 1e3,
        "rps": float(finished.group(2)),
        "requests": int(counts.group(1)),
        "succeeded": int(counts.group(2)),
        # `errored` (network errors) is a subset of `failed` (those and non-2xx/3xx answers)
        "failed": int(counts.group(3)),
        "status_2xx": int(statuses.group(1)) if statuses else None,
        "status_non_2xx": sum(int(statuses.group(i)) for i in (2, 3, 4)) if statuses else None,
        "latency_mean_ms": _duration_ms(latency.group(3)) if latency else None,
        "latency_max_ms": _duration_ms(latency.group(2)) if latency else None,
    }


def parse_wrk(output: str) -> dict[str, Any]:
    rps = re.search(r"Requests/sec:\s+([\d.]+)", output)
    total = re.search(r"(\d+) requests in ([\d.]+)(\w+)", output)
    latency = re.search(r"Latency\s+(\S+)\s+\S+\s+(\S+)", output)
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)",
                       output)  # fmt: skip
    if not (rps and total):
        raise ValueError("unexpected wrk output:\n" + output)
    requests = int(total.group(1))
    bad = int(non_2xx.group(1)) if non_2xx else 0
    failed = bad + (sum(int(errors.group(i)) for i in range(1, 5)) if errors else 0)
    return {
        "seconds": _duration_ms(total.group(2) + total.group(3)) / 1e3,
        "rps": float(rps.group(1)),
        "requests": requests,
        "succeeded": requests - bad,
        "failed": failed,
        "status_2xx": requests - bad,
        "status_non_2xx": bad,
        "latency_mean_ms": _duration_ms(latency.group(1)) if latency else None,
        "latency_max_ms": _duration_ms(latency.group(2)) if latency else None,
    }


def parse_hey(output: str) -> dict[str, Any]:
    total = re.search(r"Total:\s+([\d.]+) secs", output)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", output)
    mean = re.search(r"Average:\s+([\d.]+) secs", output)
    slowest = re.search(r"Slowest:\s+([\d.]+) secs", output)
    codes = {int(c): int(n) for c, n in re.findall(r"\[(\d{3})\]\s+(\d+) responses", output)}
    if not (total and rps):
        raise ValueError("unexpected hey output:\n" + output)
    ok = sum(n for c, n in codes.items() if 200 <= c < 300)
    bad = sum(n for c, n in codes.items() if not 200 <= c < 300)
    return {
        "seconds": float(total.group(1)),
        "rps": float(rps.group(1)),
        "requests": ok + bad,
        "succeeded": ok,
        "failed": bad,
        "status_2xx": ok,
        "status_non_2xx": bad,
        "latency_mean_ms": float(mean.group(1)) * 1e3 if mean else None,
        "latency_max_ms": float(slowest.group(1)) * 1e3 if slowest else None,
    }


def run_load(
    tool: LoadTool,
    url: str,
    *,
    body: bytes | None = None,
    requests: int = 10_000,
    clients: int = 32,
    threads: int = 1,
    duration_s: float = 5.0,
    headers: dict[str, str] | None = None,
    label: str = "",
    timeout_s: float = 300.0,
) -> LoadResult:
    """Run the tool once against `url` (POST when `body` is given) over HTTP/1.1.

    h2load and hey send `requests` requests; wrk runs for `duration_s` instead.
    """
    all_headers = {"content-type": "application/json", **(headers or {})} if body else headers or {}
    with tempfile.TemporaryDirectory(prefix="bench-") as scratch:
        body_file = Path(scratch) / "body"
        if body is not None:
            body_file.write_bytes(body)
        if tool.name == "h2load":
            command = [tool.path, "--h1", "-n", str(requests), "-c", str(clients),
                       "-t", str(threads)]  # fmt: skip
            if body is not None:
                command += ["-d", str(body_file)]
            for name, value in all_headers.items():
                command += ["-H", f"{name}: {value}"]
            parse = parse_h2load
        elif tool.name == "wrk":
            script = Path(scratch) / "post.lua"
            lines = [f'wrk.headers["{k}"] = "{v}"' for k, v in all_headers.items()]
            if body is not None:
                lines += ['wrk.method = "POST"', f"wrk.body = {json.dumps(body.decode())}"]
            script.write_text("\n".join(lines) + "\n")
            command = [tool.path, "-c", str(clients), "-t", str(threads),
                       "-d", f"{duration_s}s", "--latency", "-s", str(script)]  # fmt: skip
            parse = parse_wrk
        elif tool.name == "hey":
            command = [tool.path, "-n", str(requests), "-c", str(clients)]
            if body is not None:
                command += ["-m", "POST", "-D", str(body_file)]
            for name, value in all_headers.items():
                command += ["-H", f"{name}: {value}"]
            parse = parse_hey
        else:
            raise ValueError(f"unknown load tool {tool.name}")
        command.append(url)
        completed = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    if completed.returncode != 0:
        raise RuntimeError(f"{tool.name} failed ({completed.returncode}): {completed.stderr}")
    parsed = parse(completed.stdout)
    return LoadResult(tool=tool.name, url=url, clients=clients, label=label, **parsed)


def format_table(rows: list[dict[str, Any]]) -> str:
    """A plain aligned text table; column order from the first row; numbers (and `FAIL`)
    right-aligned."""
    if not rows:
        return "(no rows)"
    columns = list(rows[0])
    cells = [[("-" if row.get(c) is None else str(row.get(c))) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))
    rule = "  ".join("-" * w for w in widths)
    numeric = [
        all(isinstance(row.get(c), int | float | None) or row.get(c) == FAIL for row in rows)
        for c in columns
    ]
    body = [
        "  ".join(
            v.rjust(w) if num else v.ljust(w) for v, w, num in zip(r, widths, numeric, strict=True)
        )
        for r in cells
    ]
    return "\n".join([line, rule, *body])


def write_results(name: str, data: dict[str, Any]) -> Path:
    """Write `bench/results/<name>.json` (pretty, sorted keys) and return its path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path
