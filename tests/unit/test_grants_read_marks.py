"""The writer takes a run back when its reader marks the lease read: no daemon.

A reader writes ``(0, read_mark(object id, lease id))`` into the slot header
before its Release: the random part its DataRef's object id ends with, which
only a holder of the DataRef can know.
The writer watches the headers of its latest lingering leases and, at its next
cut, puts a marked one's run aside as a freed one (the same reuse). The
daemon's Freed of it comes later and only confirms it: until then the grant is
not idle, so it is never given back while the daemon may still count the
lease. These run on a real segment in /dev/shm.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest
from relayd_client import _grants as _grants_module
from relayd_client._grants import WATCH_DEPTH, Grants, LeaseTable
from relayd_client.wire.shm import MappedSegment, read_mark

from tests.unit.test_grant_wait import SLOT, Closed, FakeSource, _grants

NSLOTS = 64


@pytest.fixture
def seg() -> Iterator[MappedSegment]:
    name = f"relayd-test-marks-{os.getpid()}-{os.urandom(4).hex()}"
    s = MappedSegment(name, NSLOTS * (SLOT + 64) + 8192, 0, SLOT, create=True)
    try:
        yield s
    finally:
        s.close()
        os.unlink(f"/dev/shm/{name}")


def _writer(source: FakeSource) -> Grants:
    g = _grants(source)
    g.add(source.grant(NSLOTS))
    return g


def _object_id(lease_id: int) -> str:
    """An object id as a writer makes it, its random part here made of the lease id."""
    return f"3f2a9c1b7d4e-{lease_id}-{lease_id * 0x9E3779B97F4A7C15 % (1 << 64):016x}"


def _mark(lease) -> int:  # type: ignore[no-untyped-def]
    """The read mark of ``lease``'s DataRef."""
    return read_mark(_object_id(lease.id), lease.id)


def _put(g: Grants, seg: MappedSegment, nslots: int = 4):  # type: ignore[no-untyped-def]
    """Cut, seal and watch a lease, as the writer does."""
    lease = g.cut(nslots * SLOT)
    assert lease is not None
    seg.write_header(lease.slot, lease.id, nslots * SLOT)
    g.table.watch(lease, seg, _mark(lease))
    return lease


def _stop_and_wait(g: Grants, seg: MappedSegment) -> list[int]:
    slots = []
    for _ in range(50):
        lease = _put(g, seg)
        slots.append(lease.slot)
        seg.mark_read(lease.slot, _mark(lease))  # the reader is done; no Freed comes yet
    return slots


def test_stop_and_wait_takes_turns_on_two_runs_its_reader_marked_read(seg: MappedSegment) -> None:
    slots = _stop_and_wait(_writer(FakeSource()), seg)
    assert set(slots) == {0, 4}  # never a third: each comes back on its reader's mark
    assert all(a != b for a, b in itertools.pairwise(slots))  # not the one just read


def test_stop_and_wait_above_the_bound_stays_on_the_run_its_reader_just_read(
    seg: MappedSegment, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_grants_module, "BEHIND_NEWEST_MAX", 0)  # as a 4 MiB lease
    assert set(_stop_and_wait(_writer(FakeSource()), seg)) == {0}


def test_without_the_mark_the_run_waits_for_the_daemons_freed(
    seg: MappedSegment, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_grants_module, "BEHIND_NEWEST_MAX", 0)  # the run freed last, reused
    g = _writer(FakeSource())
    first = _put(g, seg)
    second = _put(g, seg)
    assert second.slot != first.slot  # unread: still the reader's
    # A mark of another lease (an older one in the run) is no mark of this one.
    seg.mark_read(second.slot, _mark(first))
    assert _put(g, seg).slot not in (first.slot, second.slot)
    assert g.freed(first.id) is first  # the daemon's Freed, as before
    g.slots_back(first)
    assert _put(g, seg).slot == first.slot


