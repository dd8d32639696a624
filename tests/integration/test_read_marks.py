"""A writer copies into the run its reader has just read, with a real daemon.

The reader marks each lease read in its slot header before its Release; the
writer takes the run back on the mark, without waiting for the daemon (which
takes Releases only when it is awake anyway), and copies into memory still in
cache. Each test checks the bytes, the slots the writer used, that no session
was refused, and that the arena ends empty.
"""

from __future__ import annotations

import asyncio
import collections

import pytest
from relayd_client import DataRef, RelayClient, SyncRelayClient

from tests._daemon import Daemon, drained, running_daemon, wait_until
from tests._fixtures import separate_processes
from tests._workers import digest, make_payload

__all__ = ["separate_processes"]  # the autouse fixture: clients here use the arena

pytestmark = pytest.mark.timeout(120)

KiB, MiB = 1 << 10, 1 << 20
# A writer that waited for the daemon's Freed walked through about 16 MiB of
# runs between wake-ups of the daemon: 64 of 256 KiB, 16 of 1 MiB.
ROUNDS = 80


def _slot(ref: DataRef) -> tuple[int, int]:
    return ref.proto.lease.segment, ref.proto.lease.slot


def _nobody_refused(d: Daemon) -> None:
    assert "refused" not in d.log(), d.log()[-2000:]


@pytest.mark.parametrize("size", [256 * KiB, MiB])
def test_a_blocking_writer_stays_on_the_run_its_reader_just_read(
    tmp_path: object, size: int
) -> None:
    with running_daemon(str(tmp_path), pool="64MiB") as d:
        with (
            SyncRelayClient("thinker", d.socket) as w,
            SyncRelayClient("talker", d.socket) as r,
        ):
            assert w._client._conn.session.reserve_over_read
            slots: collections.Counter[tuple[int, int]] = collections.Counter()  # puts per run
            for i in range(ROUNDS):
                payload = make_payload(i, size)
                ref = w.put(payload, to_stage="talker", request_id=f"r{i}", timeout=30)
                slots[_slot(ref)] += 1
                assert digest(r.get(ref)) == digest(payload)
            # Two runs in turn, or a third in the turn: when the pending frame
            # leaves between a put's Reserve and its Publish (a linger timer fired
            # during the copy, as on a loaded host), the Publish goes on its own
            # and that run comes back with the daemon's Freed, not on the mark,
            # after the writer cut another. A writer that waited for the Freed
            # every time walked through 64 runs here.
            assert len(slots) <= 4, sorted(slots.items())
        wait_until(lambda: drained(d), 10, "arena back to zero")
        _nobody_refused(d)


def test_an_async_writer_and_a_view_released_late_do_the_same(tmp_path: object) -> None:
    async def scenario(sock: str) -> set[tuple[int, int]]:
        async with RelayClient("thinker", sock) as w, RelayClient("talker", sock) as r:
            slots = set()
            for i in range(ROUNDS):
                payload = make_payload(i, 256 * KiB)
                ref = await w.put(payload, to_stage="talker", request_id=f"a{i}", timeout=30)
                slots.add(_slot(ref))
                if i % 2:
                    assert digest(await r.get(ref)) == digest(payload)
                    continue
                views = await r.get(ref, copy=False)  # the reader holds the arena's bytes
                assert digest(views) == digest(payload)
                # Not read yet in the writer's eyes: the next put takes another run.
                nxt = make_payload(-i, 256 * KiB)
                other = await w.put(nxt, to_stage="talker", request_id=f"b{i}", timeout=30)
                assert _slot(other) != _slot(ref)
                assert digest(views) == digest(payload)  # and left these bytes alone
                r.release(ref)
                assert digest(await r.get(other)) == digest(nxt)
                slots.add(_slot(other))
            return slots

    with running_daemon(str(tmp_path), pool="64MiB") as d:
        slots = asyncio.run(asyncio.wait_for(scenario(d.socket), 60))
        assert len(slots) <= 3, sorted(slots)
        wait_until(lambda: drained(d), 10, "arena back to zero")
        _nobody_refused(d)


def test_a_writer_without_marks_from_its_daemon_waits_for_the_freed(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As with a daemon that does not take a Reserve over a read lease: the
    # writer walks its grants, as before, and nothing else changes. The linger
    # is made a minute: how many transfers fit in 25 ms is the host's load, and
    # on a loaded one the Freed came every eight.
    import relayd_client._notices

    monkeypatch.setattr(relayd_client._notices, "NOTICE_LINGER_S", 60.0)
    with running_daemon(str(tmp_path), pool="64MiB") as d:
        with (
            SyncRelayClient("thinker", d.socket) as w,
            SyncRelayClient("talker", d.socket) as r,
        ):
            w._client._conn.session.reserve_over_read = False
            slots = set()
            for i in range(ROUNDS):
                payload = make_payload(i, 256 * KiB)
                ref = w.put(payload, to_stage="talker", request_id=f"o{i}", timeout=30)
                slots.add(_slot(ref))
                assert digest(r.get(ref)) == digest(payload)
            assert len(slots) > 8
        wait_until(lambda: drained(d), 10, "arena back to zero")
        _nobody_refused(d)
