"""A read lane refuses what the general read path refuses, with the same error.

Once a reader has read one put of a payload structure, later DataRefs of that
structure take its read lane (``relayd_client._steady``). Each forgery here
keeps the structure (the compact DataRef's shape part) and changes what one
put fills in: the lease's fields, the ids. The same forgery is read once by
a reader with lanes and once by one without, each in a run of its own; both
must end alike (the same error, or the same bytes), and the real DataRef
must read afterwards exactly as it does without lanes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from relayd_client import DataRef, RelayClient, SyncRelayClient
from relayd_client._steady import NO_LANE
from relayd_client.wire.compact import LeaseFields, RefView
from relayd_client.wire.dataref import compact_put

from tests._daemon import Daemon, wait_until
from tests.faults._support import quiet

pytestmark = pytest.mark.timeout(120)

SIZE = 256 << 10
CALL_TIMEOUT = 30


def _lease(v: RefView, **change: int) -> DataRef:
    lease = v.lease
    fields = {k: getattr(lease, k) for k in LeaseFields.__slots__ if k != "pool"}
    fields.update(change)
    return compact_put(
        v.shape, v.chunk_id, v.request_id, v.object_id,
        (fields["segment"], fields["slot"], fields["nslots"], fields["offset"],
         fields["length"], fields["generation"], fields["lease_id"]),
    )  # fmt: skip


def _ids(v: RefView, request_id: str | None = None, object_id: str | None = None) -> DataRef:
    lease = v.lease
    return compact_put(
        v.shape, v.chunk_id, request_id or v.request_id, object_id or v.object_id,
        (lease.segment, lease.slot, lease.nslots, lease.offset, lease.length,
         lease.generation, lease.lease_id),
    )  # fmt: skip


# Each takes the real DataRef's fields (and the one read before it) and forges one.
FORGERIES: dict[str, Callable[[RefView, RefView], DataRef]] = {
    "the generation after": lambda v, _: _lease(v, generation=v.lease.generation + 1),
    "the lease read before": lambda v, before: _ids(before),
    "the next slot": lambda v, _: _lease(v, slot=v.lease.slot + v.lease.nslots),
    "a slot past the arena": lambda v, _: _lease(v, slot=1 << 40),
    "more slots than the arena": lambda v, _: _lease(v, nslots=1 << 30),
    "fewer slots than its length": lambda v, _: _lease(v, nslots=1),
    "an offset off its slot": lambda v, _: _lease(v, offset=v.lease.offset + 64),
    "a segment it lacks": lambda v, _: _lease(v, segment=7),
    "another lease id": lambda v, _: _lease(v, lease_id=v.lease.lease_id + 1),
    "another object id": lambda v, _: _ids(v, object_id=v.object_id[:-4] + "beef"),
    "another request id": lambda v, _: _ids(v, request_id="not-" + v.request_id),
}


def _inline(v: RefView, data: bytes | None = None, **ids: str) -> DataRef:
    request_id, object_id = ids.get("request_id", v.request_id), ids.get("object_id", v.object_id)
    inline = v.inline_data if data is None else data
    return compact_put(v.shape, v.chunk_id, request_id, object_id, inline_data=inline)


# The same for an inline DataRef (a structure of INLINE_SIZE bytes): no lease, so
# its ids and its bytes.
INLINE_FORGERIES: dict[str, Callable[[RefView, RefView], DataRef]] = {
    "the ref read before": lambda v, before: _inline(before),
    "the ref read before, another object id": lambda v, before: _inline(
        before, object_id=before.object_id[:-4] + "beef"
    ),
    "another request id": lambda v, _: _inline(v, request_id="not-" + v.request_id),
    "bytes cut short": lambda v, _: _inline(v, v.inline_data[:-8]),
    "a byte more": lambda v, _: _inline(v, v.inline_data + b"\0"),
    "another's bytes": lambda v, before: _inline(v, before.inline_data),
}
INLINE_SIZE = 1 << 10
# What the forgery and then the real DataRef read (see _inline_outcome).
INLINE_OUTCOMES = {
    "the ref read before": ("StaleRefError", "put 1"),
    "the ref read before, another object id": ("put 0", "put 1"),
    "another request id": ("put 1", "StaleRefError"),
    "bytes cut short": ("CorruptRefError", "put 1"),
    "a byte more": ("put 1", "StaleRefError"),
    "another's bytes": ("put 0", "StaleRefError"),
}
# Reads the real lease's bytes and releases a lease id the daemon does not hold:
# the real lease stays until its TTL, with lanes or without (a reader may hold
# what it reads that long anyway).
LEFT_TO_TTL = {"another lease id"}


@dataclasses.dataclass
class Outcome:
    forged: str  # the error's type and text, or the digest of what was read
    real: str  # the same for the real DataRef, read after the forgery
    laned: bool  # whether a read went through the reader's lane


def _digest(obj: Any) -> str:
    return hashlib.sha256(obj["h"].numpy().tobytes()).hexdigest()


def _outcome(call: Callable[[], Any]) -> str:
    try:
        return "read " + _digest(call())
    except Exception as exc:  # the outcome under comparison, whatever it is
        return f"{type(exc).__name__}: {exc}"


def _payload(seed: int, size: int = SIZE) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"h": torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)}


def _lanes(reader: Any, on: bool) -> list[bool]:
    """Whether each read through ``reader``'s lanes read (else the general path did);
    with ``on`` false, the reader learns none."""
    lanes, took = reader.lanes, []
    if not on:
        lanes.learn = lambda *args: None
    read = lanes.read

    def spy(ref: DataRef) -> Any:
        try:
            got = read(ref)
        except BaseException:  # the lane's own refusal (an inline DataRef read again)
            took.append(True)
            raise
        took.append(got is not NO_LANE)
        return got

    lanes.read = spy
    return took


Forge = Callable[[RefView, RefView], DataRef]


def _sync_run(daemon: Daemon, forge: Forge, lanes: bool, size: int = SIZE) -> Outcome:
    with (
        SyncRelayClient("thinker", daemon.socket) as w,
        SyncRelayClient("talker", daemon.socket) as r,
    ):
        took = _lanes(r._client._reader, lanes)
        before = w.put(_payload(0, size), to_stage="talker", request_id="before")
        assert _digest(r.get(before.to_bytes())) == _digest(_payload(0, size))
        ref = w.put(_payload(1, size), to_stage="talker", request_id="real")
        forged = forge(ref.fields, before.fields)
        outcome = Outcome(_outcome(lambda: r.get(forged.to_bytes())), "", False)
        outcome.real = _outcome(lambda: r.get(ref.to_bytes()))
    outcome.laned = any(took)
    return outcome


def _async_run(daemon: Daemon, forge: Forge, lanes: bool, size: int = SIZE) -> Outcome:
    async def scenario() -> Outcome:
        async with (
            RelayClient("thinker", daemon.socket) as w,
            RelayClient("talker", daemon.socket) as r,
        ):
            took = _lanes(r._reader, lanes)
            before = await w.put(_payload(0, size), to_stage="talker", request_id="before")
            assert _digest(await r.get(before.to_bytes())) == _digest(_payload(0, size))
            ref = await w.put(_payload(1, size), to_stage="talker", request_id="real")
            forged = forge(ref.fields, before.fields)
            results = []
            for one in (forged, ref):
                try:
                    results.append("read " + _digest(await r.get(one.to_bytes())))
                except Exception as exc:  # the outcome under comparison
                    results.append(f"{type(exc).__name__}: {exc}")
            return Outcome(results[0], results[1], any(took))

    return asyncio.run(asyncio.wait_for(scenario(), CALL_TIMEOUT))


@pytest.mark.parametrize("client", ["sync", "async"])
@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_a_forgery_ends_as_it_does_without_lanes(daemon: Daemon, client: str, forgery: str) -> None:
    run = _sync_run if client == "sync" else _async_run
    outcomes = []
    for lanes in (True, False):
        outcomes.append(run(daemon, FORGERIES[forgery], lanes=lanes))
        if forgery not in LEFT_TO_TTL:
            wait_until(lambda: quiet(daemon), 10, f"arena back to zero: {daemon.pool()}")
    with_lanes, without = outcomes
    assert with_lanes.laned and not without.laned
    assert (with_lanes.forged, with_lanes.real) == (without.forged, without.real)
    # Either the forgery was refused and the real DataRef reads its own bytes,
    # or the forgery read them (it names the real lease) and the real one is spent.
    real = "read " + _digest(_payload(1))
    assert real in (with_lanes.forged, with_lanes.real)


@pytest.mark.parametrize("client", ["sync", "async"])
@pytest.mark.parametrize("forgery", list(INLINE_FORGERIES))
def test_an_inline_forgery_ends_as_it_does_without_lanes(
    daemon: Daemon, client: str, forgery: str
) -> None:
    run = _sync_run if client == "sync" else _async_run
    forge = INLINE_FORGERIES[forgery]
    with_lanes, without = (run(daemon, forge, lanes, INLINE_SIZE) for lanes in (True, False))
    assert with_lanes.laned and not without.laned
    assert (with_lanes.forged, with_lanes.real) == (without.forged, without.real)
    # An inline DataRef's bytes are its own, read once per object id in a process.
    forged, real = INLINE_OUTCOMES[forgery]
    assert with_lanes.forged.startswith(_inline_outcome(forged))
    assert with_lanes.real.startswith(_inline_outcome(real))


def _inline_outcome(what: str) -> str:
    """'put 0' or 'put 1': that put's bytes were read; else the error's type."""
    if what.startswith("put "):
        return "read " + _digest(_payload(int(what[4:]), INLINE_SIZE))
    return what + ": "
