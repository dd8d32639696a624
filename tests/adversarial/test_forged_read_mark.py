"""A read mark forged by another process gives no writer its run back.

Every admitted client maps the arena, so any of them can write a slot header.
The mark a writer takes is the random part the DataRef's object id ends with,
which the arena does not hold: a neighbour that writes what it can read there
(the lease id, the mark's old form) scribbles on the header, and that costs
the lease's reader the lease (``StaleRefError``, as scribbling on its bytes
would) but never makes the writer cut its next lease from the run. On a lease
a push or pull was reading, that would have had the writer's next Reserve
refused and its session closed. The sessions go on, and the arena ends empty.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from relayd_client import StaleRefError, SyncRelayClient

from tests._daemon import drained, running_daemon, wait_until
from tests._fixtures import separate_processes
from tests._workers import digest, make_payload

__all__ = ["separate_processes"]  # the autouse fixture: clients here use the arena

pytestmark = pytest.mark.timeout(120)

MARK = """
import sys
from relayd_client.wire.shm import MappedSegment
name, size, slot_size, slot, lease_id = sys.argv[1], *map(int, sys.argv[2:])
seg = MappedSegment(name, size, 0, slot_size)
seg.mark_read(slot, lease_id)
seg.close()
"""


def test_a_forged_mark_is_not_taken_by_the_writer(tmp_path: object) -> None:
    with running_daemon(str(tmp_path), pool="64MiB") as d:
        with (
            SyncRelayClient("thinker", d.socket) as w,
            SyncRelayClient("talker", d.socket) as r,
        ):
            first = make_payload(1, 256 << 10)
            ref = w.put(first, to_stage="talker", request_id="victim", timeout=30)
            lease = ref.proto.lease
            seg = w._client._conn.segments[lease.segment]
            subprocess.run(
                [sys.executable, "-c", MARK, seg.name, str(seg.size), str(seg.slot_size),
                 str(lease.slot), str(lease.lease_id)],
                check=True, timeout=30,
            )  # fmt: skip
            second = make_payload(2, 256 << 10)
            ref2 = w.put(second, to_stage="talker", request_id="next", timeout=30)
            assert ref2.proto.lease.slot != lease.slot  # the writer did not take it
            with pytest.raises(StaleRefError):
                r.get(ref)  # the header no longer names the lease
            r.discard(ref)  # its reader gives it up: the daemon frees it
            assert digest(r.get(ref2)) == digest(second)
            # Both sessions go on.
            third = make_payload(3, 256 << 10)
            again = w.put(third, to_stage="talker", request_id="after", timeout=30)
            assert digest(r.get(again)) == digest(third)
        wait_until(lambda: drained(d), 10, "arena back to zero")
        assert "refused" not in d.log()
