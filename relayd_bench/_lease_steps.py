"""The daemon's lease table alone, in the bench's process: what each notice costs it.

A real :class:`~relayd.pools.leases.LeaseManager` over a real arena, with a
writer's and a reader's session bound to it (their frames are built and
dropped). Transfers go in batches of :data:`BATCH`, as a writer's lingering
frame carries them: each Reserve with its Publish riding in it, then the
reader's Releases, then the Freed the table owes the writer. Each row is thread
CPU per transfer, the median over the batches, warm.

This is the lease table's own cost, without the event loop, the sockets, and
the cache traffic of other processes that the daemon's turns pay (the
breakdown's daemon rows): the part of a transfer's daemon CPU that a change to
the lease table moves, measured steadily enough to see a microsecond.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time

from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.shm import data_offset_for
from relayd_client.wire.transport import fits_inline

from relayd.config import Settings
from relayd.pools.arena import Arena
from relayd.pools.leases import LeaseManager
from relayd.pools.sessions import Session
from relayd.rpc.frames import frame_sink

# Transfers per batch (per writer's frame), batches timed, and the warm-up ones.
BATCH, BATCHES, WARMUP = 16, 300, 50
WRITER, READER = "thinker", "talker"
STEPS = (
    ("Reserve with its Publish", "reserve"),
    ("reader's Release", "release"),
    ("Freed to the writer", "freed"),
    ("total", "total"),
)
_TIMED = tuple(key for _, key in STEPS if key != "total")


def leased(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The sizes whose puts take a lease (the rest go inline, past the table)."""
    return tuple(s for s in sizes if not fits_inline(s))


def run(nbytes: int) -> dict[str, float]:
    """Median thread CPU per transfer of ``nbytes``, in us, by step (and ``total``)."""
    slot = Settings().slot_size
    nslots = max(1, -(-nbytes // slot))
    grant_slots = nslots * BATCH
    # One segment that holds the grant's slots with their headers, exactly.
    size = data_offset_for(grant_slots) + grant_slots * slot
    arena = Arena(
        node_id=f"bench-lease-steps-{os.getpid()}",
        epoch=os.urandom(4).hex(),
        total_bytes=size,
        segment_bytes=size,
        slot_size=slot,
    )
    try:
        return asyncio.run(_measure(arena, nslots, grant_slots))
    finally:
        arena.close()


async def _measure(arena: Arena, nslots: int, grant_slots: int) -> dict[str, float]:
    slot = arena.slot_size
    m = LeaseManager(
        arena,
        grant_bytes=grant_slots * slot,
        lease_ttl=60.0,
        stage_quota_bytes=grant_slots * slot,
        max_sessions=4,
        freed_linger=0.025,
    )

    def session(stage: str) -> Session:
        s = m.open_session(pid=os.getpid(), stages=[stage])
        return m.bind(s.id, s.token, frame_sink(lambda _: None), pid=os.getpid(), uid=0, gid=0)

    writer, reader = session(WRITER), session(READER)
    grant = await m.grant(writer, grant_slots * slot, 5.0)
    lease_id = max(m.new_generation_base(grant), grant.last_lease)
    samples: dict[str, list[float]] = {key: [] for key in _TIMED}
    clock = time.thread_time_ns
    for batch in range(WARMUP + BATCHES):
        reserves = []
        for k in range(BATCH):
            lease_id += 1
            r = pb.Reserve(
                lease_id=lease_id, grant_id=grant.id, slot=grant.run.slot + k * nslots,
                nslots=nslots, generation=lease_id, request_id=f"r{batch}-{k}",
                to_stage=READER, from_stage=WRITER,
            )  # fmt: skip
            r.publish.lease_id = lease_id
            r.publish.nbytes = nslots * slot
            r.publish.transport = pb.TRANSPORT_SHM
            reserves.append(r)
        t0 = clock()
        for r in reserves:
            m.on_sealed(writer, m.on_reserve(writer, r, ()), r.publish)
        t1 = clock()
        for r in reserves:
            m.table.release(reader, r.lease_id, r.lease_id)
        t2 = clock()
        m.flush()
        t3 = clock()
        if batch >= WARMUP:
            for key, spent in zip(_TIMED, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                samples[key].append(spent / BATCH / 1e3)
    out = {key: statistics.median(v) for key, v in samples.items()}
    out["total"] = sum(out.values())
    return out
