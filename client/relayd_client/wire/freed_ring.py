"""The Freed ring: a writer session learns which of its leases are free by reading memory.

A Freed frame wakes the writer's reading thread, and costs the daemon a
frame and a write, once per transfer at 2 MiB and up. The writer only needs
the news when it next cuts a lease, so the daemon writes the freed lease ids
into a small ring that both map, and the writer reads it where it cuts.

Contract:

- The daemon creates the ring (a sealed memfd of :data:`RING_BYTES`) for a
  session that asks for it in its ``Bind`` and hands over the descriptor
  with the ``BOUND`` event (``SCM_RIGHTS``). A session without one gets
  Freed frames as before: that is also what an older daemon does.
- Single producer, single consumer, no shared indexes: each side keeps its
  own position. A slot holds a lease id (never 0) or 0. The daemon writes a
  slot only if it reads 0 there, else the ring is full and the notice goes
  as a frame. The writer takes slots until it reads 0, and zeroes each one
  it takes. Every hand-over is one aligned 8-byte word, so neither side can
  read half an id, and no ordering between two words is needed.
- The writer maps the ring read-write, so the daemon trusts nothing in it:
  a word it reads only decides whether it writes there or sends a frame
  instead. The size is sealed, so the writer cannot truncate the ring under
  the daemon's mapping (a fault there would end the daemon).
- Only arena leases go through the ring, and only while no grant waits for
  space: a writer blocked waiting does not read it, so it gets frames.
"""

from __future__ import annotations

import fcntl
import mmap
import os

#: Lease ids the ring holds; a writer that cuts nothing for this many frees gets frames.
RING_SLOTS = 512
#: The ring's whole size: one 8-byte word per slot.
RING_BYTES = RING_SLOTS * 8
_EMPTY = 0
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class FreedRing:
    """One side's mapping of a ring and its own position in it."""

    __slots__ = ("_mm", "_pos", "_view", "_words")

    def __init__(self, mm: mmap.mmap) -> None:
        self._mm = mm
        self._view = memoryview(mm)
        self._words = self._view.cast("Q")
        self._pos = 0

    # -- the daemon's side --------------------------------------------------------

    @classmethod
    def create(cls) -> tuple[FreedRing, int]:
        """A new ring and its descriptor, sealed at its size (the caller closes the fd)."""
        fd = os.memfd_create("relayd-freed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, RING_BYTES)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            mm = mmap.mmap(fd, RING_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(mm), fd

    def push(self, lease_id: int) -> bool:
        """Write ``lease_id``; False if the ring is full (the writer has not caught up)."""
        words, pos = self._words, self._pos
        if words[pos] != _EMPTY or lease_id == _EMPTY:
            return False
        words[pos] = lease_id
        self._pos = (pos + 1) % RING_SLOTS
        return True

    def unread(self) -> bool:
        """Whether the writer has not taken the last id written (or wrote there itself)."""
        return self._words[self._pos - 1] != _EMPTY

    # -- the writer's side --------------------------------------------------------

    @classmethod
    def map(cls, fd: int) -> FreedRing:
        """Map the ring the daemon sent; ValueError unless it is one (the fd stays open)."""
        if os.fstat(fd).st_size != RING_BYTES:
            raise ValueError("the daemon's Freed ring has the wrong size")
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & fcntl.F_SEAL_SHRINK == 0:
            raise ValueError("the daemon's Freed ring is not sealed")
        return cls(mmap.mmap(fd, RING_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))

    def ready(self) -> bool:
        """Whether an id waits (one word read: cheap enough for every cut)."""
        return self._words[self._pos] != _EMPTY

    def take(self) -> list[int]:
        """Every id written since the last take, oldest first; their slots go back to 0."""
        words, pos = self._words, self._pos
        out = []
        while (lease_id := words[pos]) != _EMPTY:
            words[pos] = _EMPTY
            out.append(lease_id)
            pos = (pos + 1) % RING_SLOTS
        self._pos = pos
        return out

    def close(self) -> None:
        self._words.release()
        self._view.release()
        self._mm.close()
