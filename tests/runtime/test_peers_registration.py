"""Worker groups keep peering when a /tmp cleaner removes their registrations."""

from __future__ import annotations

import os
import time
from pathlib import Path

from llmgw.config import load_dict
from llmgw.runtime.peers import Peers, indexes, workers_spec
from llmgw.runtime.router import Router
from llmgw.testing.wait import eventually
from llmgw.types import RequestInfo

ENDPOINTS = [f"10.0.0.{i}:8000" for i in range(1, 5)]
HISTORY = "a long conversation so far, with the notes the user pasted in. " * 40
DAY = 86400.0


def _tmp_cleaner(directory: Path, age: float) -> list[Path]:
    """What systemd-tmpfiles-clean does in /tmp (Fedora, RHEL, Arch: `q /tmp 1777 root root
    10d`): a file whose atime, mtime and ctime are all older than `age` is removed. (ctime
    cannot be set back from user space: it is left out, as if the file were that old.)"""
    removed = []
    now = time.time()
    for entry in directory.iterdir():
        st = entry.stat()
        if now - st.st_atime > age and now - st.st_mtime > age:
            entry.unlink()
            removed.append(entry)
    return removed


async def test_workers_keep_peering_after_the_tmp_cleaner_ages_out_their_registrations(
    tmp_path: Path,
) -> None:
    """`--workers N` workers find each other through `<pid>-<port>.port` files in a
    directory under /tmp, written once at start and never touched again (listing the
    directory does not touch them). On hosts whose systemd-tmpfiles ages /tmp (10 days on
    Fedora/RHEL/Arch, contents of a service's PrivateTmp included) the files were removed
    after 10 days of uptime; at the next lookup every worker found no sibling and they
    silently stopped sharing what they route and their load (`llmgw_peers` 0; found by a
    review helper)."""
    config = load_dict({"models": {"m": {"endpoints": ENDPOINTS, "strategy": "latency"}}})
    a, b = Router(config, scrape=False, seed=0), Router(config, scrape=False, seed=1)
    key = os.urandom(32)
    pa = Peers(workers_spec(0.05), lambda: a.scheduler, siblings=tmp_path, key=key)
    pb = Peers(workers_spec(0.05), lambda: b.scheduler, siblings=tmp_path, key=key)
    await pa.start()
    await pb.start()
    try:
        await eventually(lambda: pa.stats.peers == 1 and pb.stats.peers == 1, 5)
        # Ten days and a bit of serving later (the files' times as they would be then).
        old = time.time() - 11 * DAY
        for entry in tmp_path.glob("*.port"):
            os.utime(entry, (old, old))
        assert len(_tmp_cleaner(tmp_path, 10 * DAY)) == 2
        # Each registers again at its next lookup of the group directory.
        await eventually(lambda: len(list(tmp_path.glob("*.port"))) == 2, 5)
        await eventually(lambda: (pa.stats.peers, pb.stats.peers) == (1, 1), 5)
        # And a pick through one worker still reaches the other's index.
        prompt = "after ten days " + HISTORY
        chosen = a.scheduler.pick(
            RequestInfo("m", "r", session_key="s", prompt=prompt, prompt_tokens=700)
        ).endpoint.id
        ((_, index_b),) = indexes(b.scheduler)
        hashes = index_b.hashes(prompt)
        await eventually(lambda: bool(index_b.match(hashes)), 2)
        assert index_b.match(hashes) == {chosen: len(hashes)}
    finally:
        await pa.stop()
        await pb.stop()
