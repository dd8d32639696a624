"""What a call costs here the first time after a wait: the machine's cold-call probe.

Code that has not run for a millisecond can run several times slower the first
time it runs again, its caches and branch predictors lost to whatever ran
meanwhile; on a shared VM the loss is large and changes from one machine to the
next. A stage's puts and gets all come after such a wait (a round trip, a
stream's 20 ms between chunks), so it sets their cost as much as their warm
speed does. The bench measures it once per run and prints it with the machine,
so that two runs can be compared knowing it; ``--breakdown``'s cold table uses
the same pause.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

# The idle time before each cold call.
COLD_PAUSE_S = 0.001
# The probe's work: this many calls of a small Python function.
PROBE_CALLS = 20
SAMPLES = 200


@dataclasses.dataclass(frozen=True)
class ColdCall:
    calls: int
    pause_s: float
    warm_us: float  # median, each run right after the last
    cold_us: float  # median, each run after pause_s asleep

    @property
    def ratio(self) -> float:
        return self.cold_us / max(self.warm_us, 1e-9)

    def line(self) -> str:
        return (
            f"cold calls: {self.calls} Python calls take {self.warm_us:.1f} µs back to back, "
            f"{self.cold_us:.1f} µs after {self.pause_s * 1e3:g} ms asleep (x{self.ratio:.1f})"
        )


def _step(x: int) -> int:
    return x + 1


def _work() -> int:
    x = 0
    for _ in range(PROBE_CALLS):
        x = _step(x)
    return x


def median_us(fn: Callable[[], object], samples: int, pause: float) -> float:
    """The median µs of ``samples`` calls of ``fn``, each after ``pause`` seconds asleep."""
    clock = time.perf_counter_ns
    times = []
    for _ in range(samples):
        if pause:
            time.sleep(pause)
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times) / 1000


def probe(samples: int = SAMPLES, pause: float = COLD_PAUSE_S) -> ColdCall:
    """Time the probe's work warm and cold (about ``samples`` x ``pause`` seconds)."""
    _work()  # compiled and specialized before either is timed
    warm, cold = median_us(_work, samples, 0.0), median_us(_work, samples, pause)
    return ColdCall(PROBE_CALLS, pause, warm, cold)
