"""Cross-node reads: a foreign DataRef read from this node's arena.

A DataRef whose origin is another node cannot be mapped here. Its bytes reach
this node's arena one of two ways, and the answer is always a local lease,
read and released exactly like a local SHM lease:

- **announced**: the writer's daemon pushed them here, and this node's daemon,
  finding this client the only one serving the stage they are for, said where
  they landed (a ``LandedPush`` on the session socket, kept in
  :class:`Announced`). The get asks nothing: no round trip on its path.
- **fetched**: otherwise the client asks its own daemon (a ``FetchCall`` on the
  session socket, ``Relay.Fetch``'s work), which answers with the landed push
  at once, waits for a push still on its way, or pulls the bytes from the
  writer's daemon through Mooncake Transfer Engine. One round trip on the
  session socket, next to whatever the daemon waits for.

The two cross when the push lands as the FetchCall is on its way: the daemon,
no fetch waiting yet, announces it, then reads the FetchCall and answers it
too. The announcement comes first and answers the fetch in flight
(:meth:`Announced.when_added`); the daemon's answer is dropped. In a
stop-and-wait cross-node read on loopback that was most reads, and the get
then skips the daemon's turn on the FetchCall (measured: 1 MiB reads 9-11%
faster, 256 KiB 1-4%).

Most gets of a pushed DataRef start before its push lands: the DataRef
travels as the bytes do. Once the daemon has announced a push for a stage to
this session, a get of a DataRef whose writer asked for a push to that stage
waits for the announcement first, up to :data:`ANNOUNCE_WAIT_S`, and sends
no FetchCall when it comes: neither the client nor the daemon writes, reads
or answers one, and the reader is woken once, not twice (measured, 256 KiB
stop-and-wait, old and new alternating: the two daemons' CPU 539-621 -> 398-463
us a transfer, the reader's 365-476 -> 324-374, the median 646-813 -> 580-695).
When nothing comes in time (the daemon announces no more to this session, now
that another one serves the stage; an older daemon declined the push; it is
slow to land), the get fetches as before, and waits for no announcement of
that stage again until the next one comes. A push its writer's daemon
declined is told as its landing would have been (``SessionFrame.declined``):
a get of it, waiting or still to come, fetches at once (the daemon pulls).
The blocking client waits on its caller's thread and reads there
(``Reader.landed_ref``), and hears its announcements there too, on a socket
of their own (:mod:`._apart`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from ._session import SessionChannel
from .wire.compact import RefFields
from .wire.dataref import DataRef
from .wire.errors import PermissionDeniedError
from .wire.proto import relay_pb2 as pb

ANNOUNCED_MAX = 4096
"""Announcements remembered: past it the oldest goes, and a get of it fetches."""
ANNOUNCE_WAIT_S = 0.002
"""How long a get waits for its push's announcement before it fetches: past the
landing of a push of up to a few MiB on a loopback or 10 Gbit/s link, and what a
read of a push that is not announced (another session serves the stage too, or
an older daemon declined it) pays for the announcements it saves."""

Key = tuple[str, str, int, int]  # (origin node, its epoch, lease id, generation)


def is_foreign(ref: DataRef | RefFields, node_id: str) -> bool:
    """The DataRef's lease lives in another node's arena (its fields: no wrapper to build)."""
    origin = (ref.fields if isinstance(ref, DataRef) else ref).origin
    return bool(origin.node_id) and origin.node_id != node_id


def _key(m: pb.DataRef) -> Key:
    return (m.origin.node_id, m.origin.daemon_epoch, m.lease.lease_id, m.lease.generation)


def _landed_key(landed: pb.LandedPush) -> Key:
    return (landed.origin_node_id, landed.origin_daemon_epoch, landed.lease_id, landed.generation)


def local_ref(m: pb.DataRef, lease: pb.LeaseRef, node_id: str, epoch: str) -> pb.DataRef:
    """``m`` as lease ``lease`` of node ``node_id``'s daemon (epoch ``epoch``) holds it."""
    local = pb.DataRef()
    local.CopyFrom(m)
    local.lease.CopyFrom(lease)
    local.origin.node_id = node_id
    local.origin.daemon_epoch = epoch
    local.transport = pb.TRANSPORT_SHM
    return local


