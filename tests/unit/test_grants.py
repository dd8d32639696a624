"""The writer's local allocator (leases cut from held grants), without a daemon."""

from __future__ import annotations

import itertools
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from relayd_client._grants import BEHIND_NEWEST_MAX, LIFO_DEPTH, Grant, Grants, LeaseTable
from relayd_client.wire.shm import LEASE_SEQ_BITS, MAX_LEASE_SEQ


def _table(*sizes: int) -> LeaseTable:
    t = LeaseTable()
    base = 0
    for i, n in enumerate(sizes):
        t.add(Grant(i + 1, 0, base, n, (i + 1) << 32, "shm"))
        base += n
    return t


def test_the_run_freed_last_is_reused_first() -> None:
    t = _table(32)
    leases = [t.cut(2) for _ in range(8)]
    assert all(le is not None for le in leases)
    a, b = leases[2], leases[5]
    assert a is not None and b is not None
    t.free(a.id)
    t.free(b.id)
    again = t.cut(2)
    assert again is not None and again.slot == b.slot  # newest first, not lowest first
    again2 = t.cut(2)
    assert again2 is not None and again2.slot == a.slot


def test_steady_state_stop_and_wait_stays_on_one_run() -> None:
    # put, the reader releases, the daemon's Freed arrives, put again: the
    # same slots every time, not a walk through the whole grant.
    t = _table(64)
    slots = set()
    for _ in range(100):
        le = t.cut(4)
        assert le is not None
        slots.add(le.slot)
        t.free(le.id)
    assert len(slots) == 1


def test_not_newest_leaves_the_run_freed_last_for_a_later_cut() -> None:
    t = _table(32)
    a, b, c = t.cut(2), t.cut(2), t.cut(2)
    assert a is not None and b is not None and c is not None
    t.free(a.id)
    t.free(b.id)
    again = t.cut(2, newest=False)
    assert again is not None and again.slot == a.slot  # b, freed last, stays aside
    fresh = t.cut(2, newest=False)
    assert fresh is not None and fresh.slot == 6  # b is the only one: first fit
    assert [local for _, local, _ in t.recent] == [b.local]
    assert t.cut(2) is not None and not t.recent  # the newest, when asked for


def test_not_newest_falls_back_to_the_run_kept_aside_when_nothing_else_fits() -> None:
    t = _table(6)
    le, other = t.cut(4), t.cut(2)
    assert le is not None and other is not None
    t.free(other.id)
    t.free(le.id)
    again = t.cut(4, newest=False)  # the only run there is: taken back after all
    assert again is not None and again.slot == le.slot
    # ...without giving back the runs of other sizes kept aside
    assert [(local, count) for _, local, count in t.recent] == [(other.local, 2)]


def test_stop_and_wait_not_newest_alternates_two_runs() -> None:
    t = _table(64)
    slots = []
    for _ in range(100):
        le = t.cut(4, newest=False)
        assert le is not None
        slots.append(le.slot)
        t.free(le.id)
    assert len(set(slots)) == 2
    assert all(x != y for x, y in itertools.pairwise(slots))


def _grants(slot_size: int, nslots: int, pool: str = "shm") -> Grants:
    g = Grants(LeaseTable(), None, lambda: None)  # type: ignore[arg-type]  # cut() asks nobody
    g.configure(slot_size, slot_size * nslots)
    g.table.add(Grant(1, 0, 0, nslots, 1 << 32, pool))
    return g


@pytest.mark.parametrize(
    ("nbytes", "pool", "runs"),
    [
        (256 << 10, "shm", 2),
        (BEHIND_NEWEST_MAX, "shm", 2),
        (BEHIND_NEWEST_MAX + 1, "shm", 1),
        (4 << 20, "shm", 1),
        (256 << 10, "gpu0", 1),  # a GPU pool's runs are no host memory
    ],
)
def test_a_writer_in_steady_state_copies_into_two_runs_up_to_the_bound(
    nbytes: int, pool: str, runs: int
) -> None:
    g = _grants(64 << 10, 512, pool)
    slots = set()
    for _ in range(20):
        le = g.cut(nbytes, pool)
        assert le is not None
        slots.add(le.slot)
        g.table.free(le.id)
    assert len(slots) == runs


def test_the_run_freed_last_is_reused_first_across_grants() -> None:
    t = _table(8, 8)
    leases = [t.cut(1) for _ in range(16)]
    assert all(le is not None for le in leases)
    older, newer = leases[3], leases[10]
    assert older is not None and newer is not None and older.grant is not newer.grant
    t.free(older.id)
    t.free(newer.id)
    again = t.cut(1)
    assert again is not None and again.slot == newer.slot  # the newest, in whichever grant


def test_a_recent_run_of_another_size_is_not_split() -> None:
    t = _table(16)
    big = t.cut(8)
    assert big is not None
    t.free(big.id)
    small = t.cut(2)
    assert small is not None and small.slot == 8  # first fit; LIFO only for the same size
    again = t.cut(8)
    assert again is not None and again.slot == 0  # still whole, for a put of its size


