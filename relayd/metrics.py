"""Prometheus metrics: counters on rare events, occupancy and transfers read at scrape time.

Everything lives in the daemon's own ``CollectorRegistry`` (never the global
one), so tests build a fresh registry per daemon and read it with
``get_sample_value``. Pool occupancy, lease counts, sessions and transfers
by transport are computed by :class:`StateCollector` when Prometheus
scrapes, not maintained on the hot path. Base units, no id labels (lease,
request and session ids would explode cardinality; they go in logs and
``relayd status``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from relayd_client.wire.transport import Transport

from .edges import EdgeCollector, EdgeStats
from .gc_pauses import GcPauses

_WAIT_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0)

# Push counters per peer (``PushManager.status`` keys), read at scrape time.
_PUSH_COUNTERS = (
    ("relayd_peer_pushes_out", "Pushes to the peer that landed there", "pushes_out"),
    (
        "relayd_peer_pushes_attached",
        "Pushes to the peer whose bytes rode their Landed notice",
        "pushes_attached",
    ),
    ("relayd_peer_pushes_declined", "Pushes to the peer declined: read by pull", "pushes_declined"),
    ("relayd_peer_pushes_in", "Pushes from the peer published here", "pushes_in"),
    (
        "relayd_peer_pushes_announced",
        "Pushes from the peer announced to the one session serving their stage",
        "pushes_announced",
    ),
)
# Reads here of the peer's DataRefs, by what they waited for on the network.
_READ_WAITS = (
    ("landed", "reads_landed"),
    ("awaited", "reads_awaited"),
    ("pulled", "reads_pulled"),
    ("attached", "reads_attached"),
    ("announced", "reads_announced"),
)


class StateCollector(Collector):
    """Reads the daemon's state through a snapshot callable at scrape time."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        cap = GaugeMetricFamily("relayd_pool_capacity_bytes", "Bytes in the pool", labels=["pool"])
        used = GaugeMetricFamily("relayd_pool_used_bytes", "Bytes held by leases", labels=["pool"])
        granted = GaugeMetricFamily(
            "relayd_pool_granted_bytes", "Bytes granted to writer sessions", labels=["pool"]
        )
        largest = GaugeMetricFamily(
            "relayd_pool_largest_free_run_bytes", "Largest contiguous free run", labels=["pool"]
        )
        for pool in snap["pools"]:
            cap.add_metric([pool["name"]], pool["capacity_bytes"])
            used.add_metric([pool["name"]], pool["used_bytes"])
            granted.add_metric([pool["name"]], pool["granted_bytes"])
            largest.add_metric([pool["name"]], pool["largest_free_run_bytes"])
        yield from (cap, used, granted, largest)
        leases = GaugeMetricFamily("relayd_leases", "Leases by state", labels=["pool", "state"])
        for (pool, state), n in sorted(snap["leases"].items()):
            leases.add_metric([pool, state], n)
        yield leases
        yield from _transfer_families(snap)
        yield GaugeMetricFamily(
            "relayd_sessions", "Attached client sessions", value=snap["sessions"]
        )
        yield GaugeMetricFamily(
            "relayd_up", "1 while serving, 0 while starting or draining", value=snap["serving"]
        )
        for name, help_, key in (
            (
                "relayd_freed_leases",
                "Freed leases told to their writers, by the way: their Freed ring or a frame",
                "freed",
            ),
            (
                "relayd_released_leases",
                "Releases readers sent, by the way: their Release ring or a frame",
                "released",
            ),
        ):
            by_way = CounterMetricFamily(name, help_, labels=["via"])
            for via, n in sorted(snap.get(key, {}).items()):
                by_way.add_metric([via], n)
            yield by_way
        for name, help_, key in (
            ("relayd_mooncake_credits_in_use", "Mooncake pulls in flight", "credits_in_use"),
            ("relayd_mooncake_credits_capacity", "Mooncake pull credits", "credits_capacity"),
            ("relayd_peer_up", "1 when the peer daemon answers heartbeats", "peer_up"),
            (
                "relayd_peer_notice_channel",
                "1 while notices to the peer go on its notice channel, 0 on Peer.Notify",
                "notice_channel",
            ),
            (
                "relayd_peer_notice_channel_queued_bytes",
                "Bytes queued on the peer's notice channel, not yet taken by the kernel; "
                "attached pushes among them hold their writers' arena runs",
                "notice_channel_queued",
            ),
        ):
            fam = GaugeMetricFamily(name, help_, labels=["peer"])
            for peer, value in sorted(snap.get(key, {}).items()):
                fam.add_metric([peer], value)
            yield fam
        yield from _push_families(snap.get("pushes", {}))


