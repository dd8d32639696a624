"""An abort frees a request's leases only as far as the request is the aborter's.

Request ids are the clients' to choose and readable in any DataRef, so an
admitted process of another uid can write one lease of its own under a
victim's request id: that makes its stage one of the request's writers, which
is what abort asks of a caller. Its abort must then free only what its own
stages write or read: the victim's lease stays for its reader, and the
victim's stages are not told the request was aborted (a client refuses its
own puts to an aborted request). The daemon runs as its own user, the stages
as root and the intruder as an admitted stage user (see _users).

Across nodes the same holds: the intruder's node knows only the intruder's
lease of the request, so there the abort is whole, but the peers it tells
narrow it to the intruder's stages when their own writers of the request are
of another uid than the aborter's.
"""

from __future__ import annotations

import os
import pathlib
import shutil

import pytest

from tests._daemon import Daemon, free_port, wait_until
from tests._keyed_worker import Stage
from tests._mooncake import requires_mooncake
from tests.adversarial._users import DAEMON, SUPP, User, run_as, shared_dir
from tests.faults._support import unique_node
from tests.multinode.test_two_daemons import TOKEN, Node, stop_pair

pytestmark = pytest.mark.timeout(180)

LEASED = 300_000  # bytes: held in an arena lease, not inline
INTRUDER = "vocoder"


def _ok(answer: str) -> list[str]:
    assert answer.startswith("OK"), answer
    return answer.split()[1:]


def _still_the_victims(writer: Stage, reader: Stage) -> list[str]:
    """After the intruder's abort: the victim's stages were not told (its writer still
    puts under the request, and it is read), and the request is still theirs to
    abort, whole. Returns what the victim's abort answered."""
    ref2, sent2, _ = _ok(writer.ask("put", "-", 2, LEASED, "r1", "talker"))
    assert _ok(reader.ask("read", ref2)) == [sent2]
    ref3, _, _ = _ok(writer.ask("put", "-", 3, LEASED, "r1", "talker"))
    freed = _ok(writer.ask("abort", "r1"))
    assert reader.ask("read", ref3).split()[:2] == ["ERR", "AbortedError"]
    return freed


def test_another_uids_abort_of_a_request_it_wrote_into_frees_only_its_own(
    users: dict[str, User], run_dir: str
) -> None:
    logs = shared_dir()
    d = Daemon(run_dir, node_id=unique_node())
    d.args = users[DAEMON].argv(d.args)
    d.log_path = os.path.join(logs, "daemon.log")
    d.start()
    try:
        writer, reader = Stage(d.socket, "thinker"), Stage(d.socket, "talker")
        ref, sent, transport = _ok(writer.ask("put", "-", 1, LEASED, "r1", "talker"))
        assert transport == "shm"

        assert run_as(users[SUPP], ["hijack", d.socket, INTRUDER, "r1"]) == {"abort": "OK"}

        assert _ok(reader.ask("read", ref)) == [sent], "the intruder's abort freed the lease"
        assert _still_the_victims(writer, reader) == ["1"]  # ref3: the one left
        assert d.pool()["used_bytes"] == 0
    finally:
        d.stop()
        shutil.rmtree(logs, ignore_errors=True)


@pytest.mark.multinode
@requires_mooncake
@pytest.mark.parametrize("reader_on", ["b", "a"])
def test_another_uids_abort_on_another_node_frees_only_its_own_there(
    users: dict[str, User], tmp_path: pathlib.Path, reader_on: str
) -> None:
    """The victim's writer runs on node B, as root, and its reader on B or on node A;
    the intruder writes its one lease of the request on node A (whose daemon runs
    as its own user, as in the test above) and aborts it there. With the reader on
    A, A holds the victim's copies that B pushed: they are the reader's uid's, not
    nobody's, so the intruder is not the request's only owner there either."""
    owner = users[DAEMON]
    shared = pathlib.Path(shared_dir(owner, parent="/run" if os.path.isdir("/run") else "/tmp"))
    token = shared / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    os.chown(token, owner.uid, owner.gid)
    pa, pb_ = free_port(), free_port()
    a = Node(shared, "node-a", pa, pb_, str(token), pool="64MiB")
    os.chown(shared / "node-a", owner.uid, owner.gid)
    a.daemon.args = owner.argv(a.daemon.args)
    a.daemon.log_path = str(shared / "node-a.log")
    b = Node(tmp_path, "node-b", pb_, pa, str(token), pool="64MiB")
    a.daemon.start()
    b.daemon.start()
    try:
        wait_until(lambda: a.sees(b) and b.sees(a), 15, "the two daemons to handshake")
        writer = Stage(b.daemon.socket, "thinker")
        reader = Stage((a if reader_on == "a" else b).daemon.socket, "talker")
        if reader_on == "a":
            wait_until(lambda: "talker" in b.peer(a.address).get("stages", []), 10, "B to learn")
        ref, sent, transport = _ok(writer.ask("put", "-", 1, LEASED, "r1", "talker"))
        assert transport == "shm"
        _, keyed, _ = _ok(writer.ask("put", "k1", 4, LEASED, "r1", "talker"))
        if reader_on == "a":  # both pushed: A holds their copies
            wait_until(lambda: int(a.peer(b.address).get("pushes_in", 0)) >= 2, 10, "the pushes")

        assert run_as(users[SUPP], ["hijack", a.daemon.socket, INTRUDER, "r1"]) == {"abort": "OK"}

        assert _ok(reader.ask("read", ref)) == [sent], "the intruder's abort freed the lease"
        assert _ok(reader.ask("poll", "k1", "thinker")) == [keyed], "it dropped the key"
        _still_the_victims(writer, reader)
        wait_until(
            lambda: a.daemon.pool()["used_bytes"] == 0 == b.daemon.pool()["used_bytes"],
            10,
            "both arenas at zero",
        )
    finally:
        stop_pair(a, b)
        shutil.rmtree(shared, ignore_errors=True)
