"""Property: whatever frames sessions send, the lease table stays sound.

Several sessions drive one ``LeaseManager`` (a real arena, a fake clock) with
random notices, honest and hostile alike: reserves anywhere (others' grants,
overlapping, replayed ids), publishes, claims, releases, cancels, grant
returns, peers' releases, aborts, session closes, TTL sweeps, pushes that
hold a lease's slots while they read them, and the daemon's own cross-node
leases: pulls into runs it reserves for a reader (published or dropped), and
pushes that peers land in the push grant it gave them (which it may retire
while some are unread). A notice the manager refuses by raising closes that
session, as the session socket does. After every step:

* no slot is in two live leases, nor in two grants, nor in a live lease and a
  freed one a push still reads;
* every lease lies in its grant, and each grant's slot map is its leases;
* a pull's run stays reserved until the pull ends;
* the pool's free map is exactly the slots no grant holds (a push grant
  given to a peer holds its own);
* sessions' grant bookkeeping adds up;
* no run was freed twice (the pool refuses that, and logs it: a table bug);
* nothing but a session-closing refusal was raised (the manager is alive).

At the end every session closes and the TTL passes: the arena is empty.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from relayd_client import RelayError
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.slots import SlotAllocator

from relayd.pools.arena import Arena, Run
from relayd.pools.leases import LeaseManager
from relayd.pools.records import GEN_SHIFT, Lease, LeaseState
from relayd.pools.sessions import Session, SessionState

SLOT = 64 << 10
NSLOTS = 48
TTL = 5.0
STAGES = ("a", "b", "c")
GIVEN_SLOTS = 8  # the push grant given to a peer

# Deterministic and bounded: ~2,000 sequences of up to 40 steps in a few seconds.
LEASE_TABLE = settings(
    max_examples=2000,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,  # the suite's autouse fixtures; nothing kept
    ],
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def arena() -> Iterator[Arena]:
    a = Arena(node_id="prop", epoch=os.urandom(4).hex(), total_bytes=NSLOTS * SLOT,
              segment_bytes=1 << 30, slot_size=SLOT)  # fmt: skip
    yield a
    a.close()


class World:
    """One manager and the sessions driving it."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.clock = Clock()
        self.loop = asyncio.new_event_loop()
        self.m = LeaseManager(
            arena, grant_bytes=4 * SLOT, lease_ttl=TTL, stage_quota_bytes=NSLOTS * SLOT,
            max_sessions=16, clock=self.clock,
        )  # fmt: skip
        self.sessions: list[Session] = []
        self.closed_by_refusal = 0
        for stage in STAGES:
            self.open(stage)
        self.ids: list[int] = [1, 1 << GEN_SHIFT | 1]  # ids seen anywhere, to replay
        self.pushing: list[Lease] = []  # leases a push reads (relayd.push holds them)
        self.pulls: list[Lease] = []  # pulls in flight: runs the daemon reserved for them
        # The push grant given to a peer (relayd.push_landing): its run, which parts
        # hold landed leases, and whether it was retired (free parts gone back).
        self.given: Run | None = None
        self.given_used = SlotAllocator(GIVEN_SLOTS)
        self.retired = False
        self.double_frees: list[str] = []  # what the pool refused to free (logged)

    def landed_returned(self, lease: Lease) -> None:
        """A landed lease was freed: its run goes back to the grant, or to the
        arena once the grant is retired (as PushLanding._give_back does)."""
        assert self.given is not None
        run = lease.run
        if self.retired:
            self.arena.free(run)
        else:
            self.given_used.free(run.slot - self.given.slot, run.nslots)

    def retire(self) -> None:
        if self.given is not None and not self.retired:
            self.retired = True
            for start, n in self.given_used.free_runs():
                self.arena.free(
                    Run(self.given.segment, self.given.slot + start, n, self.given.pool)
                )

    def open(self, stage: str) -> Session:
        s = self.m.open_session(pid=1, stages=[stage])
        s = self.m.bind(s.id, s.token, lambda frame: None, pid=1, uid=0, gid=0)
        self.sessions.append(s)
        return s

    def live(self) -> list[Session]:
        return [s for s in self.sessions if s.state is SessionState.BOUND]

    def close(self, s: Session) -> None:
        self.m.close_session(s.id)
        self.sessions.remove(s)
        self.open(s.stages[0])

    def notice(self, s: Session, call: object, *args: object) -> None:
        """A notice from ``s``: a refusal closes ``s``, anything else is a bug."""
        try:
            call(s, *args)  # type: ignore[operator]
        except RelayError:
            self.closed_by_refusal += 1
            self.close(s)
        self.m.flush()

    # -- invariants -----------------------------------------------------------------

    def check(self) -> None:
        m = self.m
        held: dict[tuple[int, int], int] = {}  # (segment, slot) -> grant id
        for gid, grant in m.grants.items():
            assert grant.id == gid
            spans = (
                [(lease.run.slot, lease.run.nslots) for lease in grant.leases.values()]
                if grant.orphan
                else [(grant.run.slot, grant.run.nslots)]
            )
            for start, n in spans:
                for slot in range(start, start + n):
                    key = (grant.run.segment, slot)
                    assert key not in held, f"slot {key} in grants {held[key]} and {gid}"
                    held[key] = gid
            expect = bytearray(grant.run.nslots)
            pushed = m.table.held_in(grant)
            for lease in [*grant.leases.values(), *pushed]:
                assert lease in pushed or m.leases.get(lease.id) is lease
                first = lease.run.slot - grant.run.slot
                assert first >= 0 and first + lease.run.nslots <= grant.run.nslots
                for i in range(first, first + lease.run.nslots):
                    assert not expect[i], f"slot {lease.run.slot} in two leases of grant {gid}"
                    expect[i] = 1
            assert grant.busy == expect, f"grant {gid}'s slot map is not its leases"
        for lid, lease in m.leases.items():
            assert lease.id == lid and m.grants.get(lease.grant.id) is lease.grant
        for lid, lease in m.table.held.items():
            # Freed, its slots still read by a push: in its writer's grant while that
            # lives, else out of the pool on their own until the push ends.
            assert lid not in m.leases, f"lease {lid} freed under its push is live again"
            g = lease.grant
            if m.grants.get(g.id) is g and not g.orphan:
                continue
            for slot in range(lease.run.slot, lease.run.slot + lease.run.nslots):
                key = (lease.run.segment, slot)
                assert key not in held, f"slot {key} read by a push is in grant {held[key]}"
                held[key] = g.id
        for lease in self.pulls:
            # Mooncake may still be writing into a pull's run: nothing but the pull's
            # own end (published or dropped) may free it.
            assert m.leases.get(lease.id) is lease, f"pull lease {lease.id} freed under its pull"
            assert lease.state is LeaseState.RESERVED
        if self.given is not None and not self.retired:
            # The free part of the push grant given to a peer; its landed leases
            # are orphan grants of their own, counted above.
            for start, n in self.given_used.free_runs():
                for slot in range(self.given.slot + start, self.given.slot + start + n):
                    key = (self.given.segment, slot)
                    assert key not in held, (
                        f"slot {key} of the given push grant is in grant {held[key]}"
                    )
                    held[key] = -1
        free: set[tuple[int, int]] = set()
        for seg, alloc in enumerate(self.arena.allocators):
            for start, n in alloc.free_runs():
                free.update((seg, slot) for slot in range(start, start + n))
        assert not free & held.keys(), "a held slot is in the free map"
        assert len(free) + len(held) == self.arena.capacity_slots, "slots leaked"
        assert not self.double_frees, self.double_frees
        for s in self.live():
            assert s.granted_slots == sum(g.run.nslots for g in s.grants.values())
            for g in s.grants.values():
                assert m.grants.get(g.id) is g and not g.orphan

    def finish(self) -> None:
        for lease in list(self.pushing):
            self.m.unhold(lease)
        self.pushing.clear()
        for lease in self.pulls:
            self.m.crossnode.drop_pull(lease)
        self.pulls.clear()
        self.retire()
        for s in list(self.live()):
            self.m.close_session(s.id)
        self.clock.now += TTL + 1
        self.m.reap()
        self.check()
        assert not self.m.leases and not self.m.grants
        assert self.arena.free_slots == self.arena.capacity_slots
        self.loop.close()


