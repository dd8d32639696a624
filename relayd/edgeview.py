"""Per-edge rows for ``relayd top`` and ``relayd status``, from status dicts.

Pure functions, like :mod:`relayd.status_tables`: the status dict's
``edge_traffic`` holds each (from_stage, to_stage, transport) series'
totals since the daemon started, with non-cumulative bucket counts over
``latency_bucket_bounds``. ``top`` subtracts the previous snapshot to get
rates and the p50/p99 of the calls made during the last interval.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from relayd_client.wire.latency import BOUNDS, quantile
from relayd_client.wire.transport import Transport

_Key = tuple[str, str, str]


class EdgeNumbers:
    """One edge's totals from a status dict (counts may arrive as strings)."""

    __slots__ = ("bytes", "get", "put", "transfers")

    def __init__(self, e: Mapping[str, Any]) -> None:
        self.transfers = _int(e.get("transfers"))
        self.bytes = _int(e.get("bytes"))
        self.put = [_int(x) for x in e.get("put_buckets") or []]
        self.get = [_int(x) for x in e.get("get_buckets") or []]


def traffic(d: Mapping[str, Any]) -> dict[_Key, EdgeNumbers]:
    out: dict[_Key, EdgeNumbers] = {}
    for e in d.get("edge_traffic") or []:
        if isinstance(e, Mapping):
            key = (str(e.get("from_stage") or "?"), str(e.get("to_stage") or "?"),
                   transport_name(e.get("transport")))  # fmt: skip
            out[key] = EdgeNumbers(e)
    return out


def transfers_by_edge(d: Mapping[str, Any]) -> dict[tuple[str, str], int]:
    """Transfers per (from_stage, to_stage), summed over transports."""
    out: dict[tuple[str, str], int] = {}
    for (src, dst, _t), n in traffic(d).items():
        out[src, dst] = out.get((src, dst), 0) + n.transfers
    return out


def format_latency(seconds: float | None, *, last: float = BOUNDS[-1]) -> str:
    """``20us``, ``1ms``, ``500ms``, ``2s``; ``10s+`` past the last bound; ``-`` for none."""
    if seconds is None:
        return "-"
    if seconds >= last:
        return f"{last:g}s+"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f}us"
    if seconds < 1:
        return f"{seconds * 1e3:.0f}ms"
    return f"{seconds:g}s"


def edge_rows(
    d: Mapping[str, Any], previous: Mapping[str, Any] | None, interval: float
) -> list[list[str]]:
    """EDGE, TRANSPORT, XFER/S, MB/S, PUT50, PUT99, GET50, GET99 per series.

    Over the last interval when ``previous`` is a snapshot of the same
    daemon epoch; otherwise the rates are ``-`` and the percentiles are
    since the daemon started.
    """
    now = traffic(d)
    comparable = (
        previous is not None
        and interval > 0
        and previous.get("daemon_epoch") == d.get("daemon_epoch")
    )
    before = traffic(previous) if comparable and previous is not None else {}
    bounds = [float(b) for b in d.get("latency_bucket_bounds") or BOUNDS]
    rows = []
    for key in sorted(now):
        n, b = now[key], before.get(key)
        if comparable:
            transfers = n.transfers - (b.transfers if b else 0)
            nbytes = n.bytes - (b.bytes if b else 0)
            put, get = _minus(n.put, b.put if b else []), _minus(n.get, b.get if b else [])
            rate = f"{transfers / interval:.1f}" if transfers >= 0 else "-"
            mbs = f"{nbytes / interval / 1e6:.1f}" if nbytes >= 0 else "-"
        else:
            put, get, rate, mbs = n.put, n.get, "-", "-"
        last = bounds[-1] if bounds else BOUNDS[-1]
        rows.append(
            [
                f"{key[0]} -> {key[1]}",
                key[2],
                rate,
                mbs,
                *(
                    format_latency(quantile(buckets, q, bounds), last=last)
                    for buckets in (put, get)
                    for q in (0.5, 0.99)
                ),
            ]
        )
    return rows


def _minus(now: list[int], before: list[int]) -> list[int]:
    if len(before) != len(now):
        return now
    return [max(a - b, 0) for a, b in zip(now, before, strict=True)]


def transport_name(value: Any) -> str:
    """``5``, ``"TRANSPORT_SHM"`` or ``"shm"`` -> ``"shm"`` (:meth:`Transport.parse`).

    A view shows what a newer daemon sends instead of failing on it: a number
    it does not know is ``"unspecified"``, a name is shown as it came.
    """
    try:
        return Transport.parse(value).value
    except ValueError:
        return "unspecified" if isinstance(value, int) or not value else str(value).lower()


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0
