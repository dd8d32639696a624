"""The key index: keyed DataRefs waiting for their consumer stage on this node.

Who calls what (all on the daemon's event loop):

* ``add`` - a keyed put for a stage served here (or by nobody yet), from the
  writer's own session (:mod:`relayd.rpc.keyed`) or from the writer's daemon
  over the Peer service. The entry holds the DataRef's bytes, so an inline
  payload (no lease at all) is found like any other.
* ``take`` - a reader's keyed get or poll: reading by key consumes the entry;
  a get with a deadline waits here for the put.
* ``abort`` / ``discarded`` / ``reap`` - entries of an aborted request, of a
  discarded lease, and of expired ones (the lease TTL) go.
* ``withdraw`` - the writer's daemon takes back a put it gave up on, or its
  writer withdrew, while nobody read it: its entry goes, with no tombstone,
  if it names that very lease (:func:`stamp_of`). A take-back that finds
  nothing is remembered (bounded), so that the put it names is refused should
  it arrive after all.

An entry is named ``(to_stage, from_stage, key)``. What became of a key that
is gone is remembered for a while (a bounded tombstone), so that a second read
is ``StaleRefError`` (``AbortedError`` after an abort), not a wait for a put
that will never come. The index is bounded per consumer stage
(``max_stage_keys``) and in bytes.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import logging
import time
from collections.abc import Callable, Collection

from relayd_client.wire.dataref import DataRef
from relayd_client.wire.errors import (
    AbortedError,
    KeyExistsError,
    RelayError,
    RelayTimeoutError,
    ResourceExhaustedError,
    StaleRefError,
)
from relayd_client.wire.transport import Transport

from .shares import Shares

log = logging.getLogger(__name__)

# What became of keys that are gone, remembered per index (oldest forgotten first).
MAX_TOMBSTONES = 1 << 16
# The DataRef bytes all entries may hold together: inline payloads live here.
MAX_INDEX_BYTES = 256 << 20
# Distinct consumer stages with entries; a keyed put may name a stage nobody serves yet.
MAX_STAGES = 1024
MAX_TAKE_TIMEOUT = 3600.0

Name = tuple[str, str, str]  # (to_stage, from_stage, key)
LeaseKey = tuple[str, int]  # (origin node, lease id)
# (origin node, origin daemon epoch, lease id, generation): one put's lease, across
# its node's restarts (lease ids start over with each daemon run).
LeaseStamp = tuple[str, str, int, int]


class Gone(enum.Enum):
    """Why a key is no longer in the index."""

    READ = "read"
    ABORTED = "aborted"
    EXPIRED = "expired"
    DISCARDED = "discarded"


@dataclasses.dataclass(eq=False)
class Entry:
    name: Name
    wire: bytes
    request_id: str
    expires: float
    lease: LeaseKey | None  # None: nothing to free (inline, local_object, cuda_ipc_direct)
    stamp: LeaseStamp | None = None  # with lease: which put of it
    aborted: bool = False  # its request was aborted while a take held it
    withdrawn: bool = False  # its writer's daemon took it back while a take held it

    @property
    def to_stage(self) -> str:
        return self.name[0]

    @property
    def from_stage(self) -> str:
        return self.name[1]


_LEASED = (Transport.SHM, Transport.SOCKET, Transport.CUDA_IPC_POOL)


def lease_of(ref: DataRef) -> LeaseKey | None:
    """The lease a DataRef names, as (origin node, lease id); None when it names none."""
    if ref.transport not in _LEASED:
        return None
    return ref.proto.origin.node_id, int(ref.proto.lease.lease_id)


def name_of(ref: DataRef, key: str) -> Name:
    """The entry name a keyed put of ``ref`` under ``key`` is indexed by."""
    m = ref.proto
    return m.to_stage, m.origin.stage, key


def stamp_of(ref: DataRef) -> LeaseStamp | None:
    """Which put of which lease a DataRef names; None when it names no lease."""
    if ref.transport not in _LEASED:
        return None
    m = ref.proto
    return m.origin.node_id, m.origin.daemon_epoch, int(m.lease.lease_id), int(m.lease.generation)


class KeyIndex:
    def __init__(
        self, *, max_stage_keys: int, ttl: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_stage_keys = max_stage_keys
        self.ttl = ttl
        self.clock = clock
        self.entries: dict[Name, Entry] = {}
        self.per_stage: Shares[str] = Shares()
        self.nbytes = 0
        self._by_lease: dict[LeaseKey, Name] = {}
        self._gone: collections.OrderedDict[Name, Gone] = collections.OrderedDict()
        # Puts taken back before they were indexed here (see withdraw), the oldest
        # forgotten first: one of them arriving after all is refused.
        self._withdrawn: collections.OrderedDict[tuple[Name, LeaseStamp], None] = (
            collections.OrderedDict()
        )
        self._waiters: dict[Name, list[asyncio.Future[Entry]]] = {}
        # Entries handed to a take that has not resumed yet: out of the index,
        # but an abort must still reach them should the take hand them back.
        self._handed: dict[Name, Entry] = {}

    def __len__(self) -> int:
        return len(self.entries)

    # -- put --------------------------------------------------------------------------

    def add(self, ref: DataRef, key: str) -> None:
        """Index ``ref`` under ``key`` for its to_stage (validated by the caller).

        KeyExistsError when the same key from the same writer stage is still
        unread; ResourceExhaustedError when the stage (or the index) is full.
        """
        m = ref.proto
        name = name_of(ref, key)
        stamp = stamp_of(ref)
        if stamp is not None and (name, stamp) in self._withdrawn:
            raise StaleRefError(f"key {key!r}: this put was taken back by its writer's daemon")
        if name in self.entries:
            raise KeyExistsError(
                f"key {key!r} from {m.origin.stage!r} for {m.to_stage!r} is still unread"
            )
        wire = ref.to_bytes()
        entry = Entry(name, wire, m.request_id, self.clock() + self.ttl, lease_of(ref), stamp)
        waiter = self._first_waiter(name)
        if waiter is not None:
            # A reader is waiting: the entry is read the moment it exists
            # (should that take end before it resumes, it hands the entry back).
            self._hand(waiter, entry)
            self._bury(name, Gone.READ)
            return
        if self.per_stage[m.to_stage] >= self.max_stage_keys:
            raise ResourceExhaustedError(
                f"stage {m.to_stage!r} already has {self.max_stage_keys} unread keys "
                "(max_stage_keys)"
            )
        if m.to_stage not in self.per_stage and len(self.per_stage) >= MAX_STAGES:
            raise ResourceExhaustedError(f"keys wait for {MAX_STAGES} stages already")
        if self.nbytes + len(wire) > MAX_INDEX_BYTES:
            raise ResourceExhaustedError("the key index is full; readers are not keeping up")
        self._store(entry)

    def _store(self, entry: Entry) -> None:
        name = entry.name
        self.entries[name] = entry
        self.per_stage.add(entry.to_stage)
        self.nbytes += len(entry.wire)
        if entry.lease is not None:
            self._by_lease[entry.lease] = name
        self._gone.pop(name, None)

    # -- take -------------------------------------------------------------------------

    async def take(self, name: Name, timeout: float) -> bytes | None:
        """The DataRef under ``name``, consumed; None when absent and ``timeout`` <= 0.

        Waits up to ``timeout`` seconds for a put (then RelayTimeoutError).
        A key read (or aborted, expired, discarded) before is StaleRefError
        (AbortedError), however long the caller would wait.
        """
        entry = self.entries.get(name)
        if entry is not None:
            self._drop(entry, Gone.READ)
            return entry.wire
        self._raise_if_gone(name)
        if not timeout > 0:
            return None
        timeout = min(timeout, MAX_TAKE_TIMEOUT)
        waiter: asyncio.Future[Entry] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(name, []).append(waiter)
        taken = False
        try:
            async with asyncio.timeout(timeout):  # not wait_for: one loop turn less
                entry = await waiter
                taken = True
                return entry.wire
        except TimeoutError:
            raise RelayTimeoutError(
                f"no put of key {name[2]!r} from {name[1]!r} for {name[0]!r} within {timeout:.3g}s"
            ) from None
        finally:
            waiting = self._waiters.get(name)
            if waiting is not None:
                if waiter in waiting:
                    waiting.remove(waiter)
                if not waiting:
                    del self._waiters[name]
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                handed = waiter.result()
                if self._handed.get(name) is handed:
                    del self._handed[name]
                if not taken:
                    # Handed a put in the turn this take ended (its deadline, its
                    # reader's connection): nobody read it, so the key stays.
                    self._hand_back(handed)

    def _hand(self, waiter: asyncio.Future[Entry], entry: Entry) -> None:
        waiter.set_result(entry)
        self._handed[entry.name] = entry

    def _hand_back(self, entry: Entry) -> None:
        """An entry handed to a take that never returned it: to the next waiting
        take, else back in the index (unless the key was put or ended since)."""
        name = entry.name
        if name in self.entries or self._gone.get(name) is not Gone.READ:
            return
        if entry.aborted:
            self._bury(name, Gone.ABORTED)
            return
        if entry.withdrawn:
            del self._gone[name]  # nobody read it: as if never put
            return
        waiter = self._first_waiter(name)
        if waiter is not None:
            self._hand(waiter, entry)
            return
        self._store(entry)

    def _first_waiter(self, name: Name) -> asyncio.Future[Entry] | None:
        for waiter in self._waiters.get(name, ()):
            if not waiter.done():
                return waiter
        return None

    def _raise_if_gone(self, name: Name) -> None:
        gone = self._gone.get(name)
        if gone is None:
            return
        what = f"key {name[2]!r} from {name[1]!r} for {name[0]!r}"
        if gone is Gone.ABORTED:
            raise AbortedError(f"{what}: its request was aborted")
        raise StaleRefError(f"{what} was already {gone.value}; a key is read once")

    # -- freeing ----------------------------------------------------------------------

    def abort(self, request_id: str, stages: Collection[str] | None = None) -> int:
        """Drop the entries of ``request_id`` (only those to or from ``stages``, if given)."""

        def of_request(e: Entry) -> bool:
            return e.request_id == request_id and (
                stages is None or e.to_stage in stages or e.from_stage in stages
            )

        doomed = [e for e in self.entries.values() if of_request(e)]
        for entry in doomed:
            self._drop(entry, Gone.ABORTED)
        # A take holds these: read, they stay read; handed back, they go.
        for entry in self._handed.values():
            if of_request(entry):
                entry.aborted = True
        return len(doomed)

    def withdraw(self, ref: DataRef, key: str, stamp: LeaseStamp) -> bool:
        """Take back the unread entry of the keyed put of ``ref`` under ``key`` if it
        names the lease ``stamp`` (``stamp_of(ref)``): its writer's daemon gave up on
        the put, or its writer withdrew it. False: no such entry (read, gone, or
        another put's, which stays).

        No tombstone is left, so that a reader waits for the writer's retry of the
        key instead of hearing that it was read. A put not found is remembered: a
        take-back may overtake the hand-over it takes back, which is then refused.
        """
        name = name_of(ref, key)
        entry = self.entries.get(name)
        if entry is not None and entry.stamp == stamp:
            self._unstore(entry)
            return True
        handed = self._handed.get(name)
        if handed is not None and handed.stamp == stamp:
            # A take holds it: read, it stays read (its reader has the DataRef);
            # handed back, it goes.
            handed.withdrawn = True
        self._withdrawn[(name, stamp)] = None
        while len(self._withdrawn) > MAX_TOMBSTONES:
            self._withdrawn.popitem(last=False)
        return False

    def discarded(self, lease: LeaseKey) -> None:
        """The lease was discarded: its entry can never be read."""
        name = self._by_lease.get(lease)
        if name is not None:
            self._drop(self.entries[name], Gone.DISCARDED)

    def reap(self, alive: Callable[[LeaseKey], bool]) -> int:
        """Drop expired entries, and those whose lease ``alive`` says is gone (TTL, drain)."""
        now = self.clock()
        doomed = [
            e
            for e in self.entries.values()
            if now > e.expires or (e.lease is not None and not alive(e.lease))
        ]
        for entry in doomed:
            self._drop(entry, Gone.EXPIRED)
        return len(doomed)

    def _drop(self, entry: Entry, why: Gone) -> None:
        self._unstore(entry)
        self._bury(entry.name, why)
        if why is not Gone.READ:
            log.debug("key %r dropped: %s", entry.name[2], why.value)

    def _unstore(self, entry: Entry) -> None:
        del self.entries[entry.name]
        self.per_stage.take(entry.to_stage)
        self.nbytes -= len(entry.wire)
        if entry.lease is not None:
            self._by_lease.pop(entry.lease, None)

    def _bury(self, name: Name, why: Gone) -> None:
        self._gone[name] = why
        self._gone.move_to_end(name)
        while len(self._gone) > MAX_TOMBSTONES:
            self._gone.popitem(last=False)
        # Other readers waiting for the same key will not get it now.
        for waiter in self._waiters.pop(name, ()):
            if not waiter.done():
                try:
                    self._raise_if_gone(name)
                except RelayError as err:
                    waiter.set_exception(err)
