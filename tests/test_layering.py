"""The layers in layers.toml hold: every Python file belongs to a part and imports nothing
its part forbids (no exemptions); the core's modules form no import cycle."""

from __future__ import annotations

import ast
import os
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
RULES: dict[str, Any] = tomllib.loads((ROOT / "layers.toml").read_text())
PARTS: dict[str, dict[str, Any]] = RULES["parts"]
INSTALLED = "llmgw"  # the one installed name; llmgw/ reaches the edges and sim/ by symlink
SKIP_DIRS = {"build", "__pycache__", "node_modules"}


@dataclass(frozen=True)
class Source:
    path: PurePosixPath  # real path, relative to the repository root
    module: str  # the name it is imported by


def _module_of(rel: PurePosixPath) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _walk(top: Path, follow: bool) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(top, followlinks=follow):
        dirnames[:] = sorted(
            d
            for d in dirnames
            if not d.startswith(".") and d not in SKIP_DIRS and not d.endswith(".egg-info")
        )
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def _real(path: Path) -> PurePosixPath:
    return PurePosixPath(path.resolve().relative_to(ROOT).as_posix())


def sources() -> list[Source]:
    """Every Python file once, by real path, with the name it is imported by: llmgw/ is
    walked through its symlinks (the installed view), the rest of the tree as it is."""
    found: dict[PurePosixPath, str] = {}
    for path in _walk(ROOT / INSTALLED, follow=True):
        found[_real(path)] = _module_of(PurePosixPath(path.relative_to(ROOT).as_posix()))
    for path in _walk(ROOT, follow=False):
        found.setdefault(_real(path), _module_of(_real(path)))
    return [Source(p, m) for p, m in sorted(found.items())]


def part_of(path: PurePosixPath) -> str | None:
    best: tuple[int, str | None] = (-1, None)
    for name, part in PARTS.items():
        for prefix in part["paths"]:
            n = len(PurePosixPath(prefix).parts)
            if path.parts[:n] == PurePosixPath(prefix).parts and n > best[0]:
                best = (n, name)
    return best[1]


SOURCES = sources()
# Every repository module (and package) by the name code imports it with -> its part.
MODULE_PART: dict[str, str] = {
    s.module: part for s in SOURCES if (part := part_of(s.path)) is not None
}
# Folder names that are not installed (`extproc.server` for `llmgw.extproc.server`).
ALIASES: dict[str, str] = {
    _module_of(s.path): s.module for s in SOURCES if _module_of(s.path) != s.module
}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def imports(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) for every import, however deeply nested (function-level
    and TYPE_CHECKING imports included); `from x import y` also yields `x.y`."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def _owner(name: str) -> tuple[str, str] | None:
    """The repository module `name` is, or is inside: (module, part)."""
    probe = name
    while probe:
        if probe in MODULE_PART:
            return probe, MODULE_PART[probe]
        probe = probe.rpartition(".")[0]
    return None


def violations(source: str, path: str, module: str | None = None) -> list[str]:
    """What `source`, placed at `path` (relative to the root), imports against the rules."""
    rel = PurePosixPath(path)
    part = part_of(rel)
    if part is None:
        return [f"{path}: belongs to no part of layers.toml"]
    rules = PARTS[part]
    module = module or _module_of(rel)
    tree = ast.parse(source, filename=path)
    found: list[str] = []
    for line, name in imports(tree, module, rel.name == "__init__.py"):
        where = f"{path}:{line}"
        alias = next((a for a in ALIASES if _within(name, a)), None)
        if alias is not None:
            found.append(
                f"{where}: imports {name!r} by its folder name: only {INSTALLED!r} is "
                f"installed, import {ALIASES[alias] + name[len(alias) :]!r}"
            )
        owner = _owner(ALIASES[alias] + name[len(alias) :] if alias else name)
        if owner is not None and owner[1] in rules["forbid"]:
            found.append(
                f"{where}: {part} imports {name!r} (part {owner[1]}): layers.toml forbids "
                f"{part} -> {owner[1]}"
            )
        elif owner is None:
            for external in rules.get("forbid_external", []):
                if _within(name, external):
                    found.append(f"{where}: {part} imports {name!r}: layers.toml forbids it")
    return sorted(set(found))


