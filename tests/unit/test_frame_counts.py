"""Transfers published by a session's frames are counted once per frame, per edge.

What a scrape or a Status reply reads must not change: the same totals, per
transport and per edge, as counting each transfer when it is published.
"""

from __future__ import annotations

import asyncio

from prometheus_client import generate_latest
from relayd_client.wire.framing import encode_frame
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.counts import TransferCounts
from relayd.edges import EdgeStats
from relayd.metrics import Metrics
from relayd.pools.arena import Arena
from relayd.pools.leases import LeaseManager
from relayd.pools.records import Hooks
from relayd.pools.sessions import Session
from relayd.rpc.admission import Admission
from relayd.rpc.frames import frame_sink
from relayd.rpc.session import SessionHooks, SessionProtocol
from tests.unit.test_leases import SLOT, Clock, arena

__all__ = ["arena"]  # the fixture, shared with test_leases

Call = tuple[str, int, int, str, str]


class _Socket:
    """The daemon's side of a session socket: nothing it writes matters here."""

    def __init__(self) -> None:
        self.closed = False

    def write(self, data: bytes) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0  # all of it sent

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def _manager(arena: Arena, transfer: object) -> LeaseManager:
    return LeaseManager(
        arena, grant_bytes=8 * SLOT, lease_ttl=10.0, stage_quota_bytes=24 * SLOT,
        max_sessions=8, clock=Clock(), hooks=Hooks(transfer=transfer),  # type: ignore[arg-type]
    )  # fmt: skip


def _session(m: LeaseManager, stages: list[str]) -> Session:
    s = m.open_session(pid=1, stages=stages)
    return m.bind(s.id, s.token, frame_sink(lambda f: None), pid=1, uid=0, gid=0)


def _frame(m: LeaseManager, w: Session, edges: list[tuple[str, str]]) -> bytes:
    """One writer frame, on a new grant: a lease reserved and published per edge, in order."""
    grant = asyncio.run(m.grant(w, SLOT, 1.0))
    f = pb.SessionFrame()
    for k, (src, dst) in enumerate(edges):
        lid = max(m.new_generation_base(grant), grant.last_lease) + 1 + k
        f.reserve.add(lease_id=lid, grant_id=grant.id, slot=grant.run.slot + k, nslots=1,
                      generation=lid, request_id=f"r{k}", to_stage=dst, from_stage=src)  # fmt: skip
        f.publish.add(lease_id=lid, nbytes=1000 + k, transport=pb.TRANSPORT_SHM)
    return encode_frame(f)


def _protocol(m: LeaseManager, s: Session) -> SessionProtocol:
    p = SessionProtocol(m, Admission([0], [], daemon_uid=0), SessionHooks())
    p.session, p.transport = s, _Socket()  # type: ignore[assignment]
    return p


EDGES = [("a", "b"), ("a", "b"), ("a", "c"), ("a", "b"), ("a", "c")]


def test_a_frames_transfers_are_counted_once_per_edge(arena: Arena) -> None:
    calls: list[Call] = []
    m = _manager(arena, lambda *c: calls.append(c))
    w = _session(m, ["a"])
    p = _protocol(m, w)
    p.data_received(_frame(m, w, EDGES))
    assert calls == [("shm", 3, 1000 + 1001 + 1003, "a", "b"), ("shm", 2, 1002 + 1004, "a", "c")]
    # Outside a frame (an orphan adopted, the socket fallback) each counts at once.
    calls.clear()
    grant = next(iter(w.grants.values()))
    lid = grant.last_lease + 1
    m.on_reserve(w, pb.Reserve(lease_id=lid, grant_id=grant.id, slot=grant.run.slot + 7,
                               nslots=1, generation=lid, request_id="x", to_stage="b",
                               from_stage="a"))  # fmt: skip
    m.on_publish(w, pb.Publish(lease_id=lid, nbytes=5, transport=pb.TRANSPORT_SHM))
    assert calls == [("shm", 1, 5, "a", "b")]


def test_a_frame_refused_halfway_counts_what_it_published(arena: Arena) -> None:
    calls: list[Call] = []
    m = _manager(arena, lambda *c: calls.append(c))
    w = _session(m, ["a"])
    p = _protocol(m, w)
    good = pb.SessionFrame.FromString(_frame(m, w, EDGES[:2])[4:])
    bad = pb.SessionFrame(publish=[pb.Publish(lease_id=1, nbytes=1)],
                          reserve=[pb.Reserve(lease_id=1, grant_id=999, nslots=1)])  # fmt: skip
    p.data_received(encode_frame(good) + encode_frame(bad))
    assert p.transport is None  # the second frame closed the session
    assert calls == [("shm", 2, 2001, "a", "b")]


def _scrape(metrics: Metrics) -> list[str]:
    """The scrape, less the counters' creation times (two registries, two times)."""
    text = generate_latest(metrics.registry).decode()
    return [line for line in text.splitlines() if "_created" not in line]


def test_a_scrape_and_status_read_what_counting_each_transfer_gives(arena: Arena) -> None:
    def counts() -> tuple[TransferCounts, Metrics, EdgeStats]:
        metrics, edges = Metrics(), EdgeStats(max_edges=2)  # a third edge reads "other"
        edges.attached(["a", "b", "c", "d"])
        return TransferCounts(metrics, edges), metrics, edges

    batched, each = counts(), counts()
    m = _manager(arena, batched[0].count)
    w = _session(m, ["a"])
    p = _protocol(m, w)
    frames = [EDGES, [("a", "d"), ("a", "b")], [("a", "c")]]
    for edges in frames:
        p.data_received(_frame(m, w, edges))
        for i, (src, dst) in enumerate(edges):
            each[0].count("shm", 1, 1000 + i, src, dst)
    assert batched[0].by_transport == each[0].by_transport
    assert _scrape(batched[1]) == _scrape(each[1])
    assert batched[2].status() == each[2].status()
