"""A writer's object ids: unique, and each with a random part of its own.

A lease's read mark is the random part its DataRef's object id ends with, so a
stage that holds one DataRef of a writer must not be able to tell another's
from it: every id carries 64 random bits no other id of the writer shares,
from any thread. Whatever an id ends with, its mark fits a slot header.
"""

from __future__ import annotations

import re
import sys
import threading

import pytest
from relayd_client._writer import ObjectIds
from relayd_client.wire.shm import SLOT_HEADER, read_mark

_ID = re.compile(r"^[0-9a-f]{12}-(\d+)-([0-9a-f]{16})$")


def test_ids_are_numbered_and_each_has_a_random_part_of_its_own() -> None:
    ids = ObjectIds()
    drawn = [ids.next() for _ in range(3 * ObjectIds.BATCH + 5)]
    parts = [_ID.match(i) for i in drawn]
    assert all(parts), drawn[:3]
    assert [int(p[1]) for p in parts if p] == list(range(1, len(drawn) + 1))
    assert len({p[2] for p in parts if p}) == len(drawn)
    assert len(ids._batches) <= 2  # the batches behind go


def test_two_writers_share_no_prefix() -> None:
    assert ObjectIds().next().split("-")[0] != ObjectIds().next().split("-")[0]


def test_threads_never_draw_the_same_random_part() -> None:
    ids = ObjectIds()
    drawn: list[list[str]] = [[] for _ in range(4)]

    def draw(out: list[str]) -> None:
        out.extend(ids.next() for _ in range(5 * ObjectIds.BATCH))

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch inside next(), at batch edges too
    try:
        threads = [threading.Thread(target=draw, args=(out,)) for out in drawn]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(switch)
    every = [i for out in drawn for i in out]
    assert len(every) == 4 * 5 * ObjectIds.BATCH
    assert len({i.rsplit("-", 1)[1] for i in every}) == len(every)


def test_the_mark_is_the_random_part_of_the_id() -> None:
    object_id = ObjectIds().next()
    assert read_mark(object_id, 7) == int(object_id[-16:], 16) | 1


@pytest.mark.parametrize(
    "object_id",
    ["3f2a9c1b7d4e-12", "", "o1", "3f2a9c1b7d4e-12-xyz"],
    ids=["older-writer", "empty", "short", "not-hex"],
)
def test_an_id_without_the_random_part_is_marked_with_its_lease_id(object_id: str) -> None:
    # As a writer that predates the random part takes its reader's mark.
    assert read_mark(object_id, 7) == 7


@pytest.mark.parametrize(
    "tail", ["-000000000000001", "0000000000000000", "ffffffffffffffff", " 1_2", "+00000000000000f"]
)
def test_any_tail_a_writer_chose_gives_a_mark_that_fits_the_header(tail: str) -> None:
    mark = read_mark(f"3f2a9c1b7d4e-1-{tail}", 7)
    assert 0 < mark < 1 << 64
    SLOT_HEADER.pack(0, mark)  # no struct.error in the reader's get
