"""Shared-memory segments of the daemon's arena, as both sides map them.

Layout of one segment (all offsets are announced by the daemon in Attach)::

    [ slot headers: nslots x 16 bytes ][ probe: 16 bytes ][ pad to 4 KiB ][ slot data ]

A slot header holds ``(generation: u64, length: u64)`` (:data:`SLOT_HEADER`);
only the first slot of a lease's run is used. The writer stamps it before publishing, the daemon
zeroes it when it frees the lease, and a reader compares it with the
DataRef's generation before and after copying (a seqlock): a stale DataRef
can never deliver reused memory. A reader done with a lease marks it read,
``(0, read_mark(object id, lease id))``, before its Release: no DataRef
matches that any more, and the writer, which watches the headers of its latest
leases, cuts its next lease from the run at once, while it is still in cache
(the daemon takes the Release when it is awake anyway, up to 64 MiB of
transfers later).

The mark is the random part a writer ends each object id with, which nothing
in the arena holds until the mark itself: every admitted client maps the arena
and can write any header, but only a holder of the DataRef can write the mark
its writer takes. A header a neighbour scribbles on costs that lease's reader
the lease, as scribbling on its bytes would; it never makes the writer reuse a
run early.

The probe holds a random nonce the daemon writes at start; a client echoes
what it reads there to prove it maps the daemon's memory (same IPC
namespace), not a same-named file of its own.
Each mapping is made once per process with
MAP_POPULATE so no page faults land on the hot path.
"""

from __future__ import annotations

import mmap
import os
import struct

from .paths import SHM_DIR

#: The arena's name wherever a pool is named (grants, leases, status); a GPU
#: pool is named ``cuda:<uuid>`` (:func:`.cuda_ipc.pool_name`).
SHM_POOL = "shm"
HEADER_STRIDE = 16
#: The largest slot a daemon may cut its pools into: a reader refuses a lease
#: longer than its slots at this size as corrupt, so a daemon must not use more.
MAX_SLOT_SIZE = 1 << 30
PROBE_BYTES = 16
#: A slot header: (generation, length) of the lease whose run starts at that slot.
SLOT_HEADER = struct.Struct("<QQ")
#: The hex digits of random an object id ends with: its lease's read mark.
MARK_DIGITS = 16
_MARK_MASK = (1 << 64) - 1
#: A lease id is ``grant id << LEASE_SEQ_BITS | n`` with ``1 <= n <= MAX_LEASE_SEQ``,
#: and the same number is its generation: one u64 on the wire and in a slot header.
#: So a grant numbers at most MAX_LEASE_SEQ leases, and a daemon numbers grants
#: up to MAX_GRANT_ID before it reuses the ids of grants long gone. The top bit
#: of a lease id stays clear: a Release ring word marks a claim with it
#: (:data:`.rings.CLAIM_BIT`).
LEASE_SEQ_BITS = 32
MAX_LEASE_SEQ = (1 << LEASE_SEQ_BITS) - 1
MAX_GRANT_ID = (1 << (63 - LEASE_SEQ_BITS)) - 1


def round_up(value: int, granule: int) -> int:
    return -(-value // granule) * granule


def probe_offset_for(nslots: int) -> int:
    return nslots * HEADER_STRIDE


def data_offset_for(nslots: int) -> int:
    return round_up(nslots * HEADER_STRIDE + PROBE_BYTES, 4096)


def segment_nslots(segment_bytes: int, slot_size: int) -> int:
    """How many slots fit in a segment of ``segment_bytes`` with their headers."""
    n = segment_bytes // (slot_size + HEADER_STRIDE)
    while n and data_offset_for(n) + n * slot_size > segment_bytes:
        n -= 1
    return n


def _map_flags() -> int:
    return mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def read_mark(object_id: str, lease_id: int) -> int:
    """The read mark of lease ``lease_id`` of the DataRef with ``object_id`` (see the module).

    The last :data:`MARK_DIGITS` hex digits of the id: a writer ends each id
    with 64 random bits of that put's own (``_writer.ObjectIds``), so a mark
    left in a header tells nothing of the next one. An id without them (an
    older writer's) is marked with its lease id, as that writer expects.
    Never 0, which a cleared header holds; whatever a writer puts there, a
    number that fits the header.
    """
    try:
        return int(object_id[-MARK_DIGITS:], 16) & _MARK_MASK | 1
    except ValueError:
        return lease_id


class MappedSegment:
    """One arena segment mapped into this process (created by the daemon, opened by clients)."""

    __slots__ = ("_fd", "data_offset", "index", "mm", "name", "nslots", "size", "slot_size")

    def __init__(
        self,
        name: str,
        size: int,
        index: int,
        slot_size: int,
        *,
        create: bool = False,
        mode: int = 0o600,
    ) -> None:
        if "/" in name or name.startswith("."):
            raise ValueError(f"bad segment name {name!r}")
        self.name = name
        self.size = size
        self.index = index
        self.slot_size = slot_size
        self.nslots = segment_nslots(size, slot_size)
        self.data_offset = data_offset_for(self.nslots)
        path = os.path.join(SHM_DIR, name)
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
            try:
                os.fchmod(fd, mode)  # umask must not narrow what clients need
                os.ftruncate(fd, size)
                # Allocate the tmpfs pages now: a full /dev/shm fails here, at
                # start, instead of as SIGBUS in a client mid-copy.
                os.posix_fallocate(fd, 0, size)
            except BaseException:
                os.close(fd)
                os.unlink(path)
                raise
        else:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            actual = os.fstat(fd).st_size
            if actual != size:
                os.close(fd)
                raise ValueError(f"segment {name} is {actual} bytes, daemon announced {size}")
        self._fd = fd
        try:
            self.mm = mmap.mmap(fd, size, flags=_map_flags(), prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise

    # -- slot headers -------------------------------------------------------------

    def read_header(self, slot: int) -> tuple[int, int]:
        """``slot``'s header: (generation, length)."""
        gen, length = SLOT_HEADER.unpack_from(self.mm, slot * HEADER_STRIDE)
        return int(gen), int(length)

    def write_header(self, slot: int, generation: int, length: int) -> None:
        SLOT_HEADER.pack_into(self.mm, slot * HEADER_STRIDE, generation, length)

    def mark_read(self, slot: int, mark: int) -> None:
        """Say in ``slot``'s header that its lease was read: ``mark`` is
        :func:`read_mark` of its DataRef's object id (see the module)."""
        SLOT_HEADER.pack_into(self.mm, slot * HEADER_STRIDE, 0, mark)

    def read_marked(self, slot: int, mark: int) -> bool:
        """Whether ``slot``'s header holds the read mark ``mark``."""
        return SLOT_HEADER.unpack_from(self.mm, slot * HEADER_STRIDE) == (0, mark)

    def slot_offset(self, slot: int) -> int:
        return self.data_offset + slot * self.slot_size

    def misplaced(self, slot: int, nslots: int, offset: int, length: int) -> str | None:
        """What is wrong with a DataRef's lease of ``nslots`` slots from ``slot``, its
        ``length`` bytes at ``offset``, in this segment; None: it lies where such a
        lease would. Every read of a lease asks this one question (the general
        path raises the answer, a read lane takes the general path on any)."""
        if nslots < 1 or slot + nslots > self.nslots or length > nslots * self.slot_size:
            return "lies outside the arena"
        if offset != self.slot_offset(slot):
            return "offset does not match its slot"
        return None

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            # A tensor still views the segment (the client's views hold a
            # buffer export): the mapping lives on until the last view is
            # garbage, then goes with the mmap object.
            pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def unlink(self) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass
