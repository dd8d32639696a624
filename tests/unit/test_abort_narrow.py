"""An abort by a session of another uid than the request's writers is narrowed to
its own stages: it frees, stops and tells only what they write or read (see
relayd.pools.reclaim). The real LeaseManager, with sessions of three uids."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest
from relayd_client import InvalidArgumentError
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.pools.arena import Arena
from relayd.pools.leases import LeaseManager
from relayd.pools.reclaim import Aborter
from relayd.pools.records import Grant, LeaseState
from relayd.pools.sessions import Session
from relayd.rpc.frames import frame_sink
from tests.unit._pools import SLOT, unit_arena

VICTIM, INTRUDER, ROOT = 1000, 2000, 0


@pytest.fixture
def arena() -> Iterator[Arena]:
    with unit_arena(32) as a:
        yield a


class _Node:
    def __init__(self, arena: Arena) -> None:
        self.m = LeaseManager(
            arena, grant_bytes=8 * SLOT, lease_ttl=10.0, stage_quota_bytes=24 * SLOT,
            max_sessions=8,
        )  # fmt: skip
        self.told: dict[str, list[str]] = {}
        self.grants: dict[str, tuple[Grant, int, int]] = {}  # grant, id base, leases cut

    def session(self, stage: str, uid: int) -> Session:
        told = self.told.setdefault(stage, [])

        def sink(f: pb.SessionFrame) -> None:
            told.extend(a.request_id for a in f.aborted)

        s = self.m.open_session(pid=1, stages=[stage])
        return self.m.bind(s.id, s.token, frame_sink(sink), pid=1, uid=uid, gid=uid)

    def reserve(self, w: Session, to_stage: str, rid: str = "r") -> int:
        """A lease of ``w``'s next slot (a test writes fewer than a grant holds)."""
        if w.id not in self.grants:
            grant = asyncio.run(self.m.grant(w, SLOT, 1.0))
            self.grants[w.id] = (grant, self.m.new_generation_base(grant), 0)
        grant, base, used = self.grants[w.id]
        self.grants[w.id] = (grant, base, used + 1)
        lid, slot = base + 1 + used, grant.run.slot + used
        self.m.on_reserve(w, pb.Reserve(
            lease_id=lid, grant_id=grant.id, slot=slot, nslots=1, generation=lid,
            request_id=rid, to_stage=to_stage, from_stage=w.stages[0],
        ))  # fmt: skip
        return lid

    def publish(self, w: Session, lid: int) -> None:
        self.m.on_publish(w, pb.Publish(lease_id=lid, nbytes=SLOT, transport=pb.TRANSPORT_SHM))

    def put(self, w: Session, to_stage: str, rid: str = "r") -> int:
        lid = self.reserve(w, to_stage, rid)
        self.publish(w, lid)
        return lid


def test_another_uids_abort_frees_stops_and_tells_only_its_own_stages(
    arena: Arena, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="relayd.pools.reclaim")
    n = _Node(arena)
    thinker, talker = n.session("thinker", VICTIM), n.session("talker", VICTIM)
    vocoder = n.session("vocoder", INTRUDER)
    victims = n.put(thinker, "talker")
    late = n.reserve(thinker, "talker")  # published after the abort
    own = n.put(vocoder, "critic")

    assert n.m.abort(vocoder, "r") == (1, SLOT)
    assert own not in n.m.leases
    assert n.m.leases[victims].state is LeaseState.PUBLISHED
    n.publish(thinker, late)
    assert n.m.leases[late].state is LeaseState.PUBLISHED, "a narrowed abort stopped it"
    assert n.told == {"thinker": [], "talker": [], "vocoder": ["r"]}
    (logged,) = [r for r in caplog.records if r.getMessage().startswith("abort narrowed")]
    assert (logged.request_id, logged.uid, logged.stages) == ("r", INTRUDER, "vocoder")
    assert sorted(logged.writer_uids.split(",")) == sorted([str(VICTIM), str(INTRUDER)])
    # The victim's own abort: the intruder wrote into the request too, so it is
    # narrowed in turn, to the victim's stage, which is every lease left.
    assert n.m.abort(talker, "r") == (2, 2 * SLOT)
    assert not n.m.leases
    assert n.told["talker"] == ["r"] and n.told["thinker"] == []