@pytest.mark.parametrize(
    "forged",
    [
        pytest.param(lambda lease: lease.id, id="lease-id"),
        pytest.param(lambda lease: read_mark(_object_id(lease.id + 1), lease.id), id="another-put"),
        pytest.param(lambda lease: 1, id="a-guess"),
    ],
)
def test_a_mark_only_the_arena_could_tell_is_no_mark(seg: MappedSegment, forged) -> None:  # type: ignore[no-untyped-def]
    """A neighbour maps the arena, not the DataRef: what it can write in a
    header (the lease id it reads there, a guess) never gives the run back."""
    g = _writer(FakeSource())
    lease = _put(g, seg)
    seg.mark_read(lease.slot, forged(lease))
    assert g.table.reclaim_read() == 0
    assert lease.id in g.table.leases and len(g.table.watched) == 1  # still watched
    seg.mark_read(lease.slot, _mark(lease))  # its reader, later
    assert g.table.reclaim_read() == 1


def test_the_grant_is_not_idle_until_the_daemon_confirms(seg: MappedSegment) -> None:
    source = FakeSource()
    g = _writer(source)
    grant = next(iter(g.table))
    lease = _put(g, seg)
    seg.mark_read(lease.slot, _mark(lease))
    assert g.table.reclaim_read() == 1
    assert grant.live == 0 and not grant.idle and g.table.idle() == []
    g.return_idle()
    assert source.returned == []  # the daemon may still count the lease
    assert g.freed(lease.id) is None  # its Freed: a confirmation, no lease to free
    assert grant.idle and g.freed(lease.id) is None  # twice: nothing more
    g.return_idle()
    assert source.returned == [grant.id]


def test_a_spent_grant_goes_back_when_its_last_lease_is_confirmed(seg: MappedSegment) -> None:
    source = FakeSource()
    g = _writer(source)
    grant = next(iter(g.table))
    lease = _put(g, seg)
    grant.next_seq = 1 << 40  # it numbered its last lease id
    seg.mark_read(lease.slot, _mark(lease))
    assert g.table.reclaim_read() == 1 and source.returned == []
    g.freed(lease.id)
    assert source.returned == [grant.id]


def test_only_the_latest_leases_are_watched(seg: MappedSegment) -> None:
    g = _writer(FakeSource())
    leases = [_put(g, seg, 1) for _ in range(WATCH_DEPTH + 4)]
    assert len(g.table.watched) == WATCH_DEPTH
    for lease in leases:
        seg.mark_read(lease.slot, _mark(lease))
    assert g.table.reclaim_read() == WATCH_DEPTH  # the oldest four wait for their Freed
    assert all(lease.id in g.table.leases for lease in leases[:4])


def test_a_re_attach_forgets_what_it_watched(seg: MappedSegment) -> None:
    g = _writer(FakeSource())
    lease = _put(g, seg)
    seg.mark_read(lease.slot, _mark(lease))
    g.table.clear()
    assert not g.table.watched and g.table.reclaim_read() == 0


def test_a_writer_that_is_not_watching_pays_nothing() -> None:
    g = Grants(LeaseTable(), FakeSource(), Closed())
    assert g.table.reclaim_read() == 0 and not g.table.watched


class _Holder:
    """Where a lingering Publish counts its lease's bytes (the session channel)."""

    def __init__(self) -> None:
        self.taken: list[tuple[object, int]] = []

    def taken_back(self, frame: object, nbytes: int) -> None:
        self.taken.append((frame, nbytes))


def test_a_run_taken_back_on_its_mark_no_longer_counts_as_held_by_its_lingering_publish(
    seg: MappedSegment,
) -> None:
    """Its Publish still lingers, but holds nothing back: the writer reuses the run."""
    g = _writer(FakeSource())
    holder, frame = _Holder(), object()
    lease = _put(g, seg)
    lease.held = (holder, frame, 4 * SLOT)
    unread = _put(g, seg)
    unread.held = (holder, frame, 4 * SLOT)
    assert g.table.reclaim_read() == 0 and holder.taken == []  # nobody read them yet
    seg.mark_read(lease.slot, _mark(lease))
    assert g.table.reclaim_read() == 1
    assert holder.taken == [(frame, 4 * SLOT)]  # the one read; the unread one holds on
    assert lease.held is None and unread.held is not None
    assert g.table.reclaim_read() == 0 and len(holder.taken) == 1  # told once
