"""Request records: what abort needs, kept small for the garbage collector."""

from __future__ import annotations

import gc
from dataclasses import dataclass

from relayd.pools.requests import FEW_NAMES, MAX_NAMES, Requests


@dataclass
class FakeLease:
    id: int
    request_id: str
    from_stage: str = "thinker"
    to_stage: str = "talker"


def test_a_record_keeps_its_stages_once_and_its_leases_while_live() -> None:
    reqs = Requests()
    a, b = FakeLease(1, "r"), FakeLease(2, "r", to_stage="vocoder")
    reqs.add(a, 1.0)
    reqs.add(b, 2.0)
    reqs.add(FakeLease(3, "r"), 3.0)
    req = reqs.by_id["r"]
    assert (tuple(req.writers), tuple(req.readers)) == (("thinker",), ("talker", "vocoder"))
    assert req.involved == {"thinker", "talker", "vocoder"}
    assert req.live_leases() == [1, 2, 3] and req.touched == 3.0
    for lease_id in (1, 2, 3):
        reqs.remove(FakeLease(lease_id, "r"))
    assert req.leases is None and req.live_leases() == []
    reqs.remove(a)  # twice is fine


def test_many_stage_names_in_one_request_grow_one_set_in_place() -> None:
    # A hostile writer naming a new to_stage for each lease of one request:
    # past a few names each add must not copy what is there.
    reqs = Requests()
    for i in range(FEW_NAMES + 1):
        reqs.add(FakeLease(i, "r", to_stage=f"s{i}"), 1.0)
    req = reqs.by_id["r"]
    names = req.readers
    assert isinstance(names, set) and len(names) == FEW_NAMES + 1
    for i in range(FEW_NAMES + 1, MAX_NAMES):
        reqs.add(FakeLease(i, "r", to_stage=f"s{i}"), 1.0)
    assert req.readers is names and len(names) == MAX_NAMES
    assert {"s0", f"s{MAX_NAMES - 1}", "thinker"} <= req.involved


def test_a_remembered_record_holds_nothing_the_collector_walks() -> None:
    reqs = Requests()
    for i in range(100):
        lease = FakeLease(i, f"r{i}")
        reqs.add(lease, 1.0)
        reqs.remove(lease)
    gc.collect()  # untracks tuples that hold only strings
    for req in reqs.by_id.values():
        assert req.leases is None
        assert not gc.is_tracked(req.writers) and not gc.is_tracked(req.readers)
        assert not hasattr(req, "__dict__")


def test_tombstones_bind_the_aborting_stages_once() -> None:
    reqs = Requests()
    reqs.tombstone("gone", ("talker", "talker", "thinker"), 5.0)
    req = reqs.by_id["gone"]
    assert req.aborted is False and tuple(req.aborters) == ("talker", "thinker")


def test_a_second_tombstone_adds_its_stages_and_keeps_the_record_young() -> None:
    reqs = Requests()
    reqs.tombstone("gone", ("bystander",), 5.0)
    reqs.tombstone("other", ("thinker",), 6.0)
    reqs.tombstone("gone", ("talker",), 7.0)
    req = reqs.by_id["gone"]
    assert tuple(req.aborters) == ("bystander", "talker") and req.touched == 7.0
    assert list(reqs.by_id) == ["other", "gone"]  # the sweep meets the oldest first


def test_a_tombstone_does_not_narrow_an_abort_that_binds_every_stage() -> None:
    reqs = Requests()
    req = reqs.touch("from-peer", 5.0)
    req.aborted = True  # a peer's abort: every later lease of it is freed
    reqs.tombstone("from-peer", ("bystander",), 6.0)
    assert req.aborted and req.aborters == ()