def test_runs_kept_aside_go_back_to_their_grant_when_nothing_else_fits() -> None:
    t = _table(16)
    halves = [t.cut(8), t.cut(8)]
    for le in halves:
        assert le is not None
        t.free(le.id)
    whole = t.cut(16)  # both halves were kept aside for 8-slot puts
    assert whole is not None and whole.slot == 0 and not t.recent
    t.free(whole.id)
    assert t.cut(17) is None
    assert t.grants[1].alloc.free_runs() == [(0, 16)]  # none lost, all coalesced


def test_beyond_the_lifo_depth_the_oldest_run_goes_back_to_its_grant() -> None:
    t = _table(LIFO_DEPTH + 8)
    leases = [t.cut(1) for _ in range(LIFO_DEPTH + 8)]
    for le in leases:
        assert le is not None
        t.free(le.id)
    g = t.grants[1]
    assert len(t.recent) == LIFO_DEPTH
    assert g.alloc.free_slots == 8 and g.live == 0
    assert leases[-1] is not None and t.recent[-1][1] == leases[-1].local


def test_a_grant_given_back_takes_its_runs_kept_aside_with_it() -> None:
    t = _table(8, 8)
    leases = [t.cut(4) for _ in range(4)]
    for le in leases:
        assert le is not None
        t.free(le.id)
    assert t.drop(1) is not None
    assert all(g.id == 2 for g, _, _ in t.recent)
    again = [t.cut(4), t.cut(4)]
    assert all(le is not None and le.grant.id == 2 for le in again)
    assert t.cut(4) is None


def test_ids_are_unique_and_carry_the_grant_base() -> None:
    t = _table(4, 4)
    ids = []
    for _ in range(8):
        le = t.cut(1)
        assert le is not None
        ids.append(le.id)
        assert le.id >> 32 == le.grant.id
    assert len(set(ids)) == 8
    assert t.cut(1) is None


def test_a_grant_numbers_its_last_lease_id_then_cuts_no_more() -> None:
    t = _table(4, 4)
    first = t.grants[1]
    first.next_seq = MAX_LEASE_SEQ
    last = t.cut(1)
    assert last is not None and last.id == (1 << LEASE_SEQ_BITS) | MAX_LEASE_SEQ
    assert first.spent and not t.grants[2].spent
    # Not the next number, which is grant 2's first id: the other grant's run.
    after = t.cut(1)
    assert after is not None and after.grant.id == 2 and after.id >> LEASE_SEQ_BITS == 2
    t.free(last.id)
    again = t.cut(1)  # its slot is free again, but it has no id to number a lease with
    assert again is not None and again.grant.id == 2


def test_free_twice_is_a_no_op_and_other_pools_are_separate() -> None:
    t = _table(4)
    t.add(Grant(9, 0, 0, 4, 9 << 32, "gpu0"))
    le = t.cut(4)
    assert le is not None and le.grant.pool == "shm"
    assert t.free(le.id) is le
    assert t.free(le.id) is None
    gle = t.cut(4, "gpu0")
    assert gle is not None and gle.grant.id == 9
    with pytest.raises(ValueError):
        t.add(Grant(9, 0, 0, 4, 0, "gpu0"))


def test_cuts_from_many_threads_never_overlap() -> None:
    t = _table(256)
    taken: list[tuple[int, int]] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        for _ in range(300):
            le = t.cut(n)
            if le is None:
                continue
            with lock:
                taken.append((le.slot, le.nslots))
                for s, c in taken[:-1]:
                    assert s + c <= le.slot or le.slot + le.nslots <= s
            with lock:
                taken.remove((le.slot, le.nslots))
            t.free(le.id)

    threads = [threading.Thread(target=worker, args=(n,)) for n in (1, 2, 3, 5)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not t.leases
    t.unpark()
    g = next(iter(t))
    assert g.alloc.free_slots == 256 and g.alloc.free_runs() == [(0, 256)] and g.live == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(1, 9), st.integers(0, 1000), st.booleans()),
        max_size=120,
    )
)
def test_no_overlap_and_free_map_invariants(ops: list[tuple[bool, int, int, bool]]) -> None:
    nslots = 48
    t = _table(nslots)
    live: dict[int, tuple[int, int]] = {}
    for cut, n, pick, newest in ops:
        if cut or not live:
            le = t.cut(n, newest=newest)
            if le is None:
                assert not t.recent  # every run kept aside was tried
                free = t.grants[1].alloc.free_runs()
                assert all(length < n for _, length in free)
                continue
            run = (le.local, le.nslots)
            for s, c in [*live.values(), *((s, c) for _, s, c in t.recent)]:
                assert s + c <= run[0] or run[0] + run[1] <= s, "leases overlap"
            assert run[0] >= 0 and run[0] + run[1] <= nslots
            live[le.id] = run
        else:
            lease_id = sorted(live)[pick % len(live)]
            assert t.free(lease_id) is not None
            del live[lease_id]
        g = t.grants[1]
        assert g.live == len(live)
        used = sum(c for _, c in live.values())
        aside = sum(c for _, _, c in t.recent)
        assert g.alloc.free_slots + aside == nslots - used
        runs = g.alloc.free_runs()
        for (s1, l1), (s2, _) in itertools.pairwise(runs):
            assert s1 + l1 < s2, "free runs must be disjoint and coalesced"
        assert len(t.recent) <= LIFO_DEPTH
