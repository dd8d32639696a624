"""Keyed delivery and discard: the calls behind RelayClient's put(key=...),
take_key/get_key/poll_key and discard.

Each is one call on the session socket (``KeyedPut``, ``KeyedTake``,
``DiscardCall``), answered by the daemon; nothing here touches the arena.
A keyed get that waits, waits in the daemon, so the put that ends the wait
costs no polling on either side.

A keyed put whose caller stops waiting before the answer (its task
cancelled, or no answer in time) is withdrawn: a ``DiscardCall`` naming the
key, sent in the background, has the daemon end the put as failed, or take it
out of the index if it was indexed already. A reader that took the key first
keeps it: that put stands (see ``relayd.rpc.keyed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from . import _local, _session
from ._refs import TensorRef
from .wire.dataref import KIND_DATA, DataRef
from .wire.errors import (
    InvalidArgumentError,
    PermissionDeniedError,
    RelayError,
    RelayTimeoutError,
    StaleRefError,
)
from .wire.names import check_key
from .wire.proto import relay_pb2 as pb
from .wire.transport import Transport

if TYPE_CHECKING:
    from ._checks import ReadChecks
    from ._connection import Connection

log = logging.getLogger(__name__)

# Transports whose bytes live in a daemon's lease: a discard frees it there.
_LEASED = (Transport.SHM, Transport.SOCKET, Transport.CUDA_IPC_POOL)
# Give-backs of late takes and withdrawals of puts under way (a task nobody
# awaits must be held).
_giving_back: set[asyncio.Task[None]] = set()


async def index(conn: Connection, ref: DataRef, key: str, timeout: float) -> None:
    """Have the consumer's daemon index ``ref`` under ``key`` (after the put published it)."""
    # The timeout goes along: the daemon hands the put to another node within
    # it or fails the put (freeing its lease), so that it answers before this
    # call gives up instead of indexing a put this caller was told failed. A
    # put that asked not to wait still waits the answer's grace: the hand-over
    # gets half of it (0 would tell the daemon nothing, and the peer timeout
    # alone would bound it).
    limit = timeout if timeout > 0 else _session._ANSWER_GRACE / 2
    call = pb.KeyedPut(key=key, data_ref=ref.to_bytes(), timeout_seconds=limit)
    try:
        await conn.session.keyed(call, timeout)
    except BaseException as exc:
        # The put fails: what it left for a reader in this process goes too
        # (a leased one was freed by the daemon).
        if ref.transport is Transport.LOCAL_OBJECT:
            with contextlib.suppress(KeyError):
                _local.take(ref.object_id)
        elif ref.transport in _LEASED and (
            not isinstance(exc, RelayError) or isinstance(exc, RelayTimeoutError)
        ):
            # Cancelled, or out of time: the daemon may not know, and may index
            # the put after (or have indexed it before) this caller was told it
            # failed. Withdrawn, it leaves nothing, as a failed put. (A timeout the
            # daemon answered itself has freed the lease: the withdrawal finds
            # nothing.)
            _start(_withdraw(conn, ref, key, limit))
        raise


async def take(
    conn: Connection,
    checks: ReadChecks,
    key: str,
    from_stage: str,
    to_stage: str | None,
    timeout: float,
) -> DataRef | None:
    """The DataRef under ``key``, consumed; None when ``timeout`` <= 0 and there is none."""
    check_key(key)
    if not isinstance(from_stage, str) or not from_stage:
        raise InvalidArgumentError("from_stage must name the writer stage")
    if to_stage is None:
        if len(conn.stages) != 1:
            raise InvalidArgumentError(
                f"this client serves {conn.stages}; say which one reads the key (to_stage=)"
            )
        to_stage = conn.stages[0]

    def late(wire: bytes) -> None:
        # The daemon consumed the key for a take whose caller is gone: free
        # what it holds now rather than at its TTL. The key stays read (the
        # daemon cannot be told to index it again), as it would had the
        # caller discarded it.
        _start(_give_back(conn, checks, wire, timeout))

    wire = await conn.session.keyed(
        pb.KeyedTake(
            key=key, from_stage=from_stage, to_stage=to_stage, timeout_seconds=max(timeout, 0.0)
        ),
        max(timeout, 0.0),
        late,
    )
    return DataRef.from_bytes(wire) if wire else None


def _start(work: Coroutine[Any, Any, None]) -> None:
    """Run ``work`` on this loop, held until it ends, nobody awaiting it."""
    task = asyncio.get_running_loop().create_task(work)
    _giving_back.add(task)
    task.add_done_callback(_giving_back.discard)


async def _withdraw(conn: Connection, ref: DataRef, key: str, timeout: float) -> None:
    """Withdraw the keyed put of ``ref`` under ``key``: its caller gave up on it."""
    call = pb.DiscardCall(data_ref=ref.to_bytes(), key=key)
    try:
        await conn.session.keyed(call, max(timeout, _session._ANSWER_GRACE))
    except RelayError as exc:
        # Failed, read first (it stands), or the session went (the daemon ends
        # a hand-over still under way itself).
        log.debug("a keyed put given up on was not withdrawn: %s", exc)


async def _give_back(conn: Connection, checks: ReadChecks, wire: bytes, timeout: float) -> None:
    """Discard, unread, a taken DataRef nobody received."""
    try:
        await discard(conn, checks, wire, max(timeout, conn.timeout))
    except RelayError as exc:  # gone meanwhile (TTL, abort, the daemon): nothing held
        log.debug("a late take's DataRef was not freed: %s", exc)


async def discard(
    conn: Connection, checks: ReadChecks, ref: DataRef | TensorRef | bytes, timeout: float
) -> None:
    """Free what ``ref`` holds, unread (see RelayClient.discard)."""
    if isinstance(ref, (bytes, bytearray, memoryview)):
        ref = DataRef.from_bytes(ref)
    m = ref.proto
    if m.kind != KIND_DATA:
        raise InvalidArgumentError("a done/error signal holds nothing to discard")
    transport = Transport.from_proto(m.transport)
    if transport in _LEASED:
        a = conn.require_open()
        if checks.was_released(m, a.daemon_epoch):
            raise StaleRefError("this DataRef was already read or discarded by this client")
        await conn.session.keyed(pb.DiscardCall(data_ref=_wire(ref)), timeout)
        if m.origin.daemon_epoch == a.daemon_epoch:
            checks.remember_released(m.lease.lease_id)
    elif transport is Transport.LOCAL_OBJECT:
        try:
            _local.take(m.object_id)
        except KeyError:
            raise StaleRefError(
                "local_object DataRef is not held in this process (read or discarded already)"
            ) from None
    else:
        # Inline (or CUDA handles): nothing to free anywhere. Marked as read, so
        # that a second discard, or a get, in this process is StaleRefError.
        checks.claim_inline(m, "this DataRef")
    # Forwarded tensors inside it would otherwise wait for their TTL; one
    # that its consumer read already is no error here, nor one this stage may
    # not free (it neither writes nor reads it): that one stays for its
    # consumer, an abort or its TTL.
    for inner in m.refs:
        with contextlib.suppress(StaleRefError, PermissionDeniedError):
            await discard(conn, checks, TensorRef(inner), timeout)


def _wire(ref: DataRef | TensorRef) -> bytes:
    return ref.to_bytes() if isinstance(ref, DataRef) else ref.data_ref().to_bytes()