# An op is a kind and a few small numbers; each picks its targets from the
# world as it is then (the sessions, grants and ids that exist), so shrinking
# keeps sequences meaningful.
_KINDS = [
    *("grant", "reserve", "reserve", "reserve", "publish", "publish", "claim", "release"),
    *("cancel", "return", "peer", "seal", "abort", "close", "ttl", "push", "pushed"),
    *("pull", "pulled", "give", "land", "land", "retire"),
]
OPS = st.tuples(
    st.sampled_from(_KINDS),
    st.integers(0, 63),
    st.integers(0, 63),
    st.integers(0, 7),
    st.integers(0, 7),
)


def _pick(items: list[object], i: int) -> object:
    return items[i % len(items)]


def step(w: World, op: tuple[str, int, int, int, int]) -> None:
    kind, a, b, c, d = op
    m = w.m
    s: Session = _pick(w.live(), a)  # type: ignore[assignment]
    grants = list(m.grants.values())
    if kind == "grant":
        try:
            w.loop.run_until_complete(m.grant(s, (1 + c) * SLOT, 0.0))
        except RelayError:
            pass  # full, or over a limit: refused, nothing changed
    elif kind == "reserve":
        # Mostly its own grants, sometimes another's; ids honest, replayed or off.
        own = list(s.grants.values())
        g = _pick(own, b) if own and d < 6 else (_pick(grants, b) if grants else None)
        if g is None:
            return
        base = g.id << GEN_SHIFT  # type: ignore[attr-defined]
        lid = (
            max(base, g.last_lease) + 1  # type: ignore[attr-defined]
            if d < 4
            else (_pick(w.ids, b) if d < 6 else base + 1 + c)
        )
        w.ids.append(lid)
        r = pb.Reserve(lease_id=lid, grant_id=g.id, slot=g.run.slot + c,  # type: ignore[attr-defined]
                       nslots=1 + d % 3, generation=lid, request_id=f"r{b % 4}",
                       to_stage=STAGES[b % 3], from_stage=s.stages[0] if d != 7 else "x")  # fmt: skip
        cancelled = {lid - 1} if c == 7 else set()
        w.notice(s, m.on_reserve, r, cancelled)
    elif kind == "publish":
        w.notice(s, m.on_publish, pb.Publish(lease_id=_pick(w.ids, b), nbytes=c * 1000,  # type: ignore[arg-type]
                                             transport=pb.TRANSPORT_SHM))  # fmt: skip
    elif kind in ("claim", "release"):
        lid = _pick(w.ids, b)
        gen = lid if d else lid + 1  # type: ignore[operator]
        if kind == "claim":
            w.notice(s, m.on_claim, pb.Claim(lease_id=lid, generation=gen))  # type: ignore[arg-type]
        else:
            w.notice(s, m.on_release, pb.Release(lease_id=lid, generation=gen))  # type: ignore[arg-type]
    elif kind == "cancel":
        w.notice(s, m.on_cancel, pb.Cancel(lease_id=_pick(w.ids, b)))  # type: ignore[arg-type]
    elif kind == "return":
        own = list(s.grants)
        gid = _pick(own, b) if own else b
        w.notice(s, m.return_grant, gid)
    elif kind == "peer":
        # A pull's release names its reader's stages, a discard its session's; the
        # daemon's own free names none.
        lid = _pick(w.ids, b)
        stages = [STAGES[d % 3]]
        try:
            if c % 3 == 0:
                m.release_from_peer(lid, lid, None)  # type: ignore[arg-type]
            elif c % 3 == 1:
                m.release_from_peer(lid, lid, stages)  # type: ignore[arg-type]
            else:
                m.crossnode.discard_now(lid, lid, stages)  # type: ignore[arg-type]
        except RelayError:
            pass  # not that reader's, or that stage's: refused, nothing changed
        m.flush()
    elif kind == "seal":
        # The writer's header for a lease (what a dead writer's grant is adopted by).
        lease = m.leases.get(_pick(w.ids, b))  # type: ignore[arg-type]
        if lease is not None and lease.run.pool == "shm":
            w.arena.segments[lease.run.segment].write_header(
                lease.run.slot, lease.generation, c * 1000
            )
    elif kind == "push":
        # What PushManager does when a lease is published for another node: hold its
        # slots while the push reads them (the writer sealed its header before that).
        published = [x for x in m.leases.values() if x.state is LeaseState.PUBLISHED]
        lease = _pick(published, b) if published else None  # type: ignore[assignment]
        if lease is not None and lease.run.pool == "shm" and lease not in w.pushing:
            w.arena.segments[lease.run.segment].write_header(
                lease.run.slot, lease.generation, lease.nbytes
            )
            m.hold(lease)
            w.pushing.append(lease)
    elif kind == "pushed":
        # The push ended: landed (the lease is freed, as its reader would) or failed
        # (kept for a pull); either way the slots of a lease freed meanwhile go back.
        if w.pushing:
            lease = w.pushing.pop(b % len(w.pushing))
            if c % 2:
                m.crossnode.free_pushed(lease)
            else:
                m.unhold(lease)
            m.flush()
    elif kind == "pull":
        # A reader's fetch of a peer's lease: the daemon reserves a run for the bytes.
        try:
            lease = w.loop.run_until_complete(
                m.crossnode.reserve_for_pull(
                    s, (1 + c % 3) * SLOT - 1000 * d, 0.0, request_id=f"r{b % 4}",
                    from_stage="peer", to_stage=STAGES[b % 3],
                )
            )  # fmt: skip
        except RelayError:
            return  # no room (a timeout of 0), or draining: nothing reserved
        w.pulls.append(lease)
        w.ids.append(lease.id)
    elif kind == "pulled":
        # The pull ended: verified and published for its reader, or failed and dropped
        # (a failed publish drops it too, as relayd.pull does).
        if w.pulls:
            lease = w.pulls.pop(b % len(w.pulls))
            try:
                if c % 2:
                    m.crossnode.publish_pull(lease, min(c * 1000, lease.run.nslots * SLOT))
                    return
            except RelayError:
                pass  # aborted meanwhile (freed) or reclaimed
            m.crossnode.drop_pull(lease)
            m.flush()
    elif kind == "give":
        if w.given is None:
            w.given = w.arena.allocate(GIVEN_SLOTS)
    elif kind == "land":
        # A peer's push landed in the grant it was given (PushLanding.on_landed
        # checked the run lies in it and overlaps no landed lease).
        given = w.given
        n = 1 + d % 3
        if given is None or w.retired or not w.given_used.allocate_at(c % GIVEN_SLOTS, n):
            return
        run = Run(given.segment, given.slot + c % GIVEN_SLOTS, n, given.pool)
        try:
            lease = m.crossnode.adopt_push(
                run, c * 1000 + 1, request_id=f"r{b % 4}", from_stage="peer",
                to_stage=STAGES[b % 3], returns=w.landed_returned, uids=(s.uid,),
            )  # fmt: skip
        except RelayError:
            w.given_used.free(c % GIVEN_SLOTS, n)  # draining: refused, given back
            return
        w.ids.append(lease.id)
    elif kind == "retire":
        w.retire()
    elif kind == "abort":
        try:
            m.abort(s, f"r{b % 4}")
        except RelayError:
            pass  # not the session's request: refused, nothing changed
    elif kind == "close":
        w.close(s)
    elif kind == "ttl":
        w.clock.now += TTL * (c + 1) / 4
        m.reap()


