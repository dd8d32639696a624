"""Stage processes SIGKILLed at random points of put/get; nothing leaks, survivors unaffected.

Bounded by count and time (``RELAYD_FAULT_KILLS``, ``RELAYD_FAULT_SECONDS``); the
seed is printed and ``RELAYD_FAULT_SEED`` replays a run.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import time

import pytest
from relayd_client import DataRef, RelayClient, StaleRefError

from tests._daemon import Daemon, wait_until
from tests._figures import record
from tests._workers import digest, make_payload
from tests.faults._support import (
    Healthy,
    Zygote,
    assert_survived,
    fd_count,
    foreign_segments,
    kill,
    killed_by_kind,
    leases,
    lines,
    process_gone,
    quiet,
    start_daemon,
    unique_node,
    wait_line,
    zygote,
)

pytestmark = pytest.mark.timeout(240)

MiB = 1 << 20
KILLS = int(os.environ.get("RELAYD_FAULT_KILLS", "40"))
SECONDS = float(os.environ.get("RELAYD_FAULT_SECONDS", "45"))
SIZES = [20_000, 300_000, MiB, 3 * MiB]
TTL = 3.0
ROLES = ["hold-grant", "writer-mid-put", "writer-published", "view", "read-mid-copy", "stream"]


async def _chaos(
    d: Daemon, z: Zygote, rng: random.Random, figures: collections.Counter[str]
) -> None:
    killed: collections.Counter[str] = collections.Counter()
    deadline = time.monotonic() + SECONDS
    async with (
        RelayClient("chaos-w", d.socket) as feeder,
        RelayClient("victim-r", d.socket) as reader,
    ):
        n = 0
        while n < KILLS and time.monotonic() < deadline:
            role = rng.choice(ROLES)
            seed = rng.randrange(1 << 20)
            tag = f"v{n}"
            if role in ("view", "read-mid-copy"):
                size = 16 * MiB if role == "read-mid-copy" else rng.choice(SIZES)
                ref = await feeder.put(
                    make_payload(seed, size), to_stage="victim-r", request_id=tag, timeout=10
                )
                if role == "view":
                    pid, out = z.spawn(role="view", stage="victim-r", ref=ref.to_bytes().hex())
                    marker = "CLAIMED"
                else:
                    pid, out = z.spawn(role="read", stage="victim-r", refs=[ref.to_bytes().hex()])
                    marker = "READING"
            elif role == "hold-grant":
                pid, out = z.spawn(role="hold-grant", stage="victim-w", to="victim-r", tag=tag,
                                   sizes=[rng.choice(SIZES)])  # fmt: skip
                marker = "RESERVED"
            else:
                pid, out = z.spawn(role="stream" if role == "stream" else "writer",
                                   stage="victim-w", to="victim-r", tag=tag, seed=seed,
                                   sizes=SIZES)  # fmt: skip
                marker = "REF" if role == "writer-published" else "ATTACHED"
            line = await wait_line(out, marker, 20)
            assert line is not None and not line.startswith("ERR"), (role, lines(out))
            # The random point: somewhere in the next few puts/copies.
            await asyncio.sleep(rng.uniform(0, 0.25))
            kill(pid)
            wait_until(lambda pid=pid: process_gone(pid), 10, f"victim {pid} to die")  # type: ignore[misc]
            killed[role] += 1
            # Data a dead writer published is the reader's: read every one of it back.
            # (A chunk published but not yet printed when the kill landed is left
            # to the TTL, like any DataRef its writer never handed out.)
            for entry in lines(out):
                if entry.startswith("REF "):
                    _, hexref, dig = entry.split()
                    try:
                        got = await reader.get(DataRef.from_bytes(bytes.fromhex(hexref)))
                    except StaleRefError:
                        figures["published_lost"] += 1
                        continue
                    assert digest(got) == dig
                    figures["published_read"] += 1
            n += 1
    figures.update({f"killed_{k}": v for k, v in killed.items()})
    figures["kills"] = sum(killed.values())


def test_sigkilled_stages_leak_nothing_and_spare_others(tmp_path: object) -> None:
    seed = int(os.environ.get("RELAYD_FAULT_SEED", str(random.randrange(1 << 32))))
    print(f"\nclient-death seed={seed} (replay: RELAYD_FAULT_SEED={seed})")
    rng = random.Random(seed)
    node = unique_node()
    d = start_daemon(str(tmp_path), node, "--lease-ttl", str(TTL), pool="128MiB")
    figures: collections.Counter[str] = collections.Counter()
    try:
        fds_before = fd_count(d.pid)

        async def scenario() -> Healthy:
            healthy = Healthy(d.socket)
            pair = asyncio.ensure_future(healthy.run())
            with zygote(d.socket, str(tmp_path)) as z:
                try:
                    await _chaos(d, z, rng, figures)
                finally:
                    healthy.stop.set()
                    await asyncio.wait_for(pair, 60)
            return healthy

        healthy = asyncio.run(asyncio.wait_for(scenario(), 200))
        wait_until(lambda: quiet(d), TTL + 15, "every lease accounted for")
        fds_after = fd_count(d.pid)
        leaked_segments = foreign_segments(node, d.epoch)
        st = d.status()
        by_kind = killed_by_kind(figures)
        record(
            "client-death",
            f"kills={figures['kills']} by kind={by_kind} "
            f"dead-writer payloads read back={figures['published_read']} "
            f"lost={figures['published_lost']} healthy transfers verified={healthy.verified} "
            f"mismatched={healthy.mismatched} leases leaked={len(leases(d))} "
            f"segments leaked={len(leaked_segments)} daemon fds {fds_before}->{fds_after} "
            f"reclaimed={dict(st.get('reclaimed_by_reason', {}))}",
        )
        assert_survived(figures, healthy, min(KILLS, 10))
        assert leaked_segments == []
        assert fds_after <= fds_before + 2, (fds_before, fds_after)
        assert st["state"] == "DAEMON_STATE_SERVING"
    finally:
        d.stop()
