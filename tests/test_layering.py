"""The core stays pure: no network, gRPC, protobuf, ASGI or HTTP client imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "llmgw"
# I/O lives here; everything else in llmgw/ is the pure core.
IMPURE = {"runtime", "sim", "cli.py", "demo.py", "logs.py"}
FORBIDDEN = {
    "grpc",
    "google.protobuf",
    "envoy",
    "starlette",
    "fastapi",
    "uvicorn",
    "aiohttp",
    "httpx",
    "httptools",
    "requests",
    "socket",
    "asyncio",
    "urllib.request",
    "http.client",
    "kubernetes",
    "prometheus_client",
    "extproc",
    "asgi",
}


def core_files() -> list[Path]:
    out = []
    for path in CORE.rglob("*.py"):
        rel = path.relative_to(CORE)
        if rel.parts[0] in IMPURE:
            continue
        out.append(path)
    return sorted(out)


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_core_has_files() -> None:
    assert len(core_files()) >= 10


@pytest.mark.parametrize("path", core_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_module_imports_no_io(path: Path) -> None:
    bad = sorted(
        m for m in imported_modules(path) if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)
    )
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: I/O belongs in runtime/ or an edge"


def test_simulator_imports_nothing_from_the_router() -> None:
    sim = CORE / "sim"
    for path in sim.rglob("*.py"):
        bad = sorted(
            m
            for m in imported_modules(path)
            if m.startswith("llmgw.") and not m.startswith("llmgw.sim")
        )
        assert not bad, f"{path.relative_to(ROOT)} imports router code {bad}"
