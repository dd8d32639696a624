"""Soak: mixed traffic, streams, aborts and client crashes for a bounded time.

60 s by default (CI); ``RELAYD_SOAK_SECONDS`` runs it longer. Samples the
daemon's RSS, open fds and arena occupancy once a second and fails on a growth
trend, a lost byte, a payload that does not match its checksum, or a lease or
segment left behind. The figures are printed for the run's log.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import time
from typing import Any

import pytest
from relayd_client import AbortedError, DataRef, RelayClient, StaleRefError

from tests._daemon import Daemon, wait_until
from tests._figures import record
from tests._workers import digest, make_payload
from tests.faults._support import (
    Zygote,
    apoll,
    fd_count,
    foreign_segments,
    kill,
    leases,
    quiet,
    rss_bytes,
    start_daemon,
    trend_ok,
    unique_node,
    wait_line,
    zygote,
)

SECONDS = float(os.environ.get("RELAYD_SOAK_SECONDS", "60"))
pytestmark = [pytest.mark.timeout(int(SECONDS) + 180)]

MiB = 1 << 20
# 1 B to 16 MiB, weighted towards the small sizes real stages send most.
SIZES = [1, 100, 4096, 20_000, 300_000, MiB, 4 * MiB, 16 * MiB]
WEIGHTS = [4, 4, 4, 4, 4, 3, 2, 1]
TTL = 5.0


class Soak:
    def __init__(self, d: Daemon, z: Zygote, rng: random.Random, until: float) -> None:
        self.d, self.z, self.rng, self.until = d, z, rng, until
        self.count: collections.Counter[str] = collections.Counter()
        self.samples: dict[str, list[float]] = {"rss": [], "fds": [], "arena": []}

    def running(self) -> bool:
        return time.monotonic() < self.until

    async def _verify(self, r: RelayClient, ref: DataRef, want: str, size: int) -> None:
        got = await r.get(DataRef.from_bytes(ref.to_bytes()))
        if digest(got) == want:
            self.count["delivered"] += 1
            self.count["delivered_bytes"] += size
        else:
            self.count["corrupt"] += 1

    async def plain(self) -> None:
        """Puts of every size; the reader checks each payload's checksum."""
        async with (
            RelayClient("soak-w", self.d.socket) as w,
            RelayClient("soak-r", self.d.socket) as r,
        ):
            queue: asyncio.Queue[tuple[DataRef, str, int] | None] = asyncio.Queue(8)

            async def read() -> None:
                while (item := await queue.get()) is not None:
                    try:
                        await self._verify(r, *item)
                    except StaleRefError:
                        self.count["lost"] += 1
                        self.count["lost_bytes"] += item[2]

            reader = asyncio.ensure_future(read())
            i = 0
            while self.running():
                size = self.rng.choices(SIZES, WEIGHTS)[0]
                payload = make_payload(i, size)
                ref = await w.put(payload, to_stage="soak-r", request_id=f"p{i}", timeout=20)
                await queue.put((ref, digest(payload), size))
                i += 1
            await queue.put(None)
            await reader

    async def streams(self) -> None:
        """Requests of several chunks; one in four is aborted by its reader half-way."""
        async with (
            RelayClient("stream-w", self.d.socket) as w,
            RelayClient("stream-r", self.d.socket) as r,
        ):
            n = 0
            while self.running():
                rid = f"s{n}"
                chunks = self.rng.randint(2, 8)
                abort_at = self.rng.randrange(chunks) if n % 4 == 3 else -1
                for c in range(chunks):
                    size = self.rng.choice([64 << 10, 256 << 10, MiB])
                    payload = make_payload(n * 100 + c, size)
                    try:
                        ref = await w.put(
                            payload, to_stage="stream-r", request_id=rid, chunk_id=c, timeout=20
                        )
                    except AbortedError:
                        self.count["aborted_puts"] += 1
                        break
                    self.count["stream_chunks"] += 1
                    if c == abort_at:
                        await r.abort(rid)
                        self.count["aborts"] += 1
                        with pytest.raises(AbortedError):
                            await r.get(ref)
                        continue
                    if abort_at >= 0 and c > abort_at:
                        continue
                    await self._verify(r, ref, digest(payload), size)
                n += 1

    async def crashes(self) -> None:
        """A writer or a zero-copy reader SIGKILLed every second or so."""
        async with RelayClient("crash-feed", self.d.socket) as feeder:
            k = 0
            while self.running():
                if k % 2:
                    ref = await feeder.put(
                        make_payload(k, self.rng.choice(SIZES[3:7])),
                        to_stage="crash-r",
                        request_id=f"c{k}",
                        timeout=20,
                    )
                    pid, out = self.z.spawn(role="view", stage="crash-r", ref=ref.to_bytes().hex())
                    marker, kind = "CLAIMED", "crash_reader_claiming"
                else:
                    pid, out = self.z.spawn(role="writer", stage="crash-w", to="crash-r",
                                            tag=f"c{k}", seed=k, sizes=SIZES[:7])  # fmt: skip
                    marker, kind = "ATTACHED", "crash_writer_mid_put"
                await wait_line(out, marker, 20)
                await asyncio.sleep(self.rng.uniform(0.05, 0.5))
                kill(pid)
                self.count[kind] += 1
                k += 1
                await asyncio.sleep(self.rng.uniform(0.3, 1.0))

    async def sample(self) -> None:
        pid = self.d.pid
        while self.running():
            self.samples["rss"].append(rss_bytes(pid))
            self.samples["fds"].append(fd_count(pid))
            pool = await asyncio.to_thread(self.d.pool)
            self.samples["arena"].append(pool.get("used_bytes", 0))
            await asyncio.sleep(1.0)


