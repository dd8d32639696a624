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

A put that fails leaves nothing behind: not indexed, its lease freed. The
hand-over to a peer is the one wait, bounded by the writer's timeout when its
``KeyedPut`` says one (see ``rpc/deadlines.py``), for the writer to hear how
its put ended: a daemon that went on after its writer gave up would index a
put that writer was told failed. A hand-over this daemon gives up on without
the peer's answer (its deadline passed first, or it was cancelled) may still
have been indexed there: the peer layer takes it back (``Peer.KeyedWithdraw``,
in the background), which removes the entry only if it still names that very
lease.

A writer whose call ended before it heard the answer (its task cancelled, its
wait out of time) was told nothing was put; its client withdraws the put (a
``DiscardCall`` naming the key, :meth:`KeyedCalls.withdraw`). A hand-over
still under way then ends as a failed put, and the withdrawal is answered once
the peer took back what it may have indexed; a put indexed already is taken
out of the index, here or on the peer, and its lease freed. One race is left: a
reader that took the key before the withdrawal came holds the DataRef and
may be reading it, so that put stands (the withdrawal answers StaleRefError).

Discard: holding a DataRef is no entitlement (its lease id and generation are
guessable, its other fields its holder's to fill). The daemon frees the lease
unread only for a session serving the stage that writes it or the stage it is
addressed to, by the lease's own record, and refuses any other
(PermissionDeniedError, logged). A lease of another node is judged and freed
there through ``Peer.ReleaseRemote``, which carries the session's stages; a
push landed here, by its landed record.
"""

from __future__ import annotations

import asyncio
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
    RelayTimeoutError,
    StaleEpochError,
    StaleRefError,
)
from relayd_client.wire.names import check_key, check_stage
from relayd_client.wire.proto import relay_pb2 as pb

from ..keys import MAX_TAKE_TIMEOUT, KeyIndex, LeaseStamp, lease_of, stamp_of
from ..pools.leases import LeaseManager
from ..pools.sessions import Session
from .deadlines import within_timeout

log = logging.getLogger(__name__)


class Landings(Protocol):
    def landed(self, lease_id: int, generation: int) -> bool:
        """Whether a push of this lease landed here (``push.PushManager``)."""


class KeyedPeers(Protocol):
    """The peer layer as keyed calls see it (``peers.PeerManager``)."""

    @property
    def push(self) -> Landings: ...
    @property
    def timeout(self) -> float:
        """What bounds one call to a peer (``--peer-timeout``)."""

    def serving(self, stage: str) -> Any:
        """A live peer serving ``stage``, handed back to :meth:`keyed_put`; or None."""

    async def keyed_put(
        self, peer: Any, key: str, data_ref: bytes, timeout: float | None = None
    ) -> None: ...
    async def keyed_withdraw(self, peer: Any, key: str, data_ref: bytes) -> bool: ...
    async def release_now(self, m: pb.DataRef, stages: tuple[str, ...]) -> bool: ...


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
        # (lease id, generation, key, writer stage) -> the call handing that put
        # over: what its writer's withdrawal cancels.
        self._handing: dict[tuple[int, int, str, str], asyncio.Task[Any]] = {}

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
                if req is not None and req.stops(m.origin.stage, m.to_stage):
                    raise AbortedError(f"request {m.request_id!r} was aborted")
                raise StaleRefError("the put's lease is gone (read, discarded or expired)")
        task = asyncio.current_task()
        handing = None
        if lease is not None and task is not None:
            handing = (lease[1], int(m.lease.generation), key, m.origin.stage)
            self._handing[handing] = task
        try:
            await self._deliver(ref, key, within_timeout(call.timeout_seconds))
        except BaseException:
            # Not indexed: refused, out of time, or cancelled (the writer's session went,
            # or the writer withdrew the put) while a peer was asked. Nobody can find it
            # by key and the writer's put fails (or nobody hears of it), so its lease
            # goes now, not at its TTL. A peer that may have indexed it all the same is
            # asked to take it back (``peer_keyed.KeyedHandOver``).
            if lease is not None and self.leases.release_from_peer(lease[1], m.lease.generation):
                self.leases.flush()
            raise
        finally:
            if handing is not None and self._handing.get(handing) is task:
                del self._handing[handing]

    async def _deliver(self, ref: DataRef, key: str, wait: float | None) -> None:
        """Index ``ref`` here, or hand it to the peer serving its consumer within ``wait``."""
        to_stage = ref.proto.to_stage
        peers = self.peers
        if peers is None or self._served_here(to_stage):
            self.keys.add(ref, key)
            return
        peer = peers.serving(to_stage)
        if peer is None:
            self.keys.add(ref, key)  # its reader may attach here later
            return
        if wait is not None and wait <= 0:
            raise RelayTimeoutError("the keyed put's timeout leaves no time to hand it to a peer")
        try:
            # The peer's yes is kept even when this daemon gets to it late (a busy
            # loop): the key is indexed there, and the client waits a grace past its
            # timeout for this answer.
            await peers.keyed_put(peer, key, ref.to_v1_bytes(), wait)
        except NotFoundError:
            # It stopped serving the stage since its last heartbeat.
            self.keys.add(ref, key)

    async def withdraw(self, session: Session, call: pb.DiscardCall) -> None:
        """The writer takes back its keyed put of ``call.data_ref`` under ``call.key``:
        its call ended before it heard the answer, so it was told nothing was put.

        StaleRefError when there is no put to take back: it failed (nothing of it is
        left), or a reader took its key first (it stands: that reader holds the
        DataRef and may be reading it). Only a session serving the put's writer stage
        may (PermissionDeniedError), as for the put itself.
        """
        key = check_key(call.key)
        ref = DataRef.from_bytes(call.data_ref)
        m = ref.proto
        if m.origin.stage not in session.stages:
            raise PermissionDeniedError(
                f"the put comes from stage {m.origin.stage[:64]!r}, not one of this session's"
            )
        stamp = stamp_of(ref)
        if stamp is None:
            raise InvalidArgumentError("only a put with a lease can be withdrawn")
        if m.origin.node_id != self.node_id or m.origin.daemon_epoch != self.epoch:
            raise InvalidArgumentError("a keyed put withdrawn names a DataRef this daemon issued")
        lease_id, generation = stamp[2], stamp[3]
        # The stage too: a session may name any lease in a DataRef it fills, but
        # only a put of a stage it serves is found (the put checked the lease's
        # record for it).
        handing = self._handing.get((lease_id, generation, key, m.origin.stage))
        if handing is not None:
            # Still being handed over: it ends as a failed put (put() frees its lease,
            # the peer layer takes back what the peer may have indexed).
            log.info(
                "keyed put of %r withdrawn by its writer while handed over",
                key[:64],
                extra={"session_id": session.id},
            )
            handing.cancel()
            # Answered once the hand-over has ended, with what the peer may have
            # indexed taken back (``peer_keyed``; bounded by the peer timeout): the
            # writer then retries, or tells its reader, and neither may find this put.
            assert self.peers is not None  # a hand-over only goes to a peer
            await asyncio.wait({handing}, timeout=self.peers.timeout)
            return
        held = self.leases.leases.get(lease_id)
        ours = (
            held is not None and held.generation == generation and held.from_stage == m.origin.stage
        )
        pushed = (
            held is None and self.peers is not None and self.peers.push.landed(lease_id, generation)
        )
        if not (ours or pushed):
            raise StaleRefError("the put is gone: it failed, or its lease was read or expired")
        if not await self._unindex(ref, key, stamp):
            raise StaleRefError(f"key {key[:64]!r} was read already (or expired): the put stands")
        log.info(
            "keyed put of %r withdrawn by its writer", key[:64], extra={"session_id": session.id}
        )
        # Nobody can find it now. (A push landed on the reader's node keeps its copy
        # there until that node's TTL.)
        if ours and self.leases.release_from_peer(lease_id, generation):
            self.leases.flush()

    async def _unindex(self, ref: DataRef, key: str, stamp: LeaseStamp) -> bool:
        """Take the entry of ``ref`` under ``key`` out of the index holding it, here or on
        the peer serving its consumer; False when it is not there unread."""
        m = ref.proto
        if self.keys.withdraw(ref, key, stamp):
            return True
        peers = self.peers
        peer = peers.serving(m.to_stage) if peers is not None else None
        if peers is None or peer is None:
            return False
        return await peers.keyed_withdraw(peer, key, ref.to_v1_bytes())

    def _from_peer(self, node_id: str, key: str, data: bytes, what: str) -> tuple[str, DataRef]:
        """The key and DataRef a peer sends of a keyed put, checked: a peer may only
        ``what`` (index, take back) keyed puts of its own node."""
        key = check_key(key)
        ref = DataRef.from_bytes(data)
        m = ref.proto
        check_stage(m.to_stage, "to_stage")
        if m.origin.node_id != node_id or node_id == self.node_id:
            raise PermissionDeniedError(f"a peer may only {what} keyed puts of its own node")
        return key, ref

    def put_from_peer(self, node_id: str, key: str, data: bytes) -> None:
        """A peer's keyed put for a stage served here (the peer was authenticated)."""
        key, ref = self._from_peer(node_id, key, data, "index")
        m = ref.proto
        if m.kind != KIND_DATA or not m.request_id:
            raise InvalidArgumentError("a keyed put is a data put with a request id")
        if not self._served_here(m.to_stage):
            raise NotFoundError(f"stage {m.to_stage!r} is not served on {self.node_id!r}")
        self.keys.add(ref, key)

    def withdraw_from_peer(self, node_id: str, key: str, data: bytes) -> bool:
        """A peer takes back its keyed put (the peer was authenticated): whether the entry
        went. Only an entry naming that very lease of the peer's own node goes."""
        key, ref = self._from_peer(node_id, key, data, "take back")
        stamp = stamp_of(ref)
        if stamp is None:
            raise InvalidArgumentError("only a keyed put with a lease is taken back")
        withdrawn = self.keys.withdraw(ref, key, stamp)
        if withdrawn:
            log.info("keyed put of %r taken back by node %r", key[:64], node_id[:64])
        return withdrawn

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
        """Free the lease a DataRef names, unread, if the session serves its writer's or
        its reader's stage (PermissionDeniedError); StaleRefError if it is gone already.
        With a key, the writer withdraws its keyed put instead (:meth:`withdraw`)."""
        if call.key:
            try:
                await self.withdraw(session, call)
            except PermissionDeniedError as err:
                log.warning(
                    "keyed put withdrawal refused: %s", err, extra={"session_id": session.id}
                )
                raise
            return
        ref = DataRef.from_bytes(call.data_ref)
        m = ref.proto
        lease = lease_of(ref)
        if lease is None:
            return  # nothing of it lives in a daemon
        try:
            released = await self._discard(session, m, lease[1])
        except PermissionDeniedError as err:
            # Another stage's data, named by a guessed or passed-on DataRef: worth an
            # operator's look, and nothing was freed.
            log.warning(
                "discard of lease %d refused: %s", lease[1], err, extra={"session_id": session.id}
            )
            raise
        if not released:
            req = self.leases.requests.get(m.request_id)
            if req is not None and req.stops(m.origin.stage, m.to_stage):
                raise AbortedError(f"request {m.request_id!r} was aborted")
            raise StaleRefError(
                "the DataRef's lease was already read, discarded, expired or aborted"
            )
        self.keys.discarded(lease)

    async def _discard(self, session: Session, m: pb.DataRef, lease_id: int) -> bool:
        """Free lease ``lease_id`` of DataRef ``m`` for ``session`` where it lives;
        False when it was gone already."""
        if m.origin.node_id == self.node_id:
            if m.origin.daemon_epoch != self.epoch:
                raise StaleEpochError("the DataRef comes from an earlier run of this daemon")
            return await self.leases.crossnode.discard(
                lease_id, m.lease.generation, session.stages, session.uid
            )
        if self.peers is None:
            raise PeerUnavailableError(
                "this daemon has no peers; a DataRef of another node cannot be discarded here"
            )
        return await self.peers.release_now(m, session.stages)
