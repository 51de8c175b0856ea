"""The config watcher keeps following the file after a reload that failed in any way."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from llmgw.config import Config
from llmgw.runtime.router import ConfigWatcher
from llmgw.testing.wait import eventually

CONFIG = "models: {m1: {endpoints: ['10.0.0.1:8000']}}\n"


async def test_a_reload_that_raises_does_not_stop_later_reloads(tmp_path: Path) -> None:
    path = tmp_path / "llmgw.yaml"
    path.write_text(CONFIG)
    applied: list[Config] = []

    def apply(config: Config) -> None:
        if not applied:
            applied.append(config)
            raise RuntimeError("a bug in applying this one")
        applied.append(config)

    watcher = ConfigWatcher(path, apply, interval=0.01)
    task = asyncio.create_task(watcher.run())
    try:
        path.write_text(CONFIG + "# first edit\n")
        await eventually(lambda: watcher.rejected == 1)
        path.write_text(CONFIG + "# second edit, longer\n")
        await eventually(lambda: watcher.reloads == 1)
        assert len(applied) == 2 and not task.done()
    finally:
        task.cancel()


def test_a_file_replaced_with_the_same_size_and_mtime_is_seen(tmp_path: Path) -> None:
    """`cp -p`, rsync -a or a symlink swap keep mtime; a same-length edit (a weight 1 -> 2)
    went unseen by a watcher that compared mtime and size only."""
    path = tmp_path / "llmgw.yaml"
    path.write_text(CONFIG)
    applied: list[Config] = []
    watcher = ConfigWatcher(path, applied.append, interval=0)
    before = path.stat()
    replacement = tmp_path / "next.yaml"
    replacement.write_text(CONFIG.replace("8000", "8001"))
    os.utime(replacement, ns=(before.st_atime_ns, before.st_mtime_ns))
    replacement.replace(path)  # a rename: a new inode, same size and mtime
    assert watcher.check() is True and len(applied) == 1
    assert watcher.check() is None  # nothing new


def test_a_reload_that_raises_anything_is_rejected_counted_and_the_old_config_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only ConfigError was caught: any other exception escaped the SIGHUP callback,
    uncounted and without the "keeping the running config" line (found by a review
    helper)."""
    path = tmp_path / "llmgw.yaml"
    path.write_text(CONFIG)

    def apply(config: Config) -> None:
        raise RuntimeError("a bug in building this one")

    watcher = ConfigWatcher(path, apply, interval=0)
    path.write_text(CONFIG + "# an edit\n")
    assert watcher.reload() is False
    assert (watcher.rejected, watcher.reloads) == (1, 0)
    assert "keeping the running config: RuntimeError: a bug in building this one" in caplog.text
