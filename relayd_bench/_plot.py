"""PNG of a run: latency against size per method (log-log), and each method's ratio to floor."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

from relayd_bench._stats import REFERENCE_METHOD, Result, Status
from relayd_bench._table import fmt_size


class PlotUnavailable(RuntimeError):
    pass


def check_available() -> None:
    """Fail before the run, not after it, when the plot cannot be drawn."""
    if importlib.util.find_spec("matplotlib") is None:
        raise PlotUnavailable(
            "--plot needs matplotlib, which is not installed: pip install 'relayd[bench]'"
            " (or pip install matplotlib)"
        )


def write_plot(path: str, results: Sequence[Result], machine: dict[str, Any] | None = None) -> None:
    check_available()
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.status is Status.OK and r.latency is not None]
    methods = list(dict.fromkeys(r.method for r in ok))
    sizes = sorted({r.size for r in ok})
    fig, (lat_ax, ratio_ax) = plt.subplots(1, 2, figsize=(14, 5.5))
    # More methods than the default ten-colour cycle: one colour each, and
    # relayd's own methods drawn with squares so they stand out from baselines.
    palette = matplotlib.colormaps["tab20"]
    for k, m in enumerate(methods):
        rows = sorted((r for r in ok if r.method == m), key=lambda r: r.size)
        xs = [r.size for r in rows]
        med = [r.latency.median_ns / 1e3 for r in rows if r.latency]
        p99 = [r.latency.p99_ns / 1e3 for r in rows if r.latency]
        dark_first = (2 * k) % 20 + (2 * k // 20) % 2  # tab20's strong shades, then the light
        style = {"color": palette(dark_first), "marker": "s" if m.startswith("relayd") else "o"}
        lat_ax.plot(xs, med, label=m, linewidth=2 if m == "floor" else 1.3, **style)
        lat_ax.plot(xs, p99, linestyle=":", color=style["color"], linewidth=1)
        ratio = [(r.size, r.ratio_vs_floor) for r in rows if r.ratio_vs_floor is not None]
        if ratio:
            ratio_ax.plot([s for s, _ in ratio], [v for _, v in ratio], label=m, **style)
    for ax in (lat_ax, ratio_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [fmt_size(s) for s in sizes])
        ax.set_xlabel("payload size")
        ax.grid(True, which="both", alpha=0.3)
    lat_ax.set_yscale("log")
    lat_ax.set_ylabel("one-way latency, µs (solid: median, dotted: p99)")
    lat_ax.set_title("stop-and-wait hand-off latency")
    ratio_ax.set_yscale("log")
    ratio_ax.axhline(1.0, color="black", linewidth=0.8)
    ratio_ax.set_ylabel(f"median / {REFERENCE_METHOD} median")
    ratio_ax.set_title(f"ratio to {REFERENCE_METHOD} at the same size")
    # one legend for both panels, outside them, so it never hides a curve
    handles, labels = lat_ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8)
    if machine:
        fig.suptitle(
            f"relayd bench · {machine.get('cpu_model')} · {machine.get('cores')} cores", fontsize=10
        )
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
