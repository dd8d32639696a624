"""What the daemon counts as it happens: transfers, forwarded refs, reclaimed leases.

Each count goes to its Prometheus counter and to a plain tally that this
module owns; ``relayd status`` reads the tally (see :mod:`relayd.status`), so
the reply never depends on reading metrics back. Per-edge series live in
:class:`relayd.edges.EdgeStats`, which the scrape-time collector reads.
"""

from __future__ import annotations

from collections import Counter as Tally

from prometheus_client import Counter
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.transport import Transport

from .edges import EdgeStats
from .metrics import Metrics
from .pools.records import ReclaimReason
from .pools.sessions import Session


class TransferCounts:
    """One place counts every transfer, node-wide and per edge, exactly once.

    The daemon sees arena, GPU-pool, socket and cross-node transfers when they
    are published (``count``); clients report the ones it never sees (inline,
    local_object, direct) in batches (``report``).
    """

    def __init__(self, metrics: Metrics, edges: EdgeStats) -> None:
        self._metrics = metrics
        self._edges = edges
        # labels() costs more than the rest of a publish: look each child up once.
        self._children: dict[str, tuple[Counter, Counter]] = {}
        self.by_transport: Tally[str] = Tally()
        """Transfers since start, by transport label."""

    def count(
        self, transport: str, count: int, nbytes: int, from_stage: str, to_stage: str
    ) -> None:
        self._edges.count(from_stage, to_stage, transport, count, nbytes)
        children = self._children.get(transport)
        if children is None:
            children = self._children[transport] = (
                self._metrics.transfers.labels(transport),
                self._metrics.transfer_bytes.labels(transport),
            )
        children[0].inc(count)
        children[1].inc(nbytes)
        self.by_transport[transport] += count
        if transport == Transport.INLINE.value:
            self._metrics.inline_tensor_bytes.inc(nbytes)

    def report(self, session: Session, rep: pb.TransferReport) -> None:
        """A client's batch of transfers the daemon never saw, once validated."""
        if self._edges.check_report(session.stages, rep):
            self.count(
                Transport.from_proto(rep.transport).value,
                rep.count,
                rep.bytes,
                rep.from_stage,
                rep.to_stage,
            )

    def latency(self, session: Session, rep: pb.EdgeLatencyReport) -> None:
        self._edges.add_latency(session.stages, rep)

    def ref(self, nbytes: int) -> None:
        """A forwarded tensor reference was published (``RelayClient.ref``)."""
        self._metrics.refs.inc()
        self._metrics.ref_bytes.inc(nbytes)


class ReclaimCounts:
    """Leases the daemon freed itself, not their reader, by reason."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self.by_reason: Tally[str] = Tally()
        for reason in ReclaimReason:
            metrics.reclaimed.labels(reason.value)  # every reason shows, at 0

    def __call__(self, reason: ReclaimReason, n: int) -> None:
        self._metrics.reclaimed.labels(reason.value).inc(n)
        self.by_reason[reason.value] += n


__all__ = ["ReclaimCounts", "TransferCounts"]
