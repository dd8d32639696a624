"""Lease-id rings: news between a session and the daemon that nobody should be woken for.

Two kinds of news go this way, each in its own ring, each ring one session's:

- **Freed** (daemon -> writer): which of the writer's leases it may reuse. A
  Freed frame wakes the writer's reading thread, once per transfer at 2 MiB
  and up, yet the writer needs the news only when it next cuts a lease, so it
  reads the ring where it cuts.
- **Release** (reader -> daemon): which leases the reader is done with. A
  Release frame wakes the daemon, and a wake-up costs it more CPU than the
  notices it carries; the daemon needs the news only to free space, so it reads
  the ring when it is awake anyway (after each frame it handles, and on a
  timer while leases are out) and before a writer waits for space. A word
  with :data:`CLAIM_BIT` set claims the lease instead (a reader about to copy
  a large one): the daemon needs that news only if the reader dies first, or
  the lease's TTL runs out, and it reads the ring before either is judged.

Contract:

- The daemon creates each ring (a sealed memfd of :data:`RING_BYTES`) for a
  session that asks for it in its ``Bind`` and hands the descriptors over
  with the ``BOUND`` event (``SCM_RIGHTS``): the Freed ring, then the Release
  ring. A session without them uses frames: that is also what an older daemon
  does.
- Single producer, single consumer, no shared indexes: each side keeps its
  own position. A slot holds a lease id (never 0) or 0. The producer writes a
  slot only if it reads 0 there, else the ring is full and the news goes as a
  frame. The consumer takes slots until it reads 0, and zeroes each one it
  takes. Every hand-over is one aligned 8-byte word, so neither side can read
  half an id, and no ordering between two words is needed.
- In a Release ring a session's words are judged in the order it wrote them,
  and before any Claim or Release of a frame it sends later: a claim and the
  release that follows it never trade places, whichever way each goes.
- The client maps each ring read-write, so the daemon trusts nothing in one:
  in a Freed ring a word only decides whether it writes there or sends a frame;
  from a Release ring it takes at most :data:`RING_SLOTS` ids a turn (a client
  that keeps writing cannot hold it there) and judges each as it judges a
  Release notice of that session. The size is sealed, so a client cannot
  truncate a ring under the daemon's mapping (a fault there would end the
  daemon).
"""

from __future__ import annotations

import fcntl
import mmap
import os

#: Lease ids a ring holds; a consumer that takes nothing for this many gets frames.
RING_SLOTS = 512
#: A ring's whole size: one 8-byte word per slot.
RING_BYTES = RING_SLOTS * 8
#: In a Release ring: this word claims the lease ``word ^ CLAIM_BIT`` (lease
#: ids leave this bit clear, see :data:`.shm.MAX_GRANT_ID`).
CLAIM_BIT = 1 << 63
_EMPTY = 0
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class IdRing:
    """One side's mapping of a ring and its own position in it."""

    __slots__ = ("_mm", "_pos", "_view", "_words")

    def __init__(self, mm: mmap.mmap) -> None:
        self._mm = mm
        self._view = memoryview(mm)
        self._words = self._view.cast("Q")
        self._pos = 0

    @classmethod
    def create(cls, name: str) -> tuple[IdRing, int]:
        """A new ring and its descriptor, sealed at its size (the caller closes the fd)."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, RING_BYTES)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            mm = mmap.mmap(fd, RING_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(mm), fd

    @classmethod
    def map(cls, fd: int) -> IdRing:
        """Map a ring the daemon sent; ValueError unless it is one (the fd stays open)."""
        if os.fstat(fd).st_size != RING_BYTES:
            raise ValueError("the daemon's ring has the wrong size")
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & fcntl.F_SEAL_SHRINK == 0:
            raise ValueError("the daemon's ring is not sealed")
        return cls(mmap.mmap(fd, RING_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))

    # -- the producer's side --------------------------------------------------------

    def push(self, word: int) -> bool:
        """Write ``word`` (a lease id, or a claim of one); False if the ring is full
        (the consumer has not caught up)."""
        words, pos = self._words, self._pos
        if words[pos] != _EMPTY or word == _EMPTY:
            return False
        words[pos] = word
        self._pos = (pos + 1) % RING_SLOTS
        return True

    def unread(self) -> bool:
        """Whether the consumer has not taken the last id written (or wrote there itself)."""
        return self._words[self._pos - 1] != _EMPTY

    # -- the consumer's side --------------------------------------------------------

    def ready(self) -> bool:
        """Whether an id waits (one word read: cheap enough for every cut)."""
        return self._words[self._pos] != _EMPTY

    def take(self) -> list[int]:
        """The ids written since the last take, oldest first, at most one ring's worth;
        their slots go back to 0."""
        words, pos = self._words, self._pos
        out = []
        for _ in range(RING_SLOTS):
            lease_id = words[pos]
            if lease_id == _EMPTY:
                break
            words[pos] = _EMPTY
            out.append(lease_id)
            pos = (pos + 1) % RING_SLOTS
        self._pos = pos
        return out

    def close(self) -> None:
        self._words.release()
        self._view.release()
        self._mm.close()
