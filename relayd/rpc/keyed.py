"""Keyed put, keyed take and discard: the daemon's side of the client's calls.

Sessions make these calls on the session socket (``KeyedPut``, ``KeyedTake``,
``DiscardCall``, answered in ``KeyedResult``); peers hand keyed DataRefs over
with ``Peer.KeyedPut``. The index itself is :class:`relayd.keys.KeyIndex`.

Where a key goes: the daemon of the consumer stage's node holds the index.
A keyed put is indexed here when the stage is served here, or by no node yet
(its reader may attach here later); otherwise the writer's daemon hands it to
the peer that serves the stage and reports that peer's answer. The reader
gets the DataRef from its own daemon and reads it like any other: a foreign
one is pulled (Mooncake), as when the application carries it.

Discard: holding a DataRef is the entitlement. The daemon checks the lease id
and generation it names, not the caller's stage, and frees the lease as its
reader would; a lease of another node is freed there through
``Peer.ReleaseRemote``, as after a cross-node read.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from relayd_client.wire.dataref import KIND_DATA, DataRef
from relayd_client.wire.errors import (
    AbortedError,
    InvalidArgumentError,
    NotFoundError,
    PeerUnavailableError,
    PermissionDeniedError,
    RelayError,
    StaleEpochError,
    StaleRefError,
)
from relayd_client.wire.names import check_key, check_stage
from relayd_client.wire.proto import relay_pb2 as pb

from ..keys import MAX_TAKE_TIMEOUT, lease_of

if TYPE_CHECKING:
    from ..pools.sessions import Session
    from ..server import Daemon

log = logging.getLogger(__name__)


class KeyedCalls:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    # -- from the writer's session --------------------------------------------------------

    async def put(self, session: Session, call: pb.KeyedPut) -> None:
        """Index the session's own put under ``call.key`` where its consumer is served."""
        d = self.daemon
        key = check_key(call.key)
        ref = DataRef.from_bytes(call.data_ref)
        m = ref.proto
        if m.kind != KIND_DATA:
            raise InvalidArgumentError("only data puts can be keyed, not stream signals")
        check_stage(m.to_stage, "to_stage")
        if not m.request_id:
            raise InvalidArgumentError("a keyed put needs a request id (abort frees it)")
        if m.origin.stage not in session.stages:
            raise PermissionDeniedError(
                f"the put comes from stage {m.origin.stage[:64]!r}, not one of this session's"
            )
        if m.origin.node_id != d.settings.node_id or m.origin.daemon_epoch != d.epoch:
            raise InvalidArgumentError("a keyed put names a DataRef this daemon issued")
        lease = lease_of(ref)
        if lease is not None:
            held = d.manager.leases.get(lease[1])
            pushed = (
                held is None
                and d.peers is not None
                and d.peers.push.landed(lease[1], m.lease.generation)
            )
            if not pushed and (
                held is None
                or held.generation != m.lease.generation
                or held.from_stage != m.origin.stage
            ):
                req = d.manager.requests.get(m.request_id)
                if req is not None and req.aborted:
                    raise AbortedError(f"request {m.request_id!r} was aborted")
                raise StaleRefError("the put's lease is gone (read, discarded or expired)")
        try:
            await self._deliver(ref, key)
        except RelayError:
            # Nobody can find it by key now: the writer's put fails, so its lease goes.
            if lease is not None and d.manager.release_from_peer(lease[1], m.lease.generation):
                d.manager.flush()
            raise

    async def _deliver(self, ref: DataRef, key: str) -> None:
        d = self.daemon
        to_stage = ref.proto.to_stage
        peers = d.peers
        if peers is None or self._served_here(to_stage):
            d.keys.add(ref, key)
            return
        peer = peers.serving(to_stage)
        if peer is None:
            d.keys.add(ref, key)  # its reader may attach here later
            return
        try:
            await peers.keyed_put(peer, key, ref.to_bytes())
        except NotFoundError:
            # It stopped serving the stage since its last heartbeat.
            d.keys.add(ref, key)

    def _served_here(self, stage: str) -> bool:
        return any(stage in s.stages for s in self.daemon.manager.sessions.values())

    # -- from a peer ------------------------------------------------------------------------

    def put_from_peer(self, node_id: str, key: str, data: bytes) -> None:
        """A peer's keyed put for a stage served here (the peer was authenticated)."""
        d = self.daemon
        key = check_key(key)
        ref = DataRef.from_bytes(data)
        m = ref.proto
        if m.kind != KIND_DATA or not m.request_id:
            raise InvalidArgumentError("a keyed put is a data put with a request id")
        check_stage(m.to_stage, "to_stage")
        if m.origin.node_id != node_id or node_id == d.settings.node_id:
            raise PermissionDeniedError("a peer may only index DataRefs of its own node")
        if not self._served_here(m.to_stage):
            raise NotFoundError(f"stage {m.to_stage!r} is not served on {d.settings.node_id!r}")
        d.keys.add(ref, key)

    # -- from the reader's session ----------------------------------------------------------

    async def take(self, session: Session, call: pb.KeyedTake) -> bytes:
        """The DataRef under the key, consumed; b"" when a poll finds none."""
        key = check_key(call.key)
        check_stage(call.from_stage, "from_stage")
        if call.to_stage not in session.stages:
            raise PermissionDeniedError(
                f"keys for stage {call.to_stage[:64]!r} are read by that stage; this session "
                f"serves {', '.join(session.stages)}"
            )
        timeout = min(call.timeout_seconds, MAX_TAKE_TIMEOUT)
        wire = await self.daemon.keys.take((call.to_stage, call.from_stage, key), timeout)
        return wire or b""

    # -- discard ----------------------------------------------------------------------------

    async def discard(self, session: Session, call: pb.DiscardCall) -> None:
        """Free the lease a DataRef names, unread; StaleRefError if it is gone already."""
        d = self.daemon
        ref = DataRef.from_bytes(call.data_ref)
        m = ref.proto
        lease = lease_of(ref)
        if lease is None:
            return  # nothing of it lives in a daemon
        if m.origin.node_id == d.settings.node_id:
            if m.origin.daemon_epoch != d.epoch:
                raise StaleEpochError("the DataRef comes from an earlier run of this daemon")
            released = d.manager.release_from_peer(lease[1], m.lease.generation)
            d.manager.flush()
        else:
            if d.peers is None:
                raise PeerUnavailableError(
                    "this daemon has no peers; a DataRef of another node cannot be discarded here"
                )
            released = await d.peers.release_now(m)
        if not released:
            req = d.manager.requests.get(m.request_id)
            if req is not None and req.aborted:
                raise AbortedError(f"request {m.request_id!r} was aborted")
            raise StaleRefError(
                "the DataRef's lease was already read, discarded, expired or aborted"
            )
        d.keys.discarded(lease)
