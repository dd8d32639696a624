"""How long Python's garbage collector stops the daemon, per generation.

Every collection runs on whichever thread allocated last, usually the event
loop's, and nothing else runs meanwhile: a full collection walks every object
the daemon holds, a stall every session sees at once (tens of milliseconds
over 65,536 request records, measured). The operator sees them as
``relayd_gc_pause_seconds``.

Once serving, the daemon freezes what it built at startup (:meth:`GcPauses.freeze`):
the ~36,500 objects of its modules, protobuf descriptors and parts move to
the permanent generation, which no collection walks again. Before, each full
collection walked them all: 12-16 ms, a stall a 50/s stream saw as a 21 ms
chunk; after ~5,000 transfers the rest is ~3,000 objects, 0.4 ms (measured).
Frozen objects are still freed by reference counting; only a cycle among them
would stay, and startup's cycles are collected first.

The callback only counts into plain lists (no lock, no allocation the
collector tracks); the histogram is built from them at scrape time, like the
other collectors in :mod:`relayd.metrics`.
"""

from __future__ import annotations

import bisect
import gc
import time
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

GENERATIONS = 3
# Upper bounds, seconds: a young collection takes tens of microseconds, a full
# one over a big heap tens to hundreds of milliseconds.
PAUSE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)


class GcPauses(Collector):
    """Times this process's collections while watching; a collector of the results."""

    def __init__(self) -> None:
        # Per generation: a count per bucket (the last one: above every bound), and the sum.
        self._counts = [[0] * (len(PAUSE_BUCKETS) + 1) for _ in range(GENERATIONS)]
        self._sums = [0.0] * GENERATIONS
        self._started = 0.0
        self.frozen = 0

    def freeze(self) -> int:
        """Collect, then move every object alive into the permanent generation;
        returns how many are frozen. Call once the process has built what it
        keeps for life, before it serves: that collection is not counted, as
        nobody waited for it."""
        watching = self._on_gc in gc.callbacks
        self.stop()
        gc.collect()
        gc.freeze()
        if watching:
            self.watch()
        self.frozen = gc.get_freeze_count()
        return self.frozen

    def watch(self) -> None:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        seconds = time.perf_counter() - self._started
        generation = min(info["generation"], GENERATIONS - 1)
        self._counts[generation][bisect.bisect_left(PAUSE_BUCKETS, seconds)] += 1
        self._sums[generation] += seconds

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            "relayd_gc_pause_seconds",
            "Time the daemon stood still for Python's garbage collector",
            labels=["generation"],
        )
        for generation in range(GENERATIONS):
            counts = list(self._counts[generation])  # one copy: consistent buckets
            cumulative, buckets = 0, []
            for bound, n in zip((*PAUSE_BUCKETS, float("inf")), counts, strict=True):
                cumulative += n
                # The le label as prometheus_client writes its own histograms (untyped there).
                le = floatToGoString(bound)  # type: ignore[no-untyped-call]
                buckets.append((le, cumulative))
            family.add_metric([str(generation)], buckets, self._sums[generation])
        yield family
        yield GaugeMetricFamily(
            "relayd_gc_frozen_objects",
            "Objects built at startup that no garbage collection walks",
            value=self.frozen,
        )
