"""The scheduler's hot modules, compiled with mypyc, or their Python sources.

`scripts/build_native.py` (run by `make`) compiles `MODULES` into C extensions beside their
sources (the pick path, its filters and pickers, the latency scorer's per-endpoint loop, the
prefix index, the registry's endpoint state, the KV-event index and the tokenizer's cache: a
`latency` pick takes ~0.55x the time, `bench/pick_latency.py --baseline python`) and
writes `MANIFEST`, each source's digest. Python loads an extension in preference to a source of the same name, so
a source edited after the build would silently not run: `install` (called by
`llmgw/__init__.py`, before any of them is imported) compares the digests and, when one
differs, the manifest is missing or `LLMGW_NATIVE=0`, makes every module in the list load
from its source (all of them: compiled modules read each other's classes as C structs, so a
mix would crash), with a logged warning when extensions were there but stale.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.abc import MetaPathFinder
from importlib.machinery import EXTENSION_SUFFIXES, ModuleSpec
from pathlib import Path
from types import ModuleType

MODULES = (
    "llmgw.kvindex",
    "llmgw.registry",
    "llmgw.scheduling.blockhash",
    "llmgw.scheduling.filters",
    "llmgw.scheduling.pickers",
    "llmgw.scheduling.picking",
    "llmgw.scheduling.prefix",
    "llmgw.scheduling.scorers",
    "llmgw.tokenize",
)
# The other llmgw modules the compiled ones import: mypyc compiled against their types (a
# call's result or an attribute is checked against the type declared there), so a change
# to one makes the extensions stale too (`tests/core/test_native.py` keeps this complete).
DEPENDS = (
    "llmgw.breaker",
    "llmgw.calibration",
    "llmgw.chat_template",
    "llmgw.config",
    "llmgw.errors",
    "llmgw.hashring",
    "llmgw.kvevents",
    "llmgw.scheduling.interfaces",
    "llmgw.types",
)
MANIFEST = "native.json"  # in the package folder, beside the extensions (not in git)
PACKAGE = Path(__file__).resolve().parent


@dataclass(frozen=True, slots=True)
class Status:
    active: bool  # the extensions run
    reason: str  # why (or why not), for logs and benchmarks
    stale: bool = False  # extensions are there but do not match their sources
    built: bool = False  # some extension is there (so the sources need a finder to load)


def source_of(package: Path, module: str) -> Path:
    """`llmgw.scheduling.scorers` -> <package>/scheduling/scorers.py"""
    return package.joinpath(*module.split(".")[1:]).with_suffix(".py")


def extension_of(package: Path, module: str) -> Path | None:
    """The extension this interpreter would load for `module`, if one is there."""
    source = source_of(package, module)
    for suffix in EXTENSION_SUFFIXES:
        candidate = source.with_suffix(suffix)
        if candidate.exists():
            return candidate
    return None


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def manifest_for(package: Path, modules: Sequence[str] = MODULES) -> dict[str, object]:
    """What the build records: the interpreter it compiled for, each source's digest and
    those of the `DEPENDS` modules the package has."""
    depends = [(m, source_of(package, m)) for m in DEPENDS]
    return {
        "python": sys.implementation.cache_tag,
        "modules": {m: digest(source_of(package, m)) for m in modules},
        "depends": {m: digest(path) for m, path in depends if path.exists()},
    }


def check(
    package: Path = PACKAGE, env: Mapping[str, str] | None = None, modules: Sequence[str] = MODULES
) -> Status:
    env = {} if env is None else env
    built = [m for m in modules if extension_of(package, m) is not None]
    if env.get("LLMGW_NATIVE", "") == "0":
        return Status(False, "LLMGW_NATIVE=0: Python sources", built=bool(built))
    if not built:
        return Status(False, "not compiled (`make native` builds the extensions)")
    try:
        recorded = json.loads((package / MANIFEST).read_text())
    except FileNotFoundError:
        return _stale(f"extensions without {MANIFEST}: rebuild with `make native`")
    except (OSError, ValueError) as exc:
        return _stale(f"{MANIFEST} unreadable ({exc}): rebuild with `make native`")
    if len(built) < len(modules):
        return _stale(f"extensions missing for {', '.join(sorted(set(modules) - set(built)))}")
    if recorded != manifest_for(package, modules):
        return _stale("sources changed since the build: rebuild with `make native`")
    return Status(True, "compiled (mypyc)", built=True)


def _stale(reason: str) -> Status:
    return Status(False, reason, stale=True, built=True)


class SourcesFirst(MetaPathFinder):
    """Loads the listed modules from their `.py` files even where an extension is beside."""

    def __init__(self, package: Path, modules: Sequence[str]) -> None:
        self.paths = {m: source_of(package, m) for m in modules}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        source = self.paths.get(fullname)
        if source is None:
            return None
        return importlib.util.spec_from_file_location(fullname, source)


def install(
    package: Path = PACKAGE, env: Mapping[str, str] | None = None, modules: Sequence[str] = MODULES
) -> Status:
    status = check(package, env, modules)
    if not status.active and status.built:
        if not any(isinstance(f, SourcesFirst) for f in sys.meta_path):
            sys.meta_path.insert(0, SourcesFirst(package, modules))
        if status.stale:
            # A log line, not a warning: a test run that treats warnings as errors would fail
            # to import while the sources it needs run fine.
            logging.getLogger("llmgw").warning("running the Python sources: %s", status.reason)
    return status


STATUS = Status(False, "not checked yet")
