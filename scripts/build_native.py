"""Compile the scheduler's hot modules (`llmgw.native.MODULES`) with mypyc into C extensions
beside their sources, then write the manifest `llmgw/native.py` checks at import.

    .venv/bin/python scripts/build_native.py [--strict]

`make native` runs it (and `make test` / `make demo` through it) whenever one of the
sources changed. Without a C compiler or mypyc the build says why and exits 0 (the Python
sources run, ~1.7x slower per pick); `--strict` makes that exit 1. Temporary files go to
`build/`; the extensions and the manifest are not in git.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmgw.native import MANIFEST, MODULES, PACKAGE, manifest_for, source_of  # noqa: E402

GROUP = "llmgw._compiled"  # the shared runtime: llmgw/_compiled__mypyc.<abi>.so


def build() -> None:
    # Here, not at the top: without them the build says why instead of a traceback.
    from mypyc.build import mypycify  # noqa: PLC0415  (mypy ships it: the `native` extra)
    from setuptools import Distribution  # noqa: PLC0415

    paths = [str(source_of(PACKAGE, m).relative_to(ROOT)) for m in MODULES]
    extensions = mypycify(paths, opt_level="3", group_name=GROUP)
    # A bare Distribution: setup() would read pyproject.toml, which is not this build's.
    dist = Distribution({"name": "llmgw-native", "ext_modules": extensions})
    command = dist.get_command_obj("build_ext")
    command.inplace = True
    dist.run_command("build_ext")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strict", action="store_true", help="exit 1 if the build fails")
    args = parser.parse_args()
    manifest = PACKAGE / MANIFEST
    manifest.unlink(missing_ok=True)  # a failed build must not leave a matching manifest
    os.chdir(ROOT)
    started = time.monotonic()
    try:
        build()
    except (Exception, SystemExit) as exc:  # a compiler error surfaces as SystemExit
        print(f"build_native: not compiled ({type(exc).__name__}: {exc}); "
              "llmgw runs its Python sources", file=sys.stderr)  # fmt: skip
        return 1 if args.strict else 0
    manifest.write_text(json.dumps(manifest_for(PACKAGE), indent=1) + "\n")
    print(f"build_native: {len(MODULES)} modules compiled in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
