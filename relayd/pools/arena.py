"""The daemon's SHM arena: segments created once at start, cut into slots.

Names are ``relayd.<node>.<epoch>.<n>``. Beside the segments the daemon holds
an ``flock`` on ``relayd.<node>.<epoch>.lock``; the kernel drops that lock when
the daemon dies however it dies, so a starting daemon removes exactly the
segments whose lock it can take - a dead daemon's, never a live one's (several
daemons share /dev/shm in tests and on multi-tenant hosts, and pids are
reused, so "is pid X alive" would be the wrong question).
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import mmap
import os
import re
import time

from relayd_client.wire.paths import SHM_DIR
from relayd_client.wire.shm import SHM_POOL, MappedSegment, segment_nslots
from relayd_client.wire.slots import SlotAllocator

from ..rundir import same_file

log = logging.getLogger(__name__)

PREFIX = "relayd."
# Pre-faulting takes seconds per GiB: arenas from this size log each segment as it
# is ready, so a start that takes 15 s is not a silent one.
PROGRESS_FROM_BYTES = 256 << 20
_NAME_RE = re.compile(
    r"^relayd\.(?P<node>[A-Za-z0-9_-]+)\.(?P<epoch>[A-Za-z0-9]+)\.(?P<n>\d+|lock)$"
)


def safe_node(node_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", node_id)[:64] or "node"


# Not frozen, though nothing changes a run once made: every lease makes one, and
# a frozen dataclass's __init__ costs 1.5 us against 0.4 (measured).
@dataclasses.dataclass(slots=True, unsafe_hash=True)
class Run:
    segment: int
    slot: int
    nslots: int
    pool: str = SHM_POOL  # which pool's allocator the run belongs to (SHM_POOL, "cuda:<uuid>")


def remove_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink every relayd segment whose owner's lock is free. Returns the names removed."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    epochs: dict[tuple[str, str], list[str]] = {}
    for name in names:
        m = _NAME_RE.match(name)
        if m:
            epochs.setdefault((m["node"], m["epoch"]), []).append(name)
    removed: list[str] = []
    for (node, epoch), members in epochs.items():
        lock_name = f"{PREFIX}{node}.{epoch}.lock"
        if lock_name in members:
            try:
                fd = os.open(os.path.join(shm_dir, lock_name), os.O_RDWR | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # a live daemon holds it
            # Hold the lock while unlinking so two starting daemons don't race.
            try:
                _unlink_all(shm_dir, members, removed)
            finally:
                os.close(fd)
        else:
            # The lock is created before any segment and removed after the
            # last, so segments without one belong to nobody: finish the job.
            _unlink_all(shm_dir, members, removed)
    if removed:
        log.info("removed %d segments of dead daemons", len(removed), extra={"segments": removed})
    return removed


def _unlink_all(shm_dir: str, members: list[str], removed: list[str]) -> None:
    # Segments first, lock last: a crash halfway leaves a lock to retry with.
    for name in sorted(members, key=lambda n: n.endswith(".lock")):
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
        except FileNotFoundError:
            pass


class Arena:
    """Segments plus one allocator per segment (a run never crosses segments)."""

    name = SHM_POOL

    def __init__(
        self,
        *,
        node_id: str,
        epoch: str,
        total_bytes: int,
        segment_bytes: int,
        slot_size: int,
        mode: int = 0o600,
    ) -> None:
        self.slot_size = slot_size
        self.prefix = f"{PREFIX}{safe_node(node_id)}.{epoch}"
        self.segments: list[MappedSegment] = []
        self.allocators: list[SlotAllocator] = []
        lock_path = os.path.join(SHM_DIR, f"{self.prefix}.lock")
        while True:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
            # Created, then locked: in between, another daemon's sweep may take
            # the file for a dead daemon's (holding it only while it unlinks)
            # and unlink it. Segments made under a lock nobody can find would be
            # swept by the next start, so a lock on an unlinked file is retaken.
            fcntl.flock(fd, fcntl.LOCK_EX)
            if same_file(fd, lock_path):
                break
            os.close(fd)
        self._lock_fd = fd
        progress = total_bytes >= PROGRESS_FROM_BYTES
        count = -(-total_bytes // segment_bytes)
        if progress:
            log.info(
                "pre-faulting the SHM arena: %d MiB in %d segments of up to %d MiB",
                total_bytes >> 20,
                count,
                segment_bytes >> 20,
            )
        started = time.monotonic()
        try:
            remaining = total_bytes
            while remaining >= slot_size * 2:
                size = min(remaining, segment_bytes)
                if segment_nslots(size, slot_size) == 0:
                    break
                seg = MappedSegment(
                    f"{self.prefix}.{len(self.segments)}",
                    size,
                    len(self.segments),
                    slot_size,
                    create=True,
                    mode=mode,
                )
                self.segments.append(seg)
                self.allocators.append(SlotAllocator(seg.nslots))
                remaining -= size
                if progress:
                    log.info(
                        "arena segment %d/%d ready (%d of %d MiB, %.1f s)",
                        len(self.segments),
                        count,
                        (total_bytes - remaining) >> 20,
                        total_bytes >> 20,
                        time.monotonic() - started,
                    )
            if not self.segments:
                raise ValueError(f"arena of {total_bytes} bytes holds no slot of {slot_size}")
        except BaseException:
            self.close()
            raise

    # -- capacity -------------------------------------------------------------

    @property
    def capacity_slots(self) -> int:
        return sum(a.nslots for a in self.allocators)

    @property
    def free_slots(self) -> int:
        return sum(a.free_slots for a in self.allocators)

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_slots * self.slot_size

    @property
    def used_bytes(self) -> int:
        return (self.capacity_slots - self.free_slots) * self.slot_size

    def largest_free_run(self) -> int:
        return max((a.largest_free_run() for a in self.allocators), default=0)

    def max_run_slots(self) -> int:
        return max(a.nslots for a in self.allocators)

    # -- runs -----------------------------------------------------------------

    def allocate(self, nslots: int) -> Run | None:
        for i, alloc in enumerate(self.allocators):
            slot = alloc.allocate(nslots)
            if slot is not None:
                return Run(i, slot, nslots)
        return None

    def free(self, run: Run) -> None:
        self.allocators[run.segment].free(run.slot, run.nslots)

    def clear_header(self, segment: int, slot: int) -> None:
        """Zero a lease's header so any DataRef still naming it reads as stale."""
        self.segments[segment].write_header(slot, 0, 0)

    def header(self, segment: int, slot: int) -> tuple[int, int]:
        return self.segments[segment].read_header(slot)

    def _data(self, run: Run) -> tuple[mmap.mmap, int]:
        """The mapping ``run``'s data lies in, and where it starts there."""
        seg = self.segments[run.segment]
        return seg.mm, seg.slot_offset(run.slot)

    def read(self, run: Run, nbytes: int) -> bytes:
        """A copy of the first ``nbytes`` of ``run``'s data."""
        mm, start = self._data(run)
        return mm[start : start + nbytes]

    def view(self, run: Run, nbytes: int) -> memoryview:
        """A writable view of the first ``nbytes`` of ``run``'s data; release it
        before the arena closes."""
        mm, start = self._data(run)
        return memoryview(mm)[start : start + nbytes]

    def write(self, run: Run, data: bytes | memoryview) -> None:
        """Copy ``data`` to the start of ``run``'s data (the caller checked it fits)."""
        mm, start = self._data(run)
        mm[start : start + len(data)] = data

    # -- lifetime -------------------------------------------------------------

    def close(self) -> None:
        """Unmap and unlink every segment, then the lock."""
        for seg in self.segments:
            seg.close()
            seg.unlink()
        self.segments.clear()
        if self._lock_fd >= 0:
            try:
                os.unlink(os.path.join(SHM_DIR, f"{self.prefix}.lock"))
            except FileNotFoundError:
                pass
            os.close(self._lock_fd)
            self._lock_fd = -1