class Announced:
    """The pushes this node's daemon said landed for this client, until a get takes
    one; those it said were declined, and the stages it announces pushes for.

    Filled by the session's frame handler (the loop thread), taken by gets on
    any thread: single dict operations, atomic under the GIL. An entry is only
    a hint - the lease stays published for any reader of its stage, and the
    read checks the slot header as for any lease - and holds for the daemon
    epoch it came from, so nothing from before a re-attach is read.
    """

    def __init__(self) -> None:
        self._by_key: dict[Key, tuple[pb.LandedPush, str]] = {}
        # Fetches in flight, by the push they wait for: told when it is announced.
        self._fetching: dict[Key, Callable[[], None]] = {}
        # The stages whose pushes the daemon announces to this session: learned
        # from an announcement, forgotten when one was waited for in vain.
        self._stages: set[str] = set()
        # Pushes a get of which fetches at once: declined, or announced and gone since.
        self._declined: dict[Key, None] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def hear(self, frame: pb.SessionFrame, epoch: str | None) -> None:
        """``frame``'s announcements, heard on the session socket or the
        announcement socket: its landed pushes, from the daemon of ``epoch``
        (None: no daemon attached, so none), and its declined ones."""
        if epoch is not None:
            for landed in frame.landed:
                self.add(landed, epoch)
        for declined in frame.declined:
            self.declined(declined)

    def add(self, landed: pb.LandedPush, epoch: str) -> None:
        key = _landed_key(landed)
        self._by_key[key] = (landed, epoch)
        self._stages.add(landed.to_stage)
        _bound(self._by_key)
        self._tell(key)

    def declined(self, landed: pb.LandedPush) -> None:
        """The push ``landed`` names will not land here: a get waiting for its
        announcement fetches now (the daemon pulls it), and so does one that
        comes later."""
        key = _landed_key(landed)
        self._fetch_now(key)
        self._tell(key)

    def fetch_now(self, m: pb.DataRef) -> None:
        """A get of ``m`` asks the daemon without waiting: what was announced of its
        push is no longer there (the daemon says why)."""
        self._fetch_now(_key(m))

    def _fetch_now(self, key: Key) -> None:
        self._declined[key] = None
        _bound(self._declined)

    def _tell(self, key: Key) -> None:
        fetch = self._fetching.pop(key, None)
        if fetch is not None:
            fetch()

    def expects(self, m: pb.DataRef) -> bool:
        """Whether a get of ``m`` waits for its push's announcement before it
        fetches: its writer asked for a push, to a stage the daemon announces
        pushes for to this session, and it was not declined."""
        return m.push and m.to_stage in self._stages and _key(m) not in self._declined

    def announces(self, stage: str) -> bool:
        """Whether the daemon announced a push for ``stage`` to this session, and no
        get has waited for one in vain since."""
        return stage in self._stages

    def unheard(self, stage: str) -> None:
        """A get waited for an announcement for ``stage`` that did not come."""
        self._stages.discard(stage)

    def when_added(self, m: pb.DataRef, fetch: Callable[[], None]) -> Key:
        """Call ``fetch`` when ``m``'s push is announced, while a fetch of it is in
        flight: the push landed as the FetchCall was on its way, and the
        announcement is here first (the daemon answers both; nothing is lost by
        reading either). Until :meth:`stop_waiting`."""
        key = _key(m)
        self._fetching[key] = fetch
        return key

    def stop_waiting(self, key: Key, fetch: Callable[[], None]) -> None:
        if self._fetching.get(key) is fetch:  # a later fetch of the same push keeps its own
            del self._fetching[key]

    def take(self, m: pb.DataRef, epoch: str) -> pb.LeaseRef | None:
        """Where ``m``'s announced push landed, a lease of this node's daemon of
        ``epoch``; None: not announced (fetch)."""
        got = self._by_key.pop(_key(m), None)
        if got is None or got[1] != epoch:
            return None
        landed = got[0]
        if landed.request_id != m.request_id or landed.to_stage != m.to_stage:
            raise PermissionDeniedError(
                "the DataRef does not match the lease its writer's daemon pushed here"
            )
        return landed.lease

    def forget(self, m: pb.DataRef) -> None:
        """``m`` was fetched: an announcement that came meanwhile names the same lease."""
        key = _key(m)
        self._by_key.pop(key, None)
        self._declined.pop(key, None)

    def drop_request(self, request_id: str) -> None:
        """``request_id`` was aborted: its landed leases are freed, forget them."""
        for key, (landed, _) in list(self._by_key.items()):  # one call: a get may pop
            if landed.request_id == request_id:
                self._by_key.pop(key, None)

    def clear(self) -> None:
        self._by_key.clear()
        self._fetching.clear()
        self._stages.clear()
        self._declined.clear()


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> Callable[[], None]:
    """``fn``, to be called from any thread, run on ``loop``: at once when called
    there, else handed to it (a blocking get's thread hears announcements on the
    announcement socket, and a fetch's callback sets the loop's futures)."""

    def call() -> None:
        if asyncio._get_running_loop() is loop:
            fn()
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(fn)

    return call


def _bound(remembered: dict[Key, Any]) -> None:
    """Forget the oldest of ``remembered`` past :data:`ANNOUNCED_MAX`."""
    while len(remembered) > ANNOUNCED_MAX:
        remembered.pop(next(iter(remembered)), None)


async def fetch(
    session: SessionChannel,
    ref: DataRef,
    timeout: float,
    answer: asyncio.Future[pb.FetchResponse] | None = None,
) -> pb.DataRef:
    """The local DataRef for ``ref`` once this node's daemon holds its bytes
    (``answer``: see :meth:`SessionChannel.fetch`; answered already, it asks nothing)."""
    if answer is not None and answer.done():
        resp = answer.result()
    else:
        resp = await session.fetch(ref.to_bytes(), timeout, answer)
    return local_ref(ref.proto, resp.lease, resp.node_id, resp.daemon_epoch)
