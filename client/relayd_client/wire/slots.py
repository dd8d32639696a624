"""Contiguous-run slot allocator.

Shared by the daemon (cutting pools into grants) and the client (cutting its
grants into leases), so both sides agree on one implementation of the rules.

A pool of ``n`` slots is a set of free runs ``[start, start+length)``. Free
runs are kept sorted by start (a bisected list) with two dicts that make
coalescing on free O(log k): ``_by_start`` and ``_by_end``. Allocation is
first-fit over the free runs, O(k) in the number of free runs, not in the
number of slots: a pool of thousands of slots with little fragmentation
allocates in microseconds. First-fit keeps the low end of the pool hot and
leaves large runs at the high end for large transfers.
"""

from __future__ import annotations

import bisect


class SlotAllocator:
    """Allocate and free contiguous runs of slots in ``[0, nslots)``."""

    __slots__ = ("_by_end", "_by_start", "_free", "_starts", "nslots")

    def __init__(self, nslots: int) -> None:
        if nslots < 0:
            raise ValueError("nslots must be >= 0")
        self.nslots = nslots
        self._starts: list[int] = []
        self._by_start: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        self._free = 0
        if nslots:
            self._insert(0, nslots)

    # -- queries -------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        return self._free

    @property
    def used_slots(self) -> int:
        return self.nslots - self._free

    def largest_free_run(self) -> int:
        return max(self._by_start.values(), default=0)

    def free_runs(self) -> list[tuple[int, int]]:
        """(start, length) of every free run, in order; for status and tests."""
        return [(s, self._by_start[s]) for s in self._starts]

    # -- mutation ------------------------------------------------------------

    def allocate(self, count: int) -> int | None:
        """First slot of a free run of ``count`` slots, or None when none fits."""
        if count <= 0:
            raise ValueError("count must be >= 1")
        if count > self._free:
            return None
        for start in self._starts:
            length = self._by_start[start]
            if length >= count:
                self._remove(start)
                if length > count:
                    self._insert(start + count, length - count)
                return start
        return None

    def allocate_at(self, start: int, count: int) -> bool:
        """Take exactly ``[start, start+count)`` if it is free (used to rebuild state)."""
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0:
            return False
        run = self._starts[i]
        length = self._by_start[run]
        if start + count > run + length:
            return False
        self._remove(run)
        if start > run:
            self._insert(run, start - run)
        if run + length > start + count:
            self._insert(start + count, run + length - start - count)
        return True

    def free(self, start: int, count: int) -> None:
        """Return a run; coalesces with its neighbours. Double frees raise ValueError."""
        if count <= 0 or start < 0 or start + count > self.nslots:
            raise ValueError(f"run [{start}, {start + count}) outside pool of {self.nslots}")
        i = bisect.bisect_right(self._starts, start) - 1
        if i >= 0:
            prev = self._starts[i]
            if prev + self._by_start[prev] > start:
                raise ValueError(f"run [{start}, {start + count}) is already free")
        if i + 1 < len(self._starts) and self._starts[i + 1] < start + count:
            raise ValueError(f"run [{start}, {start + count}) overlaps a free run")
        end = start + count
        prev_start = self._by_end.get(start)
        if prev_start is not None:
            count += self._by_start[prev_start]
            self._remove(prev_start)
            start = prev_start
        next_len = self._by_start.get(end)
        if next_len is not None:
            self._remove(end)
            count += next_len
        self._insert(start, count)

    # -- internals -----------------------------------------------------------

    def _insert(self, start: int, length: int) -> None:
        bisect.insort(self._starts, start)
        self._by_start[start] = length
        self._by_end[start + length] = start
        self._free += length

    def _remove(self, start: int) -> None:
        length = self._by_start.pop(start)
        del self._by_end[start + length]
        del self._starts[bisect.bisect_left(self._starts, start)]
        self._free -= length
