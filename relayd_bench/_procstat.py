"""Another process's CPU time and wake-ups, from procfs (the daemon's share of a transfer)."""

from __future__ import annotations

import dataclasses
import os
import time

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_WAKEUPS = b"voluntary_ctxt_switches:"
_CPUCLOCK_SCHED = 2  # a CPU-time clock that counts what the scheduler ran, in ns


@dataclasses.dataclass(frozen=True)
class ProcSample:
    """What a process had spent at one moment; subtract two for what happened between.

    ``wakeups`` counts the times its main thread (the daemon's event loop) went
    to sleep, so each is one wake-up by whatever came next: a session frame, a
    peer's notice, a timer. Beside the CPU it tells whether a daemon works more
    often or more each time.
    """

    cpu_ns: int
    wakeups: int

    def __sub__(self, other: ProcSample) -> ProcSample:
        return ProcSample(self.cpu_ns - other.cpu_ns, self.wakeups - other.wakeups)


def proc_sample(pid: int) -> ProcSample | None:
    """``pid``'s CPU (all threads) and its main thread's wake-ups; None if it is gone."""
    cpu = proc_cpu_ns(pid)
    wakeups = proc_wakeups(pid)
    return None if cpu is None or wakeups is None else ProcSample(cpu, wakeups)


def proc_cpu_ns(pid: int) -> int | None:
    """CPU time of ``pid`` (all its threads, those gone included) in ns; None if it is gone.

    Read from the process's CPU-time clock, exact to the ns: the daemon's share of
    a transfer is tens of µs, and the clock tick of ``/proc/<pid>/stat`` (10 ms)
    over a few hundred transfers is as coarse as the target. Where that clock
    cannot be read, ``/proc/<pid>/stat`` (one tick of resolution: divide deltas
    over many transfers, never over one).
    """
    try:
        return time.clock_gettime_ns(process_cpu_clock(pid))
    except OSError:  # gone, or no such clock here
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # the command name is in parentheses and may contain spaces; fields resume after the last ")"
    fields = data[data.rindex(b")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) * 1_000_000_000 // _TICKS_PER_S


def process_cpu_clock(pid: int) -> int:
    """The clock id of ``pid``'s CPU-time clock, as Linux's ``clock_getcpuclockid(3)``
    makes it (which Python does not wrap): ``~pid << 3 | CPUCLOCK_SCHED``."""
    return (~pid << 3) | _CPUCLOCK_SCHED


def proc_wakeups(pid: int) -> int | None:
    """Voluntary context switches of ``pid``'s main thread (proc(5)); None if it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(_WAKEUPS):
                    return int(line[len(_WAKEUPS) :])
    except OSError:
        return None
    return None
