"""Runs going back to their pool: refusing a double free, fencing a dying GPU writer's runs.

A run of an orphaned GPU grant does not go back while its writer may still run
GPU work: a writer killed with a copy queued into it is still exiting when its
session's socket closes (its CUDA context goes with its last file
descriptors), and the copy could land on the next lease in those slots. Such
runs wait here until the writer has exited (:meth:`RunReturns.release_fenced`,
from the housekeeping sweep), or :data:`GPU_FENCE_LIMIT_S` at most.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from .arena import Run
from .records import Pool

log = logging.getLogger(__name__)

# The longest a dead GPU writer's runs wait for it to finish exiting.
GPU_FENCE_LIMIT_S = 60.0


class RunReturns:
    def __init__(
        self,
        pools: Mapping[str, Pool],
        arena_name: str,
        clock: Callable[[], float],
        gpu_work_may_run: Callable[[int], bool] | None = None,
    ) -> None:
        self.pools = pools
        self.arena_name = arena_name
        self.clock = clock
        # Whether a process (by pid) may still have GPU work queued.
        self.gpu_work_may_run = gpu_work_may_run
        self._fenced: list[tuple[Run, int, float]] = []

    def free(self, run: Run) -> None:
        """Give ``run`` back to its pool. A double free is a bug in the lease table:
        the allocator refuses it before changing anything, and it is logged,
        never raised into whichever handler or sweep was freeing."""
        try:
            self.pools[run.pool].free(run)
        except ValueError as exc:
            log.error("refused to free %s: %s", run, exc)

    def from_orphan(self, run: Run, writer_pid: int) -> None:
        """A run of an orphaned grant goes back, unless its GPU writer may still write."""
        if run.pool != self.arena_name and self.may_run(writer_pid):
            self._fenced.append((run, writer_pid, self.clock()))
            return
        self.free(run)

    def may_run(self, pid: int) -> bool:
        return self.gpu_work_may_run is not None and self.gpu_work_may_run(pid)

    def release_fenced(self, now: float) -> bool:
        """Free the fenced runs whose writer has exited (or waited too long); True if any."""
        keep: list[tuple[Run, int, float]] = []
        released = False
        for run, pid, since in self._fenced:
            if self.may_run(pid) and now - since < GPU_FENCE_LIMIT_S:
                keep.append((run, pid, since))
                continue
            if now - since >= GPU_FENCE_LIMIT_S:
                log.error(
                    "GPU writer %d still exiting after %.0f s; its slots go back", pid, now - since
                )
            self.free(run)
            released = True
        self._fenced = keep
        return released

    def __bool__(self) -> bool:
        return bool(self._fenced)