def _thirds(xs: list[float], scale: float = 1.0) -> tuple[float, float]:
    k = max(len(xs) // 3, 1)
    return (
        round(sum(xs[:k]) / k / scale, 1),
        round(sum(xs[-k:]) / k / scale, 1),
    )


def test_soak_mixed_traffic_no_growth_no_loss(tmp_path: object) -> None:
    seed = int(os.environ.get("RELAYD_FAULT_SEED", str(random.randrange(1 << 32))))
    print(f"\nsoak seed={seed} seconds={SECONDS:g}")
    node = unique_node()
    d = start_daemon(str(tmp_path), node, "--lease-ttl", str(TTL), pool="256MiB")
    try:

        async def scenario() -> Soak:
            with zygote(d.socket, str(tmp_path)) as z:
                soak = Soak(d, z, random.Random(seed), time.monotonic() + SECONDS)
                await asyncio.wait_for(
                    asyncio.gather(soak.plain(), soak.streams(), soak.crashes(), soak.sample()),
                    SECONDS + 120,
                )
                # Crashed writers' unread data goes at the TTL; nothing else may be left.
                await apoll(lambda: not leases(d), TTL + 20, "every lease to be accounted for")
            return soak

        soak = asyncio.run(scenario())
        wait_until(lambda: quiet(d), 20, "arena back to zero")
        c, s = soak.count, soak.samples
        figures: dict[str, Any] = {
            "delivered": c["delivered"],
            "delivered_MiB": round(c["delivered_bytes"] / MiB, 1),
            "stream_chunks": c["stream_chunks"],
            "aborts": c["aborts"],
            "crashes": {k: v for k, v in c.items() if k.startswith("crash_")},
            "bytes_lost": c["lost_bytes"],
            "corrupt": c["corrupt"],
            "leases_leaked": len(leases(d)),
            "segments_leaked": len(foreign_segments(node, d.epoch)),
            "rss_MiB_first_last_third": _thirds(s["rss"], MiB),
            "fds_first_last_third": _thirds(s["fds"]),
            "arena_MiB_first_last_third": _thirds(s["arena"], MiB),
            "samples": len(s["rss"]),
        }
        record(f"soak ({SECONDS:g} s, seed {seed})", str(figures))
        assert c["lost"] == 0 and c["corrupt"] == 0
        assert c["delivered"] > 0 and c["aborts"] > 0
        assert figures["leases_leaked"] == 0 and figures["segments_leaked"] == 0
        assert trend_ok(s["rss"], slack=16 * MiB), figures
        assert trend_ok(s["fds"], slack=4), figures
        assert trend_ok(s["arena"], slack=64 * MiB), figures
        assert d.status()["state"] == "DAEMON_STATE_SERVING"
    finally:
        d.stop()
