"""A config file change while `llmgw extproc` starts is not lost."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from llmgw.config import load_file
from llmgw.extproc import server as extproc_server
from llmgw.extproc.server import ExtProcServer, build_parser, serve
from llmgw.testing.wait import eventually

OLD = "seed: 1\nmodels:\n  m1:\n    endpoints: [127.0.0.1:9]\n"
NEW = "seed: 2\nmodels:\n  m1:\n    endpoints: [127.0.0.1:9, 127.0.0.1:10]\n"


async def test_a_config_change_during_the_extproc_start_is_applied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`main` loads the file, then `serve` starts the server (binds, Kubernetes discovery's
    first lists, peers). The ConfigWatcher was built after that, its first stamp the file
    as it was *then*: an edit (a ConfigMap update, a deploy script) that landed during the
    start was taken as applied, and the server routed with the old config until the file
    changed again (found by a review helper)."""
    path = tmp_path / "llmgw.yaml"
    path.write_text(OLD)
    config = load_file(path)  # as main() does, before serve()
    args = build_parser().parse_args(
        [
            "--config",
            str(path),
            "--host",
            "127.0.0.1",
            "--plaintext",
            "--no-scrape",
            "--grpc-port",
            "0",
            "--grpc-health-port",
            "0",
            "--health-port",
            "0",
            "--metrics-port",
            "0",
            "--reload-interval",
            "0.05",
        ]
    )
    servers: list[ExtProcServer] = []
    original = ExtProcServer.start

    async def start_then_edit(self: ExtProcServer) -> None:
        servers.append(self)
        await original(self)
        path.write_text(NEW)  # the edit lands while the process is still starting

    monkeypatch.setattr(extproc_server.ExtProcServer, "start", start_then_edit)
    task = asyncio.create_task(serve(args, config))
    try:
        await eventually(lambda: bool(servers), timeout=10)
        await eventually(lambda: servers[0].config.seed == 2, timeout=5)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if servers:
            await servers[0].stop(0)