def _transfer_families(snap: dict[str, Any]) -> Iterator[Metric]:
    """Transfers and their bytes by transport (every transport, zero until used),
    and the bytes that rode inline: the daemon's tallies (:mod:`relayd.counts`)."""
    for name, help_, key in (
        ("relayd_transfers", "Transfers by transport", "transfers"),
        ("relayd_transfer_bytes", "Tensor bytes moved by transport", "transfer_bytes"),
    ):
        tally = snap.get(key, {})
        fam = CounterMetricFamily(name, help_, labels=["transport"])
        for t in Transport:
            fam.add_metric([t.value], tally.get(t.value, 0))
        yield fam
    yield CounterMetricFamily(
        "relayd_inline_tensor_bytes",
        "Tensor bytes that rode inline in DataRefs",
        value=snap.get("inline_tensor_bytes", 0),
    )


def _push_families(pushes: dict[str, dict[str, int]]) -> Iterator[Metric]:
    """Each peer's push counters, the attached pushes it has not received yet, and
    the reads here of its DataRefs by what they waited for."""
    peers = sorted(pushes.items())
    for name, help_, key in _PUSH_COUNTERS:
        counter = CounterMetricFamily(name, help_, labels=["peer"])
        for peer, counts in peers:
            counter.add_metric([peer], counts.get(key, 0))
        yield counter
    unreceived = GaugeMetricFamily(
        "relayd_peer_pushes_unreceived",
        "Pushes to the peer not received yet: their writers' leases stay",
        labels=["peer"],
    )
    reads = CounterMetricFamily(
        "relayd_peer_reads",
        "Reads here of the peer's DataRefs, by what they waited for",
        labels=["peer", "waited"],
    )
    for peer, counts in peers:
        unreceived.add_metric([peer], counts.get("pushes_unreceived", 0))
        for waited, key in _READ_WAITS:
            reads.add_metric([peer, waited], counts.get(key, 0))
    yield unreceived
    yield reads


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.reclaimed = Counter(
            "relayd_leases_reclaimed",
            "Leases freed by the daemon, not by their reader",
            ["reason"],
            registry=r,
        )
        self.reserve_wait = Histogram(
            "relayd_reserve_wait_seconds",
            "Time a grant waited for space",
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.refused = Counter(
            "relayd_connections_refused", "Session connections refused", ["reason"], registry=r
        )
        self.pull_seconds = Histogram(
            "relayd_mooncake_pull_seconds",
            "Cross-node pull latency",
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.socket_fallback = Counter(
            "relayd_socket_fallback_sessions", "Sessions that cannot map the arena", registry=r
        )
        self.refs = Counter("relayd_refs", "Forwarded tensor references published", registry=r)
        self.ref_bytes = Counter(
            "relayd_ref_bytes", "Tensor bytes published as forwarded references", registry=r
        )
        self.gc_pauses = GcPauses()
        r.register(self.gc_pauses)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def attach_state(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(StateCollector(snapshot))

    def attach_edges(self, stats: EdgeStats) -> None:
        """Per-edge counters and put/get histograms, read from ``stats`` at scrape time."""
        self.registry.register(EdgeCollector(stats))

    def watch_gc(self) -> None:
        """Time this process's garbage collections from now on (until :meth:`close`)."""
        self.gc_pauses.watch()

    def freeze_gc(self) -> int:
        """Keep what the process holds now out of every later collection (see :mod:`.gc_pauses`)."""
        return self.gc_pauses.freeze()

    def serve(self, address: str) -> int:
        """Start the HTTP endpoint (its own thread, off the event loop); returns the port."""
        host, _, port = address.rpartition(":")
        host = host.strip("[]") or "0.0.0.0"
        server, thread = start_http_server(int(port), addr=host, registry=self.registry)
        self._server, self._thread = server, thread
        return int(server.server_address[1])

    def close(self) -> None:
        self.gc_pauses.stop()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