@LEASE_TABLE
@given(ops=st.lists(OPS, max_size=40))
# A lease freed under its push (TTL), then its writer gone: its header must not
# make the daemon adopt it again (it did, onto slots the push then gave back).
@example(ops=[("grant", 0, 0, 0, 0), ("reserve", 0, 0, 0, 0), ("publish", 0, 2, 1, 0),
              ("push", 0, 0, 0, 0), ("ttl", 0, 0, 7, 0), ("close", 0, 0, 0, 0),
              ("pushed", 0, 0, 0, 0)])  # fmt: skip
# A pull whose request was aborted mid-pull: its publish frees the lease, and
# the pull's clean-up must not free the run a second time.
@example(ops=[("pull", 0, 0, 0, 0), ("abort", 0, 0, 0, 0), ("pulled", 0, 0, 1, 0)])
def test_no_frame_sequence_corrupts_the_lease_table(arena: Arena, ops: list) -> None:  # type: ignore[type-arg]
    # A fresh pool each example, even after a failed one.
    arena.allocators[:] = [SlotAllocator(seg.nslots) for seg in arena.segments]
    for seg in arena.segments:
        for slot in range(seg.nslots):
            seg.write_header(slot, 0, 0)
    w = World(arena)
    refused = _Refused(w.double_frees)
    logging.getLogger("relayd.pools.returns").addHandler(refused)
    try:
        for op in ops:
            step(w, op)
            w.check()
        w.finish()
    except BaseException:
        w.loop.close()
        raise
    finally:
        logging.getLogger("relayd.pools.returns").removeHandler(refused)


class _Refused(logging.Handler):
    """Collects the pool's "refused to free" errors."""

    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.ERROR)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())
