"""Forged DataRefs with valid checksums against a real daemon and a real get().

A forged reference must never make the reader copy bytes outside the lease it
names: it ends in StaleRefError, CorruptRefError or another RelayError, and
the daemon stays healthy. Pickle headers are refused unless the reader opted in.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import random
import struct
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from relayd_client import (
    DataRef,
    PermissionDeniedError,
    RelayClient,
    RelayError,
    StaleEpochError,
    StaleRefError,
    UnsafePayloadError,
)
from relayd_client.wire.dataref import MAGIC, VERSION
from relayd_client.wire.proto import relay_pb2 as pb

from tests._daemon import Daemon
from tests._figures import count, record
from tests._workers import digest, make_payload
from tests.faults._support import rss_bytes

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
ROUNDS = int(os.environ.get("RELAYD_FUZZ_ROUNDS", "150"))


def seal(m: pb.DataRef) -> DataRef:
    body = m.SerializeToString()
    return DataRef.from_bytes(struct.pack("<2sBI", MAGIC, VERSION, zlib.crc32(body)) + body)


def _set(field: str, fn: Callable[[int], int]) -> Callable[[pb.DataRef], None]:
    def mutate(m: pb.DataRef) -> None:
        setattr(m.lease, field, max(0, min(fn(getattr(m.lease, field)), 2**64 - 1)))

    return mutate


def _tensor(field: str, fn: Callable[[int], int]) -> Callable[[pb.DataRef], None]:
    def mutate(m: pb.DataRef) -> None:
        t = m.tensors[0]
        setattr(t, field, max(0, fn(getattr(t, field))))

    return mutate


def _shape(m: pb.DataRef) -> None:
    m.tensors[0].shape[0] += 1


def _overlap(m: pb.DataRef) -> None:
    m.tensors[1].offset = m.tensors[0].offset


def _dtype(m: pb.DataRef) -> None:
    m.tensors[0].dtype = "float64" if m.tensors[0].dtype != "float64" else "uint8"


# Each forgery keeps the checksum valid; the expected outcome is any RelayError.
FORGERIES: dict[str, Callable[[pb.DataRef], None]] = {
    "slot+1": _set("slot", lambda v: v + 1),
    "slot-1": _set("slot", lambda v: v - 1),
    "slot past arena": _set("slot", lambda v: v + 10**6),
    "nslots x2": _set("nslots", lambda v: v * 2),
    "nslots huge": _set("nslots", lambda v: 2**63),
    "length+1": _set("length", lambda v: v + 1),
    "length x10": _set("length", lambda v: v * 10),
    "offset+64": _set("offset", lambda v: v + 64),
    "offset-64": _set("offset", lambda v: v - 64),
    "generation+1": _set("generation", lambda v: v + 1),
    "generation-1": _set("generation", lambda v: v - 1),
    "generation of the next grant": _set("generation", lambda v: v + (1 << 32)),
    "segment 7": _set("segment", lambda v: 7),
    "tensor offset past lease": _tensor("offset", lambda v: v + 10**7),
    "tensor nbytes x2": _tensor("nbytes", lambda v: v * 2 + 1),
    "tensor nbytes enormous": _tensor("nbytes", lambda v: 2**62),
    "shape x dtype != bytes": _shape,
    "overlapping tensors": _overlap,
    "dtype changed": _dtype,
}


async def _forge_round(
    w: RelayClient, r: RelayClient, rng: random.Random, outcomes: dict[str, int]
) -> None:
    payload = make_payload(rng.randrange(1 << 20), rng.choice([70_000, 300_000, MiB]))
    ref = await w.put(payload, to_stage="talker", request_id=f"f{rng.randrange(1 << 30)}")
    real = ref.proto
    names = rng.sample(sorted(FORGERIES), rng.randint(1, 3))
    m = pb.DataRef()
    m.CopyFrom(real)
    for name in names:
        FORGERIES[name](m)
    count("forged DataRefs fed to a live get()")
    try:
        obj = await r.get(seal(m))
    except RelayError as exc:
        outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1
    else:
        # Accepted: only if it still names exactly the real lease (a layout
        # change inside it), so no byte outside the lease was read.
        assert (m.lease.segment, m.lease.slot, m.lease.length, m.lease.generation) == (
            real.lease.segment,
            real.lease.slot,
            real.lease.length,
            real.lease.generation,
        ), names
        assert obj is not None
        outcomes["accepted inside the lease"] = outcomes.get("accepted inside the lease", 0) + 1
        return
    # The real reference is untouched by the forged one: it still reads back.
    assert digest(await r.get(ref)) == digest(payload), names


def test_forged_refs_never_read_outside_their_lease(daemon: Daemon) -> None:
    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    rss_before = rss_bytes(daemon.pid)
    outcomes: dict[str, int] = {}

    async def scenario() -> None:
        async with (
            RelayClient("thinker", daemon.socket) as w,
            RelayClient("talker", daemon.socket) as r,
        ):
            for _ in range(ROUNDS):
                await _forge_round(w, r, rng, outcomes)
            # Someone else's DataRef, an earlier epoch and another node: typed refusals.
            ref = await w.put(make_payload(1, MiB), to_stage="talker", request_id="x")
            m = pb.DataRef()
            m.CopyFrom(ref.proto)
            m.to_stage = "vocoder"
            with pytest.raises(PermissionDeniedError):
                await r.get(seal(m))
            m.to_stage, m.origin.daemon_epoch = "talker", "0000000000"
            with pytest.raises(StaleEpochError):
                await r.get(seal(m))
            await r.get(ref)
            with pytest.raises(StaleRefError):
                await r.get(ref)

    asyncio.run(asyncio.wait_for(scenario(), 150))
    st = daemon.status()
    assert st["state"] == "DAEMON_STATE_SERVING"
    growth = rss_bytes(daemon.pid) - rss_before
    record(
        "forged DataRefs (live)",
        f"seed={seed} rounds={ROUNDS} outcomes={outcomes} daemon RSS growth={growth >> 10} KiB",
    )
    assert growth < 64 * MiB


class _Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch /dev/null.relayd-pwned",))


def test_pickle_header_is_refused_unless_the_reader_opted_in(daemon: Daemon) -> None:
    async def scenario() -> None:
        async with (
            RelayClient("thinker", daemon.socket) as w,
            RelayClient("talker", daemon.socket) as r,
            RelayClient("talker2", daemon.socket, allow_pickle=True) as trusting,
        ):
            payload = {"x": torch.arange(100_000), "when": {1, 2, 3}}  # a set needs pickle
            ref = await w.put(payload, to_stage="talker", request_id="p", pickle=True)
            with pytest.raises(UnsafePayloadError):
                await r.get(ref)
            ref2 = await w.put(payload, to_stage="talker2", request_id="p2", pickle=True)
            got = await trusting.get(ref2)
            assert got["when"] == {1, 2, 3} and torch.equal(got["x"], payload["x"])
            # A forged header that would run code on decode: refused before unpickling.
            m = pb.DataRef()
            m.CopyFrom(ref.proto)
            m.header_codec = pb.HEADER_CODEC_PICKLE
            m.header = pickle.dumps(_Boom())
            with pytest.raises(UnsafePayloadError):
                await r.get(seal(m))
            count("pickle headers refused without opt-in", 2)

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert not os.path.exists("/dev/null.relayd-pwned")
