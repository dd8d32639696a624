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
from collections.abc import Callable
from typing import Any, Protocol

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

from ..keys import MAX_TAKE_TIMEOUT, KeyIndex, lease_of
from ..pools.leases import LeaseManager
from ..pools.sessions import Session

log = logging.getLogger(__name__)


class Landings(Protocol):
    def landed(self, lease_id: int, generation: int) -> bool:
        """Whether a push of this lease landed here (``push.PushManager``)."""


class KeyedPeers(Protocol):
    """The peer layer as keyed calls see it (``peers.PeerManager``)."""

    @property
    def push(self) -> Landings: ...
    def serving(self, stage: str) -> Any:
        """A live peer serving ``stage``, handed back to :meth:`keyed_put`; or None."""

    async def keyed_put(self, peer: Any, key: str, data_ref: bytes) -> None: ...
    async def release_now(self, m: pb.DataRef) -> bool: ...


class KeyedCalls:
    def __init__(
        self,
        node_id: str,
        epoch: str,
        *,
        leases: LeaseManager,
        keys: KeyIndex,
        served_here: Callable[[str], bool],
    ) -> None:
        self.node_id = node_id
        self.epoch = epoch
        self.leases = leases
        self.keys = keys
        # The registry's: only a bound data session reads keys. One not bound yet
        # may never bind, and an operator's moves no data; counting either kept
        # a put here that the stage's reader on a peer never saw.
        self._served_here = served_here
        self.peers: KeyedPeers | None = None
        """Set once the peer layer runs (``--peer-address``)."""

    async def put(self, session: Session, call: pb.KeyedPut) -> None:
        """Index the session's own put under ``call.key`` where its consumer is served."""
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
        if m.origin.node_id != self.node_id or m.origin.daemon_epoch != self.epoch:
            raise InvalidArgumentError("a keyed put names a DataRef this daemon issued")
        lease = lease_of(ref)
        if lease is not None:
            held = self.leases.leases.get(lease[1])
            pushed = (
                held is None
                and self.peers is not None
                and self.peers.push.landed(lease[1], m.lease.generation)
            )
            if not pushed and (
                held is None
                or held.generation != m.lease.generation
                or held.from_stage != m.origin.stage
            ):
                req = self.leases.requests.get(m.request_id)
                if req is not None and req.aborted:
                    raise AbortedError(f"request {m.request_id!r} was aborted")
                raise StaleRefError("the put's lease is gone (read, discarded or expired)")
        try:
            await self._deliver(ref, key)
        except RelayError:
            # Nobody can find it by key now: the writer's put fails, so its lease goes.
            if lease is not None and self.leases.release_from_peer(lease[1], m.lease.generation):
                self.leases.flush()
            raise

    async def _deliver(self, ref: DataRef, key: str) -> None:
        to_stage = ref.proto.to_stage
        peers = self.peers
        if peers is None or self._served_here(to_stage):
            self.keys.add(ref, key)
            return
        peer = peers.serving(to_stage)
        if peer is None:
            self.keys.add(ref, key)  # its reader may attach here later
            return
        try:
            await peers.keyed_put(peer, key, ref.to_v1_bytes())
        except NotFoundError:
            # It stopped serving the stage since its last heartbeat.
            self.keys.add(ref, key)

    def put_from_peer(self, node_id: str, key: str, data: bytes) -> None:
        """A peer's keyed put for a stage served here (the peer was authenticated)."""
        key = check_key(key)
        ref = DataRef.from_bytes(data)
        m = ref.proto
        if m.kind != KIND_DATA or not m.request_id:
            raise InvalidArgumentError("a keyed put is a data put with a request id")
        check_stage(m.to_stage, "to_stage")
        if m.origin.node_id != node_id or node_id == self.node_id:
            raise PermissionDeniedError("a peer may only index DataRefs of its own node")
        if not self._served_here(m.to_stage):
            raise NotFoundError(f"stage {m.to_stage!r} is not served on {self.node_id!r}")
        self.keys.add(ref, key)

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
        wire = await self.keys.take((call.to_stage, call.from_stage, key), timeout)
        return wire or b""

    async def discard(self, session: Session, call: pb.DiscardCall) -> None:
        """Free the lease a DataRef names, unread; StaleRefError if it is gone already."""
        ref = DataRef.from_bytes(call.data_ref)
        m = ref.proto
        lease = lease_of(ref)
        if lease is None:
            return  # nothing of it lives in a daemon
        if m.origin.node_id == self.node_id:
            if m.origin.daemon_epoch != self.epoch:
                raise StaleEpochError("the DataRef comes from an earlier run of this daemon")
            released = self.leases.release_from_peer(lease[1], m.lease.generation)
            self.leases.flush()
        else:
            if self.peers is None:
                raise PeerUnavailableError(
                    "this daemon has no peers; a DataRef of another node cannot be discarded here"
                )
            released = await self.peers.release_now(m)
        if not released:
            req = self.leases.requests.get(m.request_id)
            if req is not None and req.aborted:
                raise AbortedError(f"request {m.request_id!r} was aborted")
            raise StaleRefError(
                "the DataRef's lease was already read, discarded, expired or aborted"
            )
        self.keys.discarded(lease)
