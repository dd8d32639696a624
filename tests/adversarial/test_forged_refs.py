"""A forged DataRef consumes nothing: it fails as CorruptRefError before any claim.

The forgery is a real DataRef whose header or layout names a tensor (or a
forwarded ref) the DataRef does not carry. Each get path must refuse it
before it claims, releases or has the daemon copy the lease out - the real
reader afterwards still reads the real bytes. (The cross-node path is in
``tests/multinode/test_two_daemons.py``.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from relayd_client import (
    CorruptRefError,
    DataRef,
    RelayClient,
    SyncRelayClient,
    _codec,
    _header_tree,
)
from relayd_client.wire.proto import relay_pb2 as pb

from tests._daemon import Daemon, wait_until
from tests._figures import count
from tests._workers import digest, make_payload
from tests.faults._support import quiet

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def _tensor_past_header(m: pb.DataRef) -> None:
    m.header = _codec.encode({"x": _header_tree.TensorSlot(1000)})


def _ref_past_header(m: pb.DataRef) -> None:
    m.header = _codec.encode({"x": _header_tree.TensorSlot(0), "y": _header_tree.RefSlot(3)})


def _tensor_past_lease(m: pb.DataRef) -> None:
    m.tensors[0].offset = m.lease.length + (1 << 30)


def _longer_than_lease(m: pb.DataRef) -> None:
    m.tensors[0].offset = m.lease.nslots * (64 << 10)  # just past the lease's last slot


FORGERIES: dict[str, Callable[[pb.DataRef], None]] = {
    "header names tensor 1000": _tensor_past_header,
    "header names a forwarded ref it lacks": _ref_past_header,
    "layout entry far past the lease": _tensor_past_lease,
    "layout entry just past the lease": _longer_than_lease,
}


def _forge(ref: DataRef, how: Callable[[pb.DataRef], None]) -> DataRef:
    m = pb.DataRef()
    m.CopyFrom(ref.proto)
    how(m)
    return DataRef(m)


@pytest.mark.parametrize("path", ["copy", "view", "zero-copy get", "socket"])
def test_a_forged_ref_fails_before_any_claim_and_the_real_one_still_reads(
    daemon: Daemon, path: str
) -> None:
    async def scenario() -> None:
        async with (
            RelayClient("thinker", daemon.socket) as w,
            RelayClient("talker", daemon.socket) as r,
        ):
            if path == "socket":
                r.socket_fallback = True  # reads go through the daemon's GetBytes
            for seed, (forgery, how) in enumerate(FORGERIES.items()):
                payload = make_payload(seed, 2 * MiB)
                ref = await w.put(payload, to_stage="talker", request_id=f"real{seed}")
                forged = _forge(ref, how)
                with pytest.raises(CorruptRefError):
                    if path == "view":
                        async with r.view(forged):
                            pass
                    else:
                        await r.get(forged, copy=path in ("copy", "socket"))
                count("forged DataRefs refused before a claim")
                # Nothing was claimed, released or copied out: the real reader reads it.
                assert digest(await r.get(ref)) == digest(payload), forgery

    asyncio.run(asyncio.wait_for(scenario(), 60))
    wait_until(lambda: quiet(daemon), 10, f"arena back to zero: {daemon.pool()}")


@pytest.mark.parametrize("copy", [True, False])
def test_the_blocking_client_refuses_a_forged_ref_before_any_claim(
    daemon: Daemon, copy: bool
) -> None:
    with (
        SyncRelayClient("thinker", daemon.socket) as w,
        SyncRelayClient("talker", daemon.socket) as r,
    ):
        for seed, (forgery, how) in enumerate(FORGERIES.items()):
            payload = make_payload(seed, 2 * MiB)
            ref = w.put(payload, to_stage="talker", request_id=f"sync{seed}")
            with pytest.raises(CorruptRefError):
                if copy:
                    r.get(_forge(ref, how))
                else:
                    with r.view(_forge(ref, how)):
                        pass
            count("forged DataRefs refused before a claim")
            assert digest(r.get(ref)) == digest(payload), forgery
    wait_until(lambda: quiet(daemon), 10, f"arena back to zero: {daemon.pool()}")


def test_a_forged_forwarded_ref_consumes_neither_lease(daemon: Daemon) -> None:
    async def scenario() -> None:
        async with (
            RelayClient("thinker", daemon.socket) as w,
            RelayClient("talker", daemon.socket) as r,
        ):
            outer_payload, inner_payload = make_payload(6, MiB), make_payload(7, MiB)
            outer = await w.put(outer_payload, to_stage="talker", request_id="outer")
            inner = await w.put(inner_payload, to_stage="talker", request_id="inner")
            # The outer ref forwards the inner one, and the inner one is forged.
            m = pb.DataRef()
            m.CopyFrom(outer.proto)
            m.header = _codec.encode(
                {"x": _header_tree.TensorSlot(0), "y": _header_tree.RefSlot(0)}
            )
            m.refs.append(_forge(inner, _tensor_past_header).proto)
            with pytest.raises(CorruptRefError):
                await r.get(DataRef(m))
            assert digest(await r.get(outer)) == digest(outer_payload)
            assert digest(await r.get(inner)) == digest(inner_payload)

    asyncio.run(asyncio.wait_for(scenario(), 60))
    wait_until(lambda: quiet(daemon), 10, f"arena back to zero: {daemon.pool()}")
