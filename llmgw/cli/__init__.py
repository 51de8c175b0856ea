"""`llmgw` command line: one subcommand per job; the edges' servers live in their packages."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable

from llmgw.errors import ConfigError

# Subcommands whose implementation owns its own argument parsing: name -> "module:function".
_DELEGATED: dict[str, str] = {
    "sim": "llmgw.sim.cli:main",
    "extproc": "llmgw.extproc.server:main",
    "proxy": "llmgw.asgi.proxy:main",
    "envoy-config": "llmgw.extproc.envoyconfig:main",
    "demo": "llmgw.cli.demo:main",
    "explain": "llmgw.cli.explain:main",
    "replay": "llmgw.cli.replay:main",
}

# The extra a delegated command's module needs beyond the base install (`demo` says its own).
_EXTRAS: dict[str, str] = {"sim": "sim", "extproc": "extproc", "proxy": "asgi", "replay": "sim"}


def _check_config(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="llmgw check-config", description="Validate a config file."
    )
    parser.add_argument("config")
    args = parser.parse_args(argv)
    from llmgw.config import load_file, model_mode  # noqa: PLC0415

    try:
        config = load_file(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    for name, spec in config.models.items():
        source = (
            f"endpoints from {spec.discovery.describe()}"
            if spec.discovery is not None
            else f"{len(spec.endpoints)} endpoint(s)"
        )
        print(f"{name}: {model_mode(spec).value}, {source}")
    return 0


def _load(target: str) -> Callable[[list[str]], int] | None:
    module_name, func = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            return None
        raise
    entry: Callable[[list[str]], int] = getattr(module, func)
    return entry


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # `llmgw explain --json | head`: the reader left, no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # for the exit flush
        return 1


def _main(argv: list[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    commands = sorted([*_DELEGATED, "check-config"])
    if not args or args[0] in ("-h", "--help"):
        print("usage: llmgw {" + ",".join(commands) + "} ...")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "check-config":
        return _check_config(rest)
    if command not in _DELEGATED:
        print(
            f"llmgw: unknown command {command!r} (choose from {', '.join(commands)})",
            file=sys.stderr,
        )
        return 2
    try:
        entry = _load(_DELEGATED[command])
    except ModuleNotFoundError as exc:  # a package of an optional extra (not llmgw's own)
        extra = _EXTRAS.get(command)
        if extra is None or (exc.name or "llmgw").split(".")[0] == "llmgw":
            raise
        print(f"llmgw {command} needs the {extra} extra (pip install 'llmgw[{extra}]'): {exc}",
              file=sys.stderr)  # fmt: skip
        return 2
    if entry is None:
        print(f"llmgw {command}: not available in this build yet", file=sys.stderr)
        return 2
    return entry(rest)
