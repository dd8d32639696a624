"""CPU time of another process, from procfs (used for the daemon's share of a transfer)."""

from __future__ import annotations

import os

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_cpu_ns(pid: int) -> int | None:
    """utime + stime of ``pid`` (all its threads) in ns; None if it is gone.

    Resolution is one clock tick (10 ms at 100 Hz), so divide deltas over many
    transfers, never over one.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # the command name is in parentheses and may contain spaces; fields resume after the last ")"
    fields = data[data.rindex(b")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) * 1_000_000_000 // _TICKS_PER_S
