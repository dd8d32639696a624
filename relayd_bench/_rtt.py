"""Network round trips on a cross-node read's critical path, and the latency they model.

This host's kernel cannot inject delay (no ``netem``), so the bench counts the round
trips a reader waits for, from ``put`` returning to ``get`` returning, and models
the latency at a real network's RTT as ``measured + round trips x RTT``.

Counted per read, in units of one RTT, the DataRef's own one-way trip included:

- a bare Mooncake read started when the DataRef arrives: the DataRef (0.5), then
  each ``transfer_sync_read`` the reader issued (1 each, counted by the method);
- relayd, from the reader's daemon's ``PeerStatus`` counters (deltas over the run):
  ``reads_landed``: the push had landed, the read waits for nothing beyond the
  DataRef (0.5); ``reads_awaited``: it waits for the push's Mooncake WRITE, whose
  acknowledgement the writer's daemon needs before it sends Landed (1), and for
  that one-way Landed notice (0.5), which overlaps the DataRef's trip (1.5 in all);
  ``reads_pulled``: the DataRef (0.5), then the Mooncake phases the pull waited
  for one after the other, as the daemon counts them (``pull_phases``: the data's
  reads, then the slot header's, 1 each). The release notice that follows a pull
  is not waited for. ``reads_attached``: a push whose bytes rode its Landed
  notice (no WRITE to acknowledge), which left with the put as the DataRef did:
  its one-way trip overlaps the DataRef's (0.5), landed or awaited.
  ``reads_announced``: the push had landed and the reader's daemon had said
  where, so the get asked nothing at all (0.5).

Whether a push had landed depends on the link: on this one (an RTT of tens of µs)
many have landed before the reader asks; at a real network's RTT the Landed
notice arrives 1 RTT after the DataRef, so such a read may wait for it after all.
``RT+`` is that bound: every pushed read counted as awaited (an attached push's
Landed notice travels with its bytes, so its reads stay at 0.5 in both).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

MODEL_RTTS_NS = (50_000, 200_000, 1_000_000)
DATAREF_TRIP = 0.5  # the DataRef's one-way trip over the application's channel
WRITE_ACK = 1.0  # a Mooncake WRITE and its acknowledgement
NOTICE_TRIP = 0.5  # a one-way notice between daemons (Landed)
MOONCAKE_READ = 1.0  # a Mooncake read: request out, data back
PULL_PHASES = 2  # data, then slot header: for a daemon that does not count pull_phases
READ_COUNTERS = (
    "reads_landed",
    "reads_awaited",
    "reads_pulled",
    "pull_phases",
    "reads_attached",
    "reads_announced",
)
EXTRA_RT = "rt"  # Result.extra key: round trips per read, formatted by fmt_rt
EXTRA_RT_BOUND = "rt+"  # the same with every pushed read counted as awaited (see above)


@dataclasses.dataclass(frozen=True)
class ReadCounts:
    landed: int = 0
    awaited: int = 0
    pulled: int = 0
    pull_phases: int = 0  # Mooncake phases the pulls waited for, in all
    attached: int = 0  # reads of pushes whose bytes rode the Landed notice
    announced: int = 0  # reads of landed pushes whose lease the daemon announced

    @property
    def total(self) -> int:
        return self.landed + self.awaited + self.pulled + self.attached + self.announced

    def __sub__(self, other: ReadCounts) -> ReadCounts:
        return ReadCounts(
            self.landed - other.landed,
            self.awaited - other.awaited,
            self.pulled - other.pulled,
            self.pull_phases - other.pull_phases,
            self.attached - other.attached,
            self.announced - other.announced,
        )


def read_counts(status: Mapping[str, Any]) -> ReadCounts:
    """Sum of the reads a daemon's Status reports over all its peers (proto field names)."""
    sums = dict.fromkeys(READ_COUNTERS, 0)
    for peer in status.get("peers", []):
        for key in READ_COUNTERS:
            sums[key] += int(peer.get(key, 0))
    return ReadCounts(*(sums[key] for key in READ_COUNTERS))


def relayd_round_trips(c: ReadCounts, *, landed_as_awaited: bool = False) -> float | None:
    """Mean round trips per cross-node read; None when no read was counted."""
    if c.total <= 0:
        return None
    awaited = max(DATAREF_TRIP, WRITE_ACK + NOTICE_TRIP)
    landed = awaited if landed_as_awaited else DATAREF_TRIP
    phases = c.pull_phases if c.pull_phases or not c.pulled else c.pulled * PULL_PHASES
    pulled = c.pulled * DATAREF_TRIP + phases * MOONCAKE_READ
    asked_nothing = (c.attached + c.announced) * DATAREF_TRIP
    return (c.landed * landed + c.awaited * awaited + pulled + asked_nothing) / c.total


def bare_read_round_trips(reads: int, transfers: int) -> float | None:
    """Mean round trips per transfer of a reader that issues ``reads`` Mooncake reads."""
    if transfers <= 0:
        return None
    return DATAREF_TRIP + MOONCAKE_READ * reads / transfers


def modelled_ns(measured_ns: float, round_trips: float, rtt_ns: float) -> float:
    """The latency at ``rtt_ns``: what the link measured plus the round trips at that RTT."""
    return measured_ns + round_trips * rtt_ns


def rtt_label(rtt_ns: int) -> str:
    """A column heading: "RTT 50us", "RTT 1ms"."""
    return f"RTT {rtt_ns / 1e6:g}ms" if rtt_ns >= 1_000_000 else f"RTT {rtt_ns / 1e3:g}us"


def fmt_rt(round_trips: float) -> str:
    return f"{round_trips:.2f}"


def parse_rt(extra: Mapping[str, str], key: str = EXTRA_RT) -> float | None:
    text = extra.get(key)
    try:
        return None if text is None else float(text)
    except ValueError:
        return None


def model_rows(
    rows: Sequence[tuple[str, int, float, float]], rtts_ns: Sequence[int] = MODEL_RTTS_NS
) -> list[tuple[str, int, float, float, list[float]]]:
    """(method, size, median ns, round trips) -> the same with the modelled latencies."""
    return [(m, s, med, rt, [modelled_ns(med, rt, r) for r in rtts_ns]) for m, s, med, rt in rows]
