"""Per-edge traffic: transfers, bytes and put/get latency by (from_stage, to_stage, transport).

Who feeds it, and when:

* :meth:`EdgeStats.count` - once per transfer the daemon sees (a publish, a
  socket put, a cross-node pull), and per batched ``TransferReport`` (checked
  by :meth:`EdgeStats.check_report`) for the transfers it never sees
  (inline, local_object, cuda_ipc_direct).
* :meth:`EdgeStats.add_latency` - per batched ``EdgeLatencyReport``: bucket
  counts a client observed around its own puts and gets (the bounds are
  :data:`relayd_client.wire.latency.BOUNDS`, shared with the client).
* :meth:`EdgeStats.attached` - when stages attach here or a peer announces
  its stages: only those names ever become label values.

Cardinality is bounded whatever clients send: an edge gets its own labels
only when both of its stages have attached and fewer than ``max_edges``
edges have their own labels already; everything else is counted under
``from_stage="other", to_stage="other"``. Transports are a fixed set. No id
is ever a label. :class:`EdgeCollector` reads it all at scrape time.

Reports are hostile input: a report that does not fit (an unknown transport,
bucket arrays of the wrong length, counts beyond any plausible batch, a
stage the session does not serve) is dropped whole.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Iterator
from typing import NamedTuple

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from relayd_client.wire.latency import BOUNDS, NBUCKETS, quantile
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.transport import Transport

log = logging.getLogger(__name__)

OTHER = "other"
DEFAULT_MAX_EDGES = 64
# Stage names remembered as "has attached"; past it new names read "other".
MAX_KNOWN_STAGES = 4096
# One report covers one client's 0.2 s linger: anything beyond these is not a
# real batch, and would poison the counters for good.
MAX_REPORT_COUNT = 1 << 32
MAX_REPORT_BYTES = 1 << 50
MAX_CALL_NS = 86_400 * 10**9  # no single put or get is timed at more than a day
# Transfers only a client sees; the daemon counts the rest itself, so a
# report of any other transport would count a transfer twice.
CLIENT_REPORTED = frozenset(
    t.to_proto() for t in (Transport.INLINE, Transport.LOCAL_OBJECT, Transport.CUDA_IPC_DIRECT)
)
_VALID_TRANSPORTS = frozenset(t.to_proto() for t in Transport)
LABELS = ("from_stage", "to_stage", "transport")


class EdgeKey(NamedTuple):
    from_stage: str
    to_stage: str
    transport: str


class Traffic:
    """Totals of one series since the daemon started."""

    __slots__ = ("bytes", "get", "get_ns", "put", "put_ns", "transfers")

    def __init__(self) -> None:
        self.transfers = 0
        self.bytes = 0
        self.put = [0] * NBUCKETS
        self.get = [0] * NBUCKETS
        self.put_ns = 0
        self.get_ns = 0

    def copy(self) -> Traffic:
        out = Traffic()
        out.transfers, out.bytes = self.transfers, self.bytes
        out.put, out.get = list(self.put), list(self.get)
        out.put_ns, out.get_ns = self.put_ns, self.get_ns
        return out


class EdgeStats:
    """The daemon's per-edge series; owned by the event loop, copied for scrapes."""

    def __init__(self, max_edges: int = DEFAULT_MAX_EDGES) -> None:
        self.max_edges = max_edges
        self._known: set[str] = set()
        self._labelled: set[tuple[str, str]] = set()
        self._series: dict[EdgeKey, Traffic] = {}

    def attached(self, stages: Iterable[str]) -> None:
        """These stages attached (here or at a peer): their names may become labels."""
        for stage in stages:
            if len(self._known) >= MAX_KNOWN_STAGES:
                return
            self._known.add(stage)

    def labels(self, from_stage: str, to_stage: str) -> tuple[str, str]:
        """The label values of an edge: its stage names, or ``other`` for both."""
        edge = (from_stage, to_stage)
        if edge in self._labelled:
            return edge
        if (
            from_stage in self._known
            and to_stage in self._known
            and len(self._labelled) < self.max_edges
        ):
            self._labelled.add(edge)
            return edge
        return OTHER, OTHER

    def _traffic(self, from_stage: str, to_stage: str, transport: str) -> Traffic:
        src, dst = self.labels(from_stage, to_stage)
        key = EdgeKey(src, dst, transport)
        t = self._series.get(key)
        if t is None:
            t = self._series[key] = Traffic()
        return t

    def count(self, from_stage: str, to_stage: str, transport: str, n: int, nbytes: int) -> None:
        t = self._traffic(from_stage, to_stage, transport)
        t.transfers += n
        t.bytes += nbytes

    def check_report(self, stages: Collection[str], rep: pb.TransferReport) -> bool:
        """Whether a client's count of transfers the daemon never saw is believable.

        Only transports the daemon cannot see are accepted (any other would
        count a transfer twice), from a stage the session serves, in amounts
        one batch can hold.
        """
        ok = (
            rep.transport in CLIENT_REPORTED
            and rep.from_stage in stages
            and 0 < rep.count < MAX_REPORT_COUNT
            and rep.bytes < MAX_REPORT_BYTES
        )
        if not ok:
            log.debug("dropped a transfer report that does not fit: %s", _brief(rep))
        return ok

    def add_latency(self, stages: Collection[str], rep: pb.EdgeLatencyReport) -> bool:
        """A client's latency counts for one edge; False: dropped as invalid.

        A session times its own end of an edge: its puts leave one of its
        stages, its gets arrive at one.
        """
        put, get = rep.put_buckets, rep.get_buckets
        if (
            rep.transport not in _VALID_TRANSPORTS
            or not (put or get)
            or (put and (rep.from_stage not in stages or not _plausible(put, rep.put_sum_ns)))
            or (get and (rep.to_stage not in stages or not _plausible(get, rep.get_sum_ns)))
        ):
            log.debug("dropped a latency report that does not fit: %s", _brief(rep))
            return False
        t = self._traffic(rep.from_stage, rep.to_stage, Transport.from_proto(rep.transport).value)
        if put:
            t.put = [a + b for a, b in zip(t.put, put, strict=True)]
            t.put_ns += rep.put_sum_ns
        if get:
            t.get = [a + b for a, b in zip(t.get, get, strict=True)]
            t.get_ns += rep.get_sum_ns
        return True

    def series(self) -> list[tuple[EdgeKey, Traffic]]:
        """A copy of every series, sorted; safe to call from the scrape thread.

        ``list(dict.items())`` and the per-series copies run without releasing
        the GIL, so a scrape never sees a list half-added.
        """
        return sorted((k, t.copy()) for k, t in list(self._series.items()))

    def status(self) -> list[pb.EdgeTraffic]:
        return [
            pb.EdgeTraffic(
                from_stage=k.from_stage,
                to_stage=k.to_stage,
                transport=Transport(k.transport).to_proto(),  # type: ignore[arg-type]
                transfers=t.transfers,
                bytes=t.bytes,
                put_buckets=t.put,
                get_buckets=t.get,
                put_p50_seconds=quantile(t.put, 0.5) or 0.0,
                put_p99_seconds=quantile(t.put, 0.99) or 0.0,
                get_p50_seconds=quantile(t.get, 0.5) or 0.0,
                get_p99_seconds=quantile(t.get, 0.99) or 0.0,
                put_sum_seconds=t.put_ns / 1e9,
                get_sum_seconds=t.get_ns / 1e9,
            )
            for k, t in self.series()
        ]