@pytest.mark.parametrize("source", SOURCES, ids=[str(s.path) for s in SOURCES])
def test_file_imports_only_what_its_part_allows(source: Source) -> None:
    text = (ROOT / source.path).read_text(encoding="utf-8")
    problems = violations(text, str(source.path), source.module)
    assert not problems, "\n".join(problems)


def test_every_part_is_a_path_that_exists_and_forbids_only_known_parts() -> None:
    for name, part in PARTS.items():
        for prefix in part["paths"]:
            assert (ROOT / prefix).exists(), f"parts.{name}.paths: {prefix} does not exist"
        unknown = set(part["forbid"]) - set(PARTS)
        assert not unknown, f"parts.{name}.forbid: unknown parts {sorted(unknown)}"


def test_every_part_has_files_and_the_core_most() -> None:
    counts = {name: sum(1 for s in SOURCES if part_of(s.path) == name) for name in PARTS}
    assert all(counts.values()), counts
    assert counts["core"] >= 10, counts


def test_edges_and_simulator_install_under_llmgw() -> None:
    for folder in ("extproc", "asgi", "sim"):
        link = ROOT / INSTALLED / folder
        assert link.is_symlink() and link.resolve() == ROOT / folder, link
        assert MODULE_PART[f"{INSTALLED}.{folder}"] == folder


@pytest.mark.parametrize(
    ("path", "source", "phrase"),
    [
        ("llmgw/types.py", "import extproc\n", "core imports 'extproc' (part extproc)"),
        ("llmgw/types.py", "import extproc\n", "by its folder name"),
        ("llmgw/types.py", "import llmgw.extproc\n", "forbids core -> extproc"),
        ("llmgw/scheduling/x.py", "from llmgw import sim\n", "forbids core -> sim"),
        ("llmgw/types.py", "from llmgw.runtime.router import Router\n", "core -> runtime"),
        ("llmgw/types.py", "def f():\n    from llmgw.cli import demo\n", "core -> cli"),
        ("llmgw/types.py", "import grpc.aio\n", "core imports 'grpc.aio'"),
        ("sim/fleet.py", "from llmgw.types import Endpoint\n", "forbids sim -> core"),
        ("extproc/x.py", "from llmgw.asgi.types import ASGIApp\n", "extproc -> asgi"),
        ("asgi/x.py", "from llmgw.extproc import translate\n", "asgi -> extproc"),
        ("extproc/x.py", "from llmgw.testing.extproc import Stack\n", "extproc -> testing"),
        ("llmgw/runtime/x.py", "import tests.core.helpers\n", "runtime -> tests"),
        ("llmgw/scheduling/x.py", "from ..runtime import router\n", "core -> runtime"),
    ],
)
def test_checker_reports_a_forbidden_import(path: str, source: str, phrase: str) -> None:
    problems = violations(source, path)
    assert any(phrase in p for p in problems), problems


def test_checker_allows_what_the_rules_allow() -> None:
    assert violations("from llmgw.types import Endpoint\nimport orjson\n", "llmgw/x.py") == []
    assert violations("from llmgw.runtime.router import Router\n", "extproc/x.py") == []
    assert violations("from llmgw.sim import SimFleet\n", "llmgw/testing/x.py") == []
    assert violations("from .helpers import context\n", "tests/core/test_x.py") == []


def test_core_has_no_import_cycle() -> None:
    core = {s.module: s for s in SOURCES if part_of(s.path) == "core"}
    graph: dict[str, set[str]] = {}
    for module, source in core.items():
        tree = ast.parse((ROOT / source.path).read_text(encoding="utf-8"))
        targets = {
            owner[0]
            for _, name in imports(tree, module, source.path.name == "__init__.py")
            if (owner := _owner(name)) is not None and owner[0] in core
        }
        graph[module] = targets - {module}
    # Depth-first search; a back edge is a cycle.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycle = [*stack[stack.index(target) :], target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
