"""A discard frees a lease only for a session serving its writer's or its reader's stage.

A DataRef is guessable: lease ids are sequential in a grant, the generation is
the id, and every other field is its holder's to fill. So an admitted process
of an unrelated stage (another uid, too) must not free other stages' data with
it: its discard is refused with PermissionDeniedError, the daemon logs it, and
the lease's reader still reads every byte. The daemon runs as its own user,
the stages as root and the intruder as an admitted stage user (see _users).
"""

from __future__ import annotations

import os
import shutil

import pytest
from relayd_client import DataRef
from relayd_client.wire.proto import relay_pb2 as pb

from tests._daemon import Daemon, wait_until
from tests._keyed_worker import Stage
from tests.adversarial._users import DAEMON, SUPP, User, run_as, shared_dir
from tests.faults._support import unique_node

pytestmark = pytest.mark.timeout(180)

LEASED = 300_000  # bytes: held in an arena lease, not inline
INTRUDER = "vocoder"


def _daemon(users: dict[str, User], where: str, logs: str) -> Daemon:
    d = Daemon(where, node_id=unique_node())
    d.args = users[DAEMON].argv(d.args)
    d.log_path = os.path.join(logs, "daemon.log")
    return d.start()


def _used(d: Daemon) -> int:
    return d.pool()["used_bytes"]


def _ok(answer: str) -> list[str]:
    assert answer.startswith("OK"), answer
    return answer.split()[1:]


def _claiming(ref: str, stage: str) -> str:
    """``ref`` as its holder may fill it: written by and addressed to ``stage``."""
    m = pb.DataRef()
    m.CopyFrom(DataRef.from_bytes(bytes.fromhex(ref)).proto)
    m.to_stage = m.origin.stage = stage
    return DataRef(m).to_bytes().hex()


def test_another_stages_discard_is_refused_and_the_lease_stays_for_its_reader(
    users: dict[str, User], run_dir: str
) -> None:
    logs = shared_dir()
    d = _daemon(users, run_dir, logs)
    try:
        writer, reader = Stage(d.socket, "thinker"), Stage(d.socket, "talker")
        ref, sent, transport = _ok(writer.ask("put", "-", 1, LEASED, "r1", "talker"))
        assert transport == "shm"
        # The put's notices reach the daemon on the session socket, which the
        # status call that reads the pool may overtake.
        held = wait_until(lambda: _used(d), 10, "the daemon to count the put's lease")
        lease_id = DataRef.from_bytes(bytes.fromhex(ref)).proto.lease.lease_id

        got = run_as(users[SUPP], ["discard", d.socket, INTRUDER, ref, _claiming(ref, INTRUDER)])
        assert got == {"discards": ["PermissionDeniedError"] * 2}, got
        wait_until(
            lambda: f"discard of lease {lease_id} refused" in d.log(), 10, "the refusal logged"
        )
        assert _used(d) == held

        assert _ok(reader.ask("read", ref)) == [sent]
        wait_until(lambda: _used(d) == 0, 10, "the read lease to be freed")
    finally:
        d.stop()
        shutil.rmtree(logs, ignore_errors=True)
