"""The Status reply and the metrics' snapshot, built from the daemon's own parts on a
real (small) arena: the lease table, the tallies of relayd.counts, the registry."""

from __future__ import annotations

import asyncio
import time

from relayd_client.wire.proto import relay_pb2 as pb

from relayd.counts import ReclaimCounts, TransferCounts
from relayd.edges import EdgeStats
from relayd.metrics import Metrics
from relayd.pools.arena import Arena
from relayd.pools.leases import Hooks, LeaseManager
from relayd.routing.topology import Topology
from relayd.rpc.admission import Roles
from relayd.status import DaemonState, NodeStatus
from tests.unit import test_leases
from tests.unit.test_leases import SLOT, _publish, _session

arena = test_leases.arena  # the same small arena as the lease table's tests


class Node:
    """A daemon's status parts, wired as the server wires them, without its sockets."""

    def __init__(self, arena: Arena) -> None:
        self.metrics = Metrics()
        edges = EdgeStats(64)
        self.transfers = TransferCounts(self.metrics, edges)
        self.reclaims = ReclaimCounts(self.metrics)
        self.leases = LeaseManager(
            arena, grant_bytes=8 * SLOT, lease_ttl=10.0, stage_quota_bytes=24 * SLOT,
            max_sessions=8, freed_linger=0.0,
            hooks=Hooks(reclaimed=self.reclaims, transfer=self.transfers.count),
        )  # fmt: skip
        self.roles = Roles()
        self.state = DaemonState.SERVING
        self.status = NodeStatus(
            node_id="unit",
            epoch="e1",
            started=time.monotonic(),
            state=lambda: self.state,
            leases=self.leases,
            arena=arena,
            gpu_pools=[],
            topology=Topology("unit", arena, self.leases),
            edges=edges,
            transfers=self.transfers,
            reclaims=self.reclaims,
            roles=self.roles,
        )
        self.metrics.attach_state(self.status.snapshot)

    def sample(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels)


def test_status_is_built_from_the_lease_table_and_the_tallies(arena: Arena) -> None:
    node = Node(arena)
    m = node.leases
    w, r = _session(m, "thinker", []), _session(m, "talker", [])
    cli = _session(m, "relayd-cli", [])
    node.roles.operators.add(cli.id)
    grant = asyncio.run(m.grant(w, SLOT, 1.0))
    kept = _publish(m, w, grant, 0, 2, rid="a")
    _publish(m, w, grant, 2, 1, rid="b")
    assert m.abort(w, "b") == (1, SLOT)
    report = pb.TransferReport(
        transport=pb.TRANSPORT_INLINE, count=3, bytes=300, from_stage="thinker", to_stage="talker"
    )
    node.transfers.report(w, report)
    node.transfers.report(r, report)  # not a stage of the reader's: dropped

    st = node.status.status()

    assert st.state == pb.DAEMON_STATE_SERVING
    assert (st.node_id, st.daemon_epoch) == ("unit", "e1")
    assert dict(st.transfers_by_transport) == {"shm": 2, "inline": 3}
    assert dict(st.reclaimed_by_reason) == {"abort": 1}
    assert dict(st.leases_by_state) == {"reserved": 0, "published": 1, "claimed": 0}
    assert [lease.lease_id for lease in st.leases] == [kept]
    assert st.leases[0].state == pb.LEASE_STATE_PUBLISHED
    assert {s.session_id for s in st.sessions} == {w.id, r.id}  # the operator is left out
    assert st.pools[0].name == "shm" and st.pools[0].used_bytes == 2 * SLOT
    # A scrape reads the same tallies (transfers) or counters of their own (reclaims).
    assert node.sample("relayd_transfers_total", transport="shm") == 2
    assert node.sample("relayd_transfers_total", transport="inline") == 3
    assert node.sample("relayd_transfers_total", transport="mooncake") == 0  # listed at zero
    assert node.sample("relayd_transfer_bytes_total", transport="inline") == 300
    assert node.sample("relayd_inline_tensor_bytes_total") == 300
    assert node.sample("relayd_leases_reclaimed_total", reason="abort") == 1
    assert node.sample("relayd_leases_reclaimed_total", reason="ttl") == 0


def test_the_snapshot_and_the_state_follow_the_lifecycle(arena: Arena) -> None:
    node = Node(arena)
    cli = _session(node.leases, "relayd-cli", [])
    node.roles.operators.add(cli.id)
    _session(node.leases, "thinker", [])
    snap = node.status.snapshot()
    assert (snap["serving"], snap["sessions"]) == (1, 1)
    assert snap["leases"] == {
        ("shm", "reserved"): 0,
        ("shm", "published"): 0,
        ("shm", "claimed"): 0,
    }
    node.state = DaemonState.DRAINING
    assert node.status.snapshot()["serving"] == 0
    assert node.status.status().state == pb.DAEMON_STATE_DRAINING
    assert [s.value for s in DaemonState] == [
        pb.DAEMON_STATE_STARTING,
        pb.DAEMON_STATE_SERVING,
        pb.DAEMON_STATE_DRAINING,
        pb.DAEMON_STATE_STOPPED,
    ]
