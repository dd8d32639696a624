"""The daemon's collector pauses: counted per generation while watched, and only then."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry

from relayd.gc_pauses import GENERATIONS, PAUSE_BUCKETS, GcPauses
from relayd.metrics import Metrics


def _count(registry: CollectorRegistry, generation: int) -> float:
    value = registry.get_sample_value(
        "relayd_gc_pause_seconds_count", {"generation": str(generation)}
    )
    assert value is not None
    return value


def test_a_full_collection_is_counted_under_generation_two_while_watched() -> None:
    m = Metrics()
    r = m.registry
    assert [_count(r, g) for g in range(GENERATIONS)] == [0, 0, 0]
    m.watch_gc()
    m.watch_gc()  # twice is one callback
    try:
        assert sum(cb == m.gc_pauses._on_gc for cb in gc.callbacks) == 1
        gc.collect()
        gc.collect()
        assert _count(r, 2) >= 2
        total = r.get_sample_value("relayd_gc_pause_seconds_sum", {"generation": "2"})
        assert total is not None and total > 0
        # Buckets are cumulative up to +Inf, which is the count.
        bounds = [*(repr(b) for b in PAUSE_BUCKETS), "+Inf"]
        cumulative = [
            r.get_sample_value("relayd_gc_pause_seconds_bucket", {"generation": "2", "le": le})
            for le in bounds
        ]
        assert cumulative == sorted(cumulative) and cumulative[-1] == _count(r, 2)
    finally:
        m.close()
    assert all(cb != m.gc_pauses._on_gc for cb in gc.callbacks)
    before = _count(r, 2)
    gc.collect()
    assert _count(r, 2) == before


def test_a_young_collection_lands_under_its_own_generation() -> None:
    pauses = GcPauses()
    pauses._on_gc("start", {"generation": 0})
    pauses._on_gc("stop", {"generation": 0, "collected": 0, "uncollectable": 0})
    r = CollectorRegistry()
    r.register(pauses)
    assert [_count(r, g) for g in range(GENERATIONS)] == [1, 0, 0]
    top = r.get_sample_value("relayd_gc_pause_seconds_bucket", {"generation": "0", "le": "+Inf"})
    assert top == 1


def test_freeze_keeps_what_lives_now_out_of_every_later_collection() -> None:
    pauses = GcPauses()
    r = CollectorRegistry()
    r.register(pauses)
    assert r.get_sample_value("relayd_gc_frozen_objects") == 0
    kept: list[list[int]] = [[] for _ in range(1000)]  # tracked containers alive at the freeze
    pauses.watch()
    try:
        frozen = pauses.freeze()
        assert frozen == gc.get_freeze_count() >= len(kept)
        assert r.get_sample_value("relayd_gc_frozen_objects") == frozen
        assert not any(obj is kept[0] for obj in gc.get_objects())  # no generation holds it
        # Its own collection came before anyone waited: not a pause; later ones are.
        assert _count(r, 2) == 0
        gc.collect()
        assert _count(r, 2) == 1
    finally:
        pauses.stop()
        gc.unfreeze()  # the test process's objects go back to being collected