def test_a_request_of_one_uid_and_roots_abort_stay_whole(arena: Arena) -> None:
    n = _Node(arena)
    thinker, talker = n.session("thinker", VICTIM), n.session("talker", VICTIM)
    vocoder = n.session("vocoder", VICTIM)  # the same uid: one pipeline
    n.put(thinker, "talker")
    n.put(vocoder, "critic")
    assert n.m.abort(talker, "r") == (2, 2 * SLOT)
    assert sorted(s for s, rids in n.told.items() if rids) == ["talker", "thinker", "vocoder"]

    other = n.session("critic", INTRUDER)
    n.put(thinker, "critic", "q")
    n.put(other, "talker", "q")
    root = n.session("talker", ROOT)
    assert n.m.abort(root, "q") == (2, 2 * SLOT)


def test_a_peers_narrowed_abort_frees_only_what_its_stages_write_or_read(arena: Arena) -> None:
    n = _Node(arena)
    thinker, vocoder = n.session("thinker", VICTIM), n.session("vocoder", VICTIM)
    victims = n.put(thinker, "talker")
    n.put(vocoder, "critic")
    with pytest.raises(InvalidArgumentError):
        n.m.abort_from_peer("r", (), narrow=True)
    assert n.m.abort_from_peer("r", ("vocoder",), narrow=True) == (1, ("vocoder",))
    assert list(n.m.leases) == [victims]
    assert n.m.abort_from_peer("r", ("thinker",)) == (1, None)  # not narrowed: whole


def test_a_peers_whole_abort_is_narrowed_here_by_this_nodes_writers_uids(arena: Arena) -> None:
    """The aborter's node knew only the aborter's own lease of the request, so it sent
    a whole abort; here the victim wrote the request, as another uid."""
    n = _Node(arena)
    thinker = n.session("thinker", VICTIM)
    victims = n.put(thinker, "talker")
    late = n.reserve(thinker, "talker")
    intruder = Aborter(INTRUDER, ("vocoder",))
    with pytest.raises(InvalidArgumentError):
        n.m.abort_from_peer("r", by=Aborter(INTRUDER, ()))
    assert n.m.abort_from_peer("r", by=intruder) == (0, ("vocoder",))
    n.publish(thinker, late)
    assert {n.m.leases[lid].state for lid in (victims, late)} == {LeaseState.PUBLISHED}
    assert n.told["thinker"] == []
    # The victim's uid, or root, on the aborting node: whole here too.
    assert n.m.abort_from_peer("r", by=Aborter(VICTIM, ("talker",))) == (2, None)
    n.put(thinker, "talker", "q")
    assert n.m.abort_from_peer("q", by=Aborter(ROOT, ("vocoder",))) == (1, None)
    assert not n.m.leases


def test_copies_the_daemon_made_for_a_reader_count_as_its_readers_uid(arena: Arena) -> None:
    """A pulled or landed copy of another node's put is read for a session here: it is
    that session's uid's, or an intruder that wrote the request here would be its
    only writer of record and abort the victim's copies whole."""
    n = _Node(arena)
    talker = n.session("talker", VICTIM)
    run = arena.allocate(1)
    assert run is not None
    landed = n.m.crossnode.adopt_push(
        run, SLOT, request_id="r", from_stage="thinker", to_stage="talker",
        returns=lambda lease: None, uids=(talker.uid,),
    )  # fmt: skip
    pulled = asyncio.run(
        n.m.crossnode.reserve_for_pull(
            talker, SLOT, 1.0, request_id="r", from_stage="thinker", to_stage="talker"
        )
    )
    n.m.crossnode.publish_pull(pulled, SLOT)
    vocoder = n.session("vocoder", INTRUDER)
    own = n.put(vocoder, "critic")
    assert n.m.abort(vocoder, "r") == (1, SLOT)
    assert own not in n.m.leases
    assert {n.m.leases[lease.id].state for lease in (landed, pulled)} == {LeaseState.PUBLISHED}
    assert n.told["talker"] == []
    # A peer's whole abort by the intruder is narrowed here too.
    assert n.m.abort_from_peer("r", by=Aborter(INTRUDER, ("vocoder",))) == (0, ("vocoder",))
    # The victim's own, from its node: the intruder wrote into the request here
    # too, so it is narrowed in turn, to the victim's writer, whose copies they are.
    assert n.m.abort_from_peer("r", by=Aborter(VICTIM, ("thinker",))) == (2, ("thinker",))
    assert not n.m.leases


def test_a_peers_abort_of_copies_read_for_its_uid_stays_whole(arena: Arena) -> None:
    n = _Node(arena)
    talker = n.session("talker", VICTIM)
    pulled = asyncio.run(
        n.m.crossnode.reserve_for_pull(
            talker, SLOT, 1.0, request_id="r", from_stage="thinker", to_stage="talker"
        )
    )
    n.m.crossnode.publish_pull(pulled, SLOT)
    assert n.m.abort_from_peer("r", by=Aborter(VICTIM, ("thinker",))) == (1, None)
    assert n.told["talker"] == ["r"]
