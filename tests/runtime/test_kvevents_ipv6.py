"""KV events over IPv6 and host names: a name is followed where vLLM binds (IPv4), and the
simulator publishes on an IPv6 host."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llmgw.testing.net import ipv6_loopback

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

ROOT = Path(__file__).resolve().parents[2]


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        done = subprocess.run(
            ["unshare", "-rm", "true"], capture_output=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


# Kubernetes' kubelet writes every pod's /etc/hosts so (Fedora, RHEL and macOS map localhost
# to ::1 too; dual-stack clusters' DNS names have AAAA records alike).
KUBELET_HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"

FOLLOW_LOCALHOST = textwrap.dedent(
    """
    import asyncio, sys
    import msgpack, zmq, zmq.asyncio
    from llmgw.config import KvEventsSpec
    from llmgw.kvevents import BlockStored, encode_events
    from llmgw.kvindex import KvState
    from llmgw.registry import Registry
    from llmgw.runtime.kvevents import KvEventSubscriber

    async def main():
        pub = zmq.asyncio.Context.instance().socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        # vLLM binds `tcp://*:5557` with no IPv6 option: IPv4 only.
        port = pub.bind_to_random_port("tcp://*")
        registry = Registry()
        eid = "localhost:8000"
        spec = KvEventsSpec(endpoint="tcp://{host}:%d" % port, topic="kv")
        sub = KvEventSubscriber(registry, eid, spec, retry_s=0.05)
        task = asyncio.create_task(sub.run())
        payload = msgpack.packb(
            [0.0, encode_events([BlockStored((b"h0",), None, (1, 2, 3, 4), 4)]), 0]
        )
        try:
            async with asyncio.timeout(4.0):
                while registry.kv_index.state(eid) is not KvState.LIVE:
                    await pub.send_multipart((b"kv", (0).to_bytes(8, "big"), payload))
                    await asyncio.sleep(0.05)
            print("LIVE", registry.kv_index.size(eid))
        except TimeoutError:
            print("NOT LIVE connected=%s" % sub.connected.is_set())
        finally:
            task.cancel()
            pub.close(0)

    asyncio.run(main())
    """
)


def test_an_endpoint_named_localhost_follows_a_publisher_bound_like_vllms(
    tmp_path: Path,
) -> None:
    """The SUB (and replay DEALER) socket set ZMQ_IPV6 for every endpoint, so libzmq
    resolved a host name to its IPv6 address only (AF_INET6, AI_V4MAPPED used only when
    there is none). vLLM binds its publisher at `tcp://*:5557` without the IPv6 option:
    IPv4 only. An endpoint given by a name with an AAAA record (`localhost` in every
    Kubernetes pod's /etc/hosts, a dual-stack cluster's DNS names) is then connected at
    [::1] / its IPv6 address, refused, retried forever: no event was ever received, the
    endpoint never went live, and nothing was logged (found by a review helper)."""
    if not _can_unshare() or not ipv6_loopback():
        pytest.skip("needs unshare (a private /etc/hosts) and an IPv6 loopback")
    hosts = tmp_path / "hosts"
    hosts.write_text(KUBELET_HOSTS)
    script = tmp_path / "follow.py"
    script.write_text(FOLLOW_LOCALHOST)
    inner = f"mount --bind {hosts} /etc/hosts && exec {sys.executable} {script}"
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", inner],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    out = done.stdout.strip()
    assert out.startswith("LIVE"), f"{out!r} {done.stderr[-800:]!r}"


async def test_the_simulator_publishes_kv_events_on_an_ipv6_host() -> None:
    """`python -m llmgw.sim --host ::1 --kv-events` (or SimFleet(host="::1",
    kv_events_port=0)): the publisher bound `tcp://::1:*` (no brackets, no IPv6 option),
    libzmq refused it ("No such device") and the replica did not start at all, though
    the same fleet without --kv-events starts and the router follows IPv6 publishers."""
    if not ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    from llmgw.config import KvEventsSpec  # noqa: PLC0415
    from llmgw.registry import Registry  # noqa: PLC0415
    from llmgw.runtime.kvevents import KvEventSubscriber  # noqa: PLC0415
    from llmgw.sim import SimFleet  # noqa: PLC0415

    async with asyncio.timeout(20):
        async with SimFleet(
            replicas=1, host="::1", time_scale=0, seed=1, kv_events_port=0, block_size=16
        ) as fleet:
            replica = fleet.replicas[0]
            assert replica.kv_publisher is not None
            registry = Registry()
            eid = f"[::1]:{replica.port}"
            sub = KvEventSubscriber(registry, eid, KvEventsSpec(discover=True), retry_s=0.05)
            task = asyncio.create_task(sub.run())
            try:
                await asyncio.wait_for(sub.connected.wait(), 5.0)
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
