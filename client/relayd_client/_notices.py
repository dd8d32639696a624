"""The per-transfer notices a client queues on its session socket.

Reserve, Cancel, Publish, Claim, Release and ReturnGrant join the session's
pending frame under the lease table's lock and go out in batches. Nobody waits
for them: readers go by the slot header, and a writer short of space flushes
its own and has the daemon ask every session for theirs (a RECLAIM event).

A Release goes into the session's Release ring instead where it can
(:mod:`relayd_client.wire.rings`): no frame, no wake-up of the daemon, which
reads the ring when it is awake anyway; so does the Claim before a large copy,
which the daemon needs only if this process dies copying. Not a Release of a
lease this client claimed by frame (a view it holds): the Release must not
overtake the Claim, and the daemon judges a frame's notices before the ring.

To a daemon that takes no Reserve over a lease its reader marked read (an
older one), not the Publish or Release of a lease of
:data:`~relayd_client.wire.framing.PROMPT_NOTICE_BYTES` or more either: those
go at once, in a frame, so that the writer gets the run back before its next
put and copies into memory still in cache. With a daemon that does, the
writer takes the run back on the mark, and they linger as the rest do.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import TYPE_CHECKING

from .wire.compact import LeaseFields, RefFields
from .wire.framing import NOTICE_LINGER_S, PROMPT_NOTICE_BYTES
from .wire.proto import relay_pb2 as pb
from .wire.rings import CLAIM_BIT

# Claimed lease ids remembered (see Notices._claimed).
_CLAIMED_MEMORY = 1024

if TYPE_CHECKING:
    from ._checks import ReadChecks
    from ._connection import Connection
    from ._grants import Lease
    from ._session import SessionChannel


def _prompt(session: SessionChannel, nbytes: int) -> bool:
    """Whether a lease of ``nbytes`` has its Publish and Release sent at once:
    from ``PROMPT_NOTICE_BYTES``, to a daemon that takes no Reserve over a read
    lease (see the module)."""
    return nbytes >= PROMPT_NOTICE_BYTES and not session.reserve_over_read


class Notices:
    """Notices of one client, on whatever session its connection holds now."""

    def __init__(
        self, conn: Connection, lock: threading.RLock, from_stage: str, checks: ReadChecks
    ) -> None:
        self._conn = conn
        self._lock = lock
        self._from_stage = from_stage
        self._checks = checks
        # Lease ids claimed by frame, until released. Bounded: a read that failed
        # may never release; by then its Claim is long handled.
        self._claimed: set[int] = set()

    def reserve(self, lease: Lease, request_id: str, to_stage: str, trace_id: str = "") -> None:
        # Built in place (.add): building one and appending it copies it.
        with self._lock:
            session = self._conn.session
            pending = session.pending
            notice = pending.reserve.add(
                lease_id=lease.id,
                grant_id=lease.grant.id,
                slot=lease.slot,
                nslots=lease.nslots,
                generation=lease.id,
                request_id=request_id,
                to_stage=to_stage,
                from_stage=self._from_stage,
            )
            if trace_id:
                notice.trace_id = trace_id
            if session.reserve_publishes:
                lease.reserve = (pending, notice)

    def cancel(self, lease: Lease) -> None:
        with self._lock:
            self._conn.session.pending.cancel.add(lease_id=lease.id)
            self._conn.free_lease(lease)
            self._conn.session.mark()

    def publish(
        self,
        lease: Lease,
        nbytes: int,
        transport: pb.Transport,
        *,
        ref: bool = False,
        push: bool = False,
        now: bool = False,
    ) -> bool:
        """Announce a sealed lease; ``now``: the daemon acts on it, so it must not
        linger (nor does the Publish of a large lease to an older daemon: see
        the module).

        Returns whether the Publish rode in the lease's Reserve and lingers, to a
        daemon that takes a Reserve over a read lease: the writer may then take
        the run back on its reader's mark (:meth:`LeaseTable.watch
        <relayd_client._grants.LeaseTable.watch>`). A prompt one's reader
        releases it at once too, and the Freed follows.

        While the lease's Reserve still waits in the pending frame (the usual
        case: a Reserve alone sends nothing), the Publish rides in it
        (``Reserve.publish``): one notice for the daemon to decode and dispatch
        instead of two, and one fewer for this client to build.
        """
        with self._lock:
            session = self._conn.session
            reserved, lease.reserve = lease.reserve, None
            carrier = (
                reserved[1] if reserved is not None and reserved[0] is session.pending else None
            )
            if carrier is not None:
                p = carrier.publish
                p.lease_id = lease.id
                p.nbytes = nbytes
                p.transport = transport
                if ref:
                    p.ref = True
                if push:
                    p.push = True
            else:  # sent already (or a daemon that takes no Reserve.publish)
                session.pending.publish.add(
                    lease_id=lease.id, nbytes=nbytes, transport=transport, ref=ref, push=push
                )
            if now or _prompt(session, nbytes):
                session.mark(flush=True)
                return False
            # One daemon wakeup per batch, not per put. The slot header just
            # written, not the daemon, makes the data safe to read meanwhile:
            # a claim or release that overtakes the Publish is held until it
            # lands, and if this process dies first the daemon publishes
            # what the header says was sealed.
            lingers = carrier is not None and session.reserve_over_read
            if lingers:
                lease.held = (session, session.pending, nbytes)
            session.mark(linger=NOTICE_LINGER_S, holds=nbytes)
            return lingers

    def claim(self, m: RefFields, flush: bool = True, *, ring: bool = False) -> None:
        """The daemon learns that this session reads ``m``'s lease (and frees it at
        once if the session dies first).

        ``ring``: a copy whose Release follows in this same read, which may go
        by the Release ring as the Release does (a daemon judges a session's
        ring before its next frame, so they keep their order either way).
        Else a frame: ``flush`` sends it now rather than with the next batch.
        """
        lease = m.lease
        with self._lock:
            if m.origin.daemon_epoch != self._conn.daemon_epoch:
                return  # the daemon restarted during the read: the lease went with it
            session = self._conn.session
            if ring and _into_ring(session, lease, lease.lease_id | CLAIM_BIT):
                return
            if len(self._claimed) >= _CLAIMED_MEMORY:
                self._claimed.clear()
            self._claimed.add(lease.lease_id)
            session.pending.claim.add(lease_id=lease.lease_id, generation=lease.generation)
            session.mark(flush=flush, linger=NOTICE_LINGER_S)

    def release(self, m: RefFields, *, ring: bool = True) -> None:
        """A read is done with ``m``'s lease; remembered, so this process cannot read it again.

        ``ring=False`` for a lease landed from another node: on a reader's node no
        writer's frames come that would take the Release ring, and the run must go
        back to the peer's push grant, so the Release rides a (lingering) frame.
        To an older daemon, a large lease's Release goes in a frame at once (see
        the module).
        """
        lease = m.lease
        lease_id = lease.lease_id
        with self._lock:
            if m.origin.daemon_epoch != self._conn.daemon_epoch:
                return  # the daemon restarted during the read: the lease went with it
            self._checks.remember_released(lease_id)
            session = self._conn.session
            prompt = _prompt(session, lease.length)
            if (
                ring
                and not prompt
                and lease_id not in self._claimed
                and _into_ring(session, lease, lease_id)
            ):
                return
            self._claimed.discard(lease_id)
            session.pending.release.add(lease_id=lease_id, generation=lease.generation)
            if not ring and not prompt and session.on_loop():
                # A lingering frame's notice, read on the loop: its timer is armed
                # once the get has returned (arming it took ~8 us of a get's ~120
                # after a push landed, measured). The notice is in the frame now,
                # which a close still sends.
                mark = functools.partial(session.mark, linger=NOTICE_LINGER_S, holds=lease.length)
                asyncio.get_running_loop().call_soon(mark)
                return
            session.mark(flush=prompt, linger=NOTICE_LINGER_S, holds=lease.length)


def _into_ring(session: SessionChannel, lease: pb.LeaseRef | LeaseFields, word: int) -> bool:
    """Whether ``word`` (``lease``'s id, or a claim of it) went into the session's
    Release ring: one that has a ring with room, for a lease whose generation is
    its id (a ring word carries one number for both)."""
    ring = session.release_ring
    return ring is not None and lease.generation == lease.lease_id and ring.push(word)