class EdgeCollector(Collector):
    """``relayd_edge_*`` counters and the put/get histograms, built at scrape time."""

    def __init__(self, stats: EdgeStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        series = self._stats.series()
        transfers = CounterMetricFamily(
            "relayd_edge_transfers", "Transfers by edge and transport", labels=LABELS
        )
        nbytes = CounterMetricFamily(
            "relayd_edge_bytes", "Tensor bytes moved by edge and transport", labels=LABELS
        )
        put = HistogramMetricFamily(
            "relayd_put_seconds",
            "Put latency seen by writers, from the call to the DataRef returned",
            labels=LABELS,
        )
        get = HistogramMetricFamily(
            "relayd_get_seconds",
            "Get latency seen by readers, from the call to the payload returned",
            labels=LABELS,
        )
        for key, t in series:
            labels = list(key)
            if t.transfers or t.bytes:
                transfers.add_metric(labels, t.transfers)
                nbytes.add_metric(labels, t.bytes)
            if any(t.put):
                put.add_metric(labels, _cumulative(t.put), t.put_ns / 1e9)
            if any(t.get):
                get.add_metric(labels, _cumulative(t.get), t.get_ns / 1e9)
        yield from (transfers, nbytes, put, get)

    def describe(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        yield CounterMetricFamily("relayd_edge_transfers", "", labels=LABELS)
        yield CounterMetricFamily("relayd_edge_bytes", "", labels=LABELS)
        yield HistogramMetricFamily("relayd_put_seconds", "", labels=LABELS)
        yield HistogramMetricFamily("relayd_get_seconds", "", labels=LABELS)


def _cumulative(buckets: list[int]) -> list[tuple[str, float]]:
    out, total = [], 0
    for bound, n in zip(BOUNDS, buckets, strict=False):
        total += n
        out.append((_LE[bound], float(total)))
    out.append(("+Inf", float(sum(buckets))))
    return out


# Prometheus' own spelling of a bound ("1e-05", "0.5", "10.0"), as Histogram writes it.
_LE = {b: repr(b) for b in BOUNDS}


def _plausible(buckets: Iterable[int], sum_ns: int) -> bool:
    counts = list(buckets)
    total = sum(counts)
    return (
        len(counts) == NBUCKETS
        and all(n < MAX_REPORT_COUNT for n in counts)
        and 0 < total < MAX_REPORT_COUNT
        and sum_ns <= total * MAX_CALL_NS
    )


MAX_TRACE_ID = 128


def log_trace(lease_id: int, trace_id: str, request_id: str = "") -> None:
    """Log the caller's trace id for a lease at debug level (exemplar-style lookup).

    The id comes from a client: anything but short printable ASCII is escaped.
    """
    if not log.isEnabledFor(logging.DEBUG):
        return
    text = trace_id[:MAX_TRACE_ID]
    if not (text.isascii() and text.isprintable()):
        text = ascii(text)[1:-1][:MAX_TRACE_ID]
    log.debug(
        "put traced", extra={"lease_id": lease_id, "trace_id": text, "request_id": request_id}
    )


def _brief(rep: pb.TransferReport | pb.EdgeLatencyReport) -> str:
    # Stage names from a client may hold anything: ascii() escapes it.
    text = ascii(str(rep).replace("\n", " "))
    return text[:300]
