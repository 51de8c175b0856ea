"""The compiled scheduler modules (`llmgw/native.py`): used only when they match their
sources, the Python sources otherwise, and the same decisions either way."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

from llmgw import native
from llmgw.native import (
    DEPENDS,
    MANIFEST,
    MODULES,
    SourcesFirst,
    check,
    install,
    manifest_for,
    source_of,
)

from . import pick_scenario

ROOT = Path(__file__).resolve().parents[2]
FAKE = ("pkgx.hot", "pkgx.sub.loop")


def fake_package(root: Path, extensions: bool = True) -> Path:
    """A package with two 'compiled' modules: each source, and an extension file beside it
    that is not a loadable library (importing it fails), like a stale or foreign build."""
    package = root / "pkgx"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    for module in FAKE:
        source = source_of(package, module)
        source.write_text(f"WHO = {module!r}\n")
        if extensions:
            source.with_suffix(EXTENSION_SUFFIXES[0]).write_bytes(b"not an ELF file")
    return package


def write_manifest(package: Path) -> None:
    (package / MANIFEST).write_text(json.dumps(manifest_for(package, FAKE)))


def test_extensions_run_only_while_the_manifest_matches_every_source(tmp_path: Path) -> None:
    package = fake_package(tmp_path)
    assert check(package, {}, FAKE).stale  # extensions, no manifest: not trusted
    write_manifest(package)
    assert check(package, {}, FAKE).active
    assert not check(package, {"LLMGW_NATIVE": "0"}, FAKE).active  # the operator's switch
    source_of(package, "pkgx.sub.loop").write_text("WHO = 'edited'\n")
    status = check(package, {}, FAKE)
    assert not status.active and status.stale and "make native" in status.reason


def test_a_missing_extension_or_a_broken_manifest_is_not_trusted(tmp_path: Path) -> None:
    package = fake_package(tmp_path)
    write_manifest(package)
    source_of(package, "pkgx.hot").with_suffix(EXTENSION_SUFFIXES[0]).unlink()
    status = check(package, {}, FAKE)
    assert not status.active and "pkgx.hot" in status.reason
    (package / MANIFEST).write_text("{not json")
    assert check(package, {}, FAKE).stale


def test_without_extensions_nothing_is_redirected(tmp_path: Path) -> None:
    package = fake_package(tmp_path, extensions=False)
    status = check(package, {}, FAKE)
    assert not status.active and not status.stale and "not compiled" in status.reason


def test_stale_extensions_give_way_to_their_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = fake_package(tmp_path)  # no manifest: the extensions are stale
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    for name in ("pkgx", "pkgx.hot", "pkgx.sub", "pkgx.sub.loop"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ImportError):  # Python prefers the (broken) extension to the source
        __import__("pkgx.hot")
    monkeypatch.delitem(sys.modules, "pkgx.hot", raising=False)
    assert install(package, {}, FAKE).stale
    assert isinstance(sys.meta_path[0], SourcesFirst)
    install(package, {}, FAKE)  # a second install adds no second finder
    assert sum(isinstance(f, SourcesFirst) for f in sys.meta_path) == 1
    hot = __import__("pkgx.hot", fromlist=["WHO"])
    loop = __import__("pkgx.sub.loop", fromlist=["WHO"])
    assert (hot.WHO, loop.WHO) == ("pkgx.hot", "pkgx.sub.loop")


PROBE = """
import json, importlib, llmgw.native as n
print(json.dumps([n.STATUS.active] + [importlib.import_module(m).__spec__.origin for m in n.MODULES]))
"""


def probe(env: dict[str, str]) -> tuple[bool, list[str]]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**os.environ, **env}, cwd=ROOT,
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    active, *origins = json.loads(out)
    return active, origins


def test_this_checkout_loads_all_modules_compiled_or_all_from_source() -> None:
    active, origins = probe({})
    compiled = [not o.endswith(".py") for o in origins]
    assert compiled == [active] * len(MODULES)  # never a mix
    if os.environ.get("LLMGW_REQUIRE_NATIVE") == "1":  # set by .ci/run: the build must work
        assert active, f"not compiled: {native.STATUS.reason}"
    active, origins = probe({"LLMGW_NATIVE": "0"})
    assert not active and all(o.endswith(".py") for o in origins)


def test_the_makefile_rebuilds_when_any_compiled_source_changes() -> None:
    makefile = (ROOT / "Makefile").read_text()
    listed = re.search(r"^NATIVE_SRC := ((?:.*\\\n)*.*)$", makefile, re.M)
    assert listed, "Makefile: no NATIVE_SRC"
    sources = set(listed.group(1).replace("\\\n", " ").split())
    assert sources == {str(source_of(ROOT / "llmgw", m).relative_to(ROOT)) for m in MODULES}
    deps = re.search(r"^NATIVE_DEPS := ((?:.*\\\n)*.*)$", makefile, re.M)
    assert deps, "Makefile: no NATIVE_DEPS"
    depends = set(deps.group(1).replace("\\\n", " ").split())
    assert depends == {str(source_of(ROOT / "llmgw", m).relative_to(ROOT)) for m in DEPENDS}


def test_depends_lists_every_llmgw_module_the_compiled_ones_import() -> None:
    imported: set[str] = set()
    for module in MODULES:
        tree = ast.parse(source_of(ROOT / "llmgw", module).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
    ours = {m for m in imported if m.startswith("llmgw.")} - set(MODULES)
    assert ours <= set(DEPENDS), sorted(ours - set(DEPENDS))


@pytest.mark.skipif(not native.STATUS.active, reason="the Python sources run here already")
def test_the_python_sources_make_the_compiled_modules_decisions() -> None:
    # This process runs the extensions (test_pick_reference holds them to the fixture); the
    # sources, in a child process, must give the same records, pick for pick.
    code = "import json; from tests.core import pick_scenario as p; print(json.dumps(p.run_all()))"
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "LLMGW_NATIVE": "0"}, cwd=ROOT,
        capture_output=True, text=True, check=True, timeout=300,
    ).stdout  # fmt: skip
    assert json.loads(out) == json.loads(pick_scenario.FIXTURE.read_text())
