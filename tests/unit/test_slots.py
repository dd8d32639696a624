"""SlotAllocator: no overlap, no leak, coalescing, fragmentation reporting."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from relayd_client.wire.slots import SlotAllocator


def test_first_fit_split_and_coalesce() -> None:
    a = SlotAllocator(10)
    assert a.allocate(3) == 0
    assert a.allocate(3) == 3
    assert a.allocate(3) == 6
    assert a.allocate(2) is None and a.free_slots == 1
    a.free(3, 3)
    assert a.largest_free_run() == 3
    a.free(0, 3)
    assert a.free_runs() == [(0, 6), (9, 1)]
    a.free(6, 3)
    assert a.free_runs() == [(0, 10)] and a.used_slots == 0


def test_double_free_and_out_of_range_are_refused() -> None:
    a = SlotAllocator(8)
    start = a.allocate(4)
    assert start == 0
    a.free(0, 4)
    with pytest.raises(ValueError):
        a.free(0, 4)
    with pytest.raises(ValueError):
        a.free(6, 4)
    with pytest.raises(ValueError):
        a.allocate(0)


def test_allocate_at_rebuilds_exact_runs() -> None:
    a = SlotAllocator(16)
    assert a.allocate_at(4, 4)
    assert not a.allocate_at(6, 4)
    assert a.free_runs() == [(0, 4), (8, 8)]


def test_thousands_of_slots_fragmented() -> None:
    a = SlotAllocator(16384)
    starts = [a.allocate(1) for _ in range(16384)]
    assert a.free_slots == 0
    for s in starts[::2]:
        assert s is not None
        a.free(s, 1)
    assert a.largest_free_run() == 1 and a.free_slots == 8192
    assert a.allocate(2) is None
    for s in starts[1::2]:
        assert s is not None
        a.free(s, 1)
    assert a.free_runs() == [(0, 16384)]


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.n = 64
        self.a = SlotAllocator(self.n)
        self.held: dict[int, int] = {}

    @rule(count=st.integers(1, 20))
    def allocate(self, count: int) -> None:
        start = self.a.allocate(count)
        owned = [0] * self.n
        for s, c in self.held.items():
            for i in range(s, s + c):
                owned[i] = 1
        best = 0
        run = 0
        for i in range(self.n):
            run = run + 1 if not owned[i] else 0
            best = max(best, run)
        if start is None:
            assert best < count, "allocation failed although a run was free"
        else:
            assert all(not owned[i] for i in range(start, start + count)), "overlap"
            self.held[start] = count

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        start = data.draw(st.sampled_from(sorted(self.held)))
        self.a.free(start, self.held.pop(start))

    @invariant()
    def accounting(self) -> None:
        assert self.a.used_slots == sum(self.held.values())
        runs = self.a.free_runs()
        for (s1, l1), (s2, _) in itertools.pairwise(runs):
            assert s1 + l1 < s2, "adjacent free runs were not coalesced"
        assert self.a.largest_free_run() == max((length for _, length in runs), default=0)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
