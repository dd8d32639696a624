"""Put/get latency per edge: the bucket bounds, and the client's accumulator.

The bounds are defined here once; the daemon imports them for its
``relayd_put_seconds``/``relayd_get_seconds`` histograms and for what
``relayd status``/``top`` compute from them, so a client's bucket ``i`` is
the daemon's bucket ``i``. A client never imports prometheus-client: it
counts per bucket and sends the counts with its batched transfer reports.

Observing costs a bisect over integers and two integer increments on a list
the edge already has (no allocation after an edge's first put or get):
times are taken with ``perf_counter_ns``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from .proto import relay_pb2 as pb

# Upper bounds ("le"), 10 us to 10 s in 1-2-5 steps; one more bucket past the
# last bound counts anything slower.
BOUNDS_NS: tuple[int, ...] = (
    *(m * 10**e for e in range(4, 10) for m in (1, 2, 5)),
    10 * 10**9,
)
BOUNDS: tuple[float, ...] = tuple(b / 1e9 for b in BOUNDS_NS)  # seconds
NBUCKETS = len(BOUNDS_NS) + 1

PUT, GET = 0, 1
# (op, from_stage, to_stage, transport)
_Key = tuple[int, str, str, int]


class EdgeLatency:
    """One client's latency counts since its last report, by edge and transport.

    Per key a list of ``NBUCKETS`` counts followed by the total in ns.
    """

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: dict[_Key, list[int]] = {}

    def observe(self, op: int, from_stage: str, to_stage: str, transport: int, ns: int) -> None:
        key = (op, from_stage, to_stage, transport)
        counts = self._counts.get(key)
        if counts is None:
            counts = self._counts[key] = [0] * (NBUCKETS + 1)
        counts[bisect.bisect_left(BOUNDS_NS, ns)] += 1
        counts[NBUCKETS] += ns

    def drain(self) -> list[pb.EdgeLatencyReport]:
        """Everything counted since the last drain, one message per edge and transport."""
        counts, self._counts = self._counts, {}
        out: dict[tuple[str, str, int], pb.EdgeLatencyReport] = {}
        for (op, src, dst, transport), c in counts.items():
            msg = out.get((src, dst, transport))
            if msg is None:
                msg = out[src, dst, transport] = pb.EdgeLatencyReport(
                    from_stage=src,
                    to_stage=dst,
                    transport=transport,  # type: ignore[arg-type]
                )
            if op == PUT:
                msg.put_buckets.extend(c[:NBUCKETS])
                msg.put_sum_ns = c[NBUCKETS]
            else:
                msg.get_buckets.extend(c[:NBUCKETS])
                msg.get_sum_ns = c[NBUCKETS]
        return list(out.values())


def quantile(buckets: Sequence[int], q: float, bounds: Sequence[float] = BOUNDS) -> float | None:
    """The upper bound, in seconds, of the bucket holding the ``q`` quantile; None: empty.

    Past the last bound it answers the last bound: "that long or more".
    """
    total = sum(buckets)
    if total <= 0 or not bounds:
        return None
    seen = 0
    for i, n in enumerate(buckets):
        seen += n
        if seen >= q * total:
            return float(bounds[min(i, len(bounds) - 1)])
    return float(bounds[-1])
