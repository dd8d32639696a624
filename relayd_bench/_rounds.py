"""Several rounds of the same methods in one run, and the ratios they agree on.

On a shared or noisy machine one method's median moves by tens of percent from
one minute to the next, so a ratio of two medians taken minutes apart says
little about either method. ``relayd bench --rounds N`` runs every method and
size N times, reversing the methods' order every other round, and gives each
ratio as the median of its N per-round ratios with their range: the two sides
of every ratio measured in the same round. Where both sides of a comparison
counted their round trips, each round's ratio of the latencies they model at
the ``_rtt`` RTTs is summarized the same way. The table's cells are each the
median round's cell (a real run, with its own p99 and CPU), not a blend.

Pure functions over ``_stats`` results, like ``_stats`` itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from relayd_bench import _rtt
from relayd_bench._stats import COMPARISONS, REFERENCE_METHOD, Result, median, medians


@dataclasses.dataclass(frozen=True)
class RoundRatios:
    """One method over its baseline at one size, once per round where both ran."""

    method: str
    baseline: str
    size: int
    ratios: tuple[float, ...]
    rtt_ns: int | None = None
    """None: the ratio of the medians; else of the latencies modelled at this RTT."""

    @property
    def median(self) -> float:
        return median(self.ratios)

    @property
    def low(self) -> float:
        return min(self.ratios)

    @property
    def high(self) -> float:
        return max(self.ratios)

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "baseline": self.baseline,
            "size": self.size,
            "ratios": list(self.ratios),
            "median": self.median,
            "modelled_at_rtt_ns": self.rtt_ns,
        }


def _modelled(results: Sequence[Result], rtt_ns: int) -> dict[tuple[str, int], float]:
    """The latency each cell that counted its round trips models at ``rtt_ns``."""
    return {
        (r.method, r.size): _rtt.modelled_ns(r.latency.median_ns, rt, rtt_ns)
        for r in results
        if r.latency is not None
        and r.latency.median_ns > 0
        and (rt := _rtt.parse_rt(r.extra)) is not None
    }


def _pairs(methods: Sequence[str]) -> list[tuple[str, str]]:
    """Every method over ``floor``, then the named comparisons, in the run's method order."""
    pairs = [(m, REFERENCE_METHOD) for m in methods if m != REFERENCE_METHOD]
    return pairs + [p for p in COMPARISONS if p not in pairs]


def round_ratios(rounds: Sequence[Sequence[Result]]) -> list[RoundRatios]:
    """Per (method, baseline, size) that ran in the same round at least once: the ratio
    of the two medians in each such round."""
    if not rounds:
        return []
    methods = list(dict.fromkeys(r.method for r in rounds[0]))
    sizes = list(dict.fromkeys(r.size for r in rounds[0]))
    out = _ratios(_pairs(methods), sizes, [medians(results) for results in rounds], None)
    for rtt in _rtt.MODEL_RTTS_NS:
        per_round = [_modelled(results, rtt) for results in rounds]
        out += _ratios(COMPARISONS, sizes, per_round, rtt)
    return out


def _ratios(
    pairs: Sequence[tuple[str, str]],
    sizes: Sequence[int],
    per_round: Sequence[dict[tuple[str, int], float]],
    rtt_ns: int | None,
) -> list[RoundRatios]:
    out = []
    for method, baseline in pairs:
        for size in sizes:
            ratios = tuple(
                m[method, size] / m[baseline, size]
                for m in per_round
                if (method, size) in m and (baseline, size) in m
            )
            if ratios:
                out.append(RoundRatios(method, baseline, size, ratios, rtt_ns))
    return out


def median_cells(rounds: Sequence[Sequence[Result]]) -> list[Result]:
    """Each (method, size) cell of the first round's order, taken from the round whose
    median is that cell's median round (the lower middle one of an even count); a
    cell measured in no round is the first round's (skipped or failed, with why)."""
    if not rounds:
        return []
    out = []
    for first in rounds[0]:
        measured = [
            cell
            for results in rounds
            for cell in results
            if cell.method == first.method and cell.size == first.size and cell.latency is not None
        ]
        if not measured:
            out.append(first)
            continue
        measured.sort(key=lambda cell: cell.latency.median_ns if cell.latency else 0.0)
        out.append(dataclasses.replace(measured[(len(measured) - 1) // 2]))  # its own ratios
    return out


__all__ = ["RoundRatios", "median_cells", "round_ratios"]
