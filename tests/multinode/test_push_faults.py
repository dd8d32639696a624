"""Faults while pushes are in flight: real daemons, real Mooncake, clients in their
own processes. Each ends in correct bytes or a clear RelayError within the peer
timeout, transfers work again once the peer is back, and no daemon keeps leases,
credits or arena bytes for what failed.

A push is held in flight deterministically by freezing the consumer's daemon
(SIGSTOP): its Mooncake engine stops applying writes, so the writer's daemon
waits for the acknowledgement. So node A pushes by Mooncake WRITE only
(``--push-attach-max 0``) in those tests. An attached push is in the kernel's
hands once published: the same freeze holds its bytes in the writer's daemon's
notice connection (12 MiB fills the socket buffers), and the ``attached`` tests
kill a daemon there.
"""

from __future__ import annotations

import contextlib
import pathlib
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from relayd_bench import _netns
from tests._daemon import Daemon, read_line, run_worker, send_line, spawn_worker, wait_until
from tests._mooncake import requires_mooncake
from tests.multinode.test_push import (
    NO_ATTACH,
    _count,
    _free_but_grant,
    _pair,
    _pulls,
    _ready_to_push,
)
from tests.multinode.test_two_daemons import (
    PEER_TIMEOUT,
    MiB,
    Node,
    _lines,
    _token,
    stop_pair,
)

# A push attached to its notice (at most the default --push-attach-max of 16 MiB
# with its header) that fills the socket buffers between the daemons.
ATTACHED = 12 * MiB

pytestmark = [
    pytest.mark.multinode,
    pytest.mark.timeout(150),
    requires_mooncake,
]


@contextlib.contextmanager
def _two_nodes(tmp_path: pathlib.Path, attached: bool) -> Iterator[tuple[Node, Node]]:
    """Node A pushes by Mooncake WRITE only, or (``attached``) up to 16 MiB attached to
    its Landed notices (the default)."""
    a, b = _pair(tmp_path, {}, None if attached else NO_ATTACH)
    try:
        yield a, b
    finally:
        stop_pair(a, b)


@pytest.fixture
def nodes(tmp_path: pathlib.Path) -> Iterator[tuple[Node, Node]]:
    with _two_nodes(tmp_path, attached=False) as pair:
        yield pair


@pytest.fixture
def attaching(tmp_path: pathlib.Path) -> Iterator[tuple[Node, Node]]:
    with _two_nodes(tmp_path, attached=True) as pair:
        yield pair


def _reader(b: Node) -> subprocess.Popen[bytes]:
    reader = spawn_worker(["read", "--socket", b.daemon.socket])
    assert read_line(reader, 30) == "READY"
    return reader


def _writer_refs(a: Node, count: int, size: int, *extra: str) -> list[str]:
    args = ["write", "--socket", a.daemon.socket, "--split", "--count", str(count)]
    return _lines(run_worker([*args, "--sizes", str(size), *extra], timeout=60))


def _frozen_writes(a: Node, b: Node, count: int, size: int) -> list[str]:
    """Freeze node B, then have a writer (attached beforehand) put ``count`` payloads:
    their pushes stay in flight until B is thawed or dies."""
    args = ["write", "--socket", a.daemon.socket, "--split", "--count", str(count)]
    writer = spawn_worker([*args, "--sizes", str(size), "--go"])
    assert read_line(writer, 30) == "ATTACHED"
    assert b.daemon.proc is not None
    b.daemon.proc.send_signal(signal.SIGSTOP)
    send_line(writer, "go")
    return [read_line(writer, 30) for _ in range(count)]  # the writer exits by itself


def _frozen_attached(a: Node, b: Node, count: int) -> list[str]:
    """:func:`_frozen_writes` of ``count`` 12 MiB payloads, each attached to its notice:
    their bytes wait in node A's notice connection to B until B is thawed or dies."""
    refs = _frozen_writes(a, b, count, ATTACHED)
    wait_until(
        lambda: _count(a, b, "pushes_attached") == count,
        PEER_TIMEOUT,
        "the attached pushes",
        state=lambda: a.peer(b.address),
    )
    return refs


def _fresh_pushes_read(a: Node, b: Node, reader: subprocess.Popen[bytes]) -> None:
    """Once the peers are back: two fresh 1 MiB puts are pushed and read by digest."""
    _ready_to_push(a, b)
    for line in _writer_refs(a, 2, MiB):
        send_line(reader, line)
        assert read_line(reader, PEER_TIMEOUT + 5) == line.split()[1]


def _in_flight_pushes(a: Node, b: Node) -> int:
    return int(a.peer(b.address).get("credits_in_use", 0))


def _two_in_flight(a: Node, b: Node, attached: bool) -> list[str]:
    """Two pushes held in flight by freezing node B: WRITEs of 8 MiB, or attached."""
    if attached:
        return _frozen_attached(a, b, 2)
    refs = _frozen_writes(a, b, 2, 8 * MiB)
    wait_until(lambda: _in_flight_pushes(a, b) == 2, PEER_TIMEOUT, "two pushes in flight")
    return refs


def test_writer_killed_after_publishing_with_pushes_in_flight(nodes: tuple[Node, Node]) -> None:
    """The writer process dies; its daemon owns the published leases and their pushes."""
    a, b = nodes
    reader = _reader(b)
    _ready_to_push(a, b)
    assert b.daemon.proc is not None
    writer = spawn_worker(
        ["write", "--socket", a.daemon.socket, "--split", "--count", "3", "--sizes",
         str(4 * MiB), "--hold", "--go"]
    )  # fmt: skip
    assert read_line(writer, 30) == "ATTACHED"
    b.daemon.proc.send_signal(signal.SIGSTOP)  # the pushes cannot land yet
    try:
        send_line(writer, "go")
        refs = [read_line(writer, 30) for _ in range(3)]
        assert read_line(writer, 10) == "HOLDING"
        wait_until(lambda: _in_flight_pushes(a, b) == 3, PEER_TIMEOUT, "three pushes in flight")
        writer.kill()
        writer.wait(timeout=10)
    finally:
        b.daemon.proc.send_signal(signal.SIGCONT)
    for line in refs:
        send_line(reader, line)
        assert read_line(reader, PEER_TIMEOUT + 5) == line.split()[1]
    # Pushed unless the peer timeout ran out while node B was frozen (then pulled).
    assert _count(b, a, "pushes_in") + _pulls(b) == 3
    wait_until(lambda: _free_but_grant(a, b), 10, "both arenas back to the push grants alone")
    assert _in_flight_pushes(a, b) == 0


def test_consumer_daemon_killed_mid_push(nodes: tuple[Node, Node]) -> None:
    """The pushes fail on the writer's side without keeping a credit or a grant run;
    the published leases wait for a reader, who reads them by pull once its daemon
    is back; fresh puts are pushed again."""
    a, b = nodes
    reader = _reader(b)
    _ready_to_push(a, b)
    assert b.daemon.proc is not None
    refs = _frozen_writes(a, b, 2, 8 * MiB)
    wait_until(lambda: _in_flight_pushes(a, b) == 2, PEER_TIMEOUT, "two pushes in flight")
    b.daemon.proc.send_signal(signal.SIGKILL)
    b.daemon.proc.wait(timeout=10)
    reader.kill()
    start = time.monotonic()
    wait_until(lambda: _in_flight_pushes(a, b) == 0, PEER_TIMEOUT + 5, "the pushes to end")
    assert time.monotonic() - start < PEER_TIMEOUT + 2
    wait_until(lambda: not a.sees(b), PEER_TIMEOUT + 5, "node A to mark node B down")
    assert int(a.daemon.pool()["free_slots"]) < int(a.daemon.pool()["slots"])  # still unread

    b.daemon.start()
    wait_until(lambda: a.sees(b) and b.sees(a), 15, "the daemons to meet again")
    reader = _reader(b)
    for line in refs:  # the writer's leases survived: pulled now
        send_line(reader, line)
        assert read_line(reader, PEER_TIMEOUT + 10) == line.split()[1]
    _fresh_pushes_read(a, b, reader)
    assert _count(b, a, "pushes_in") == 2
    wait_until(lambda: _free_but_grant(a, b), 10, "both arenas back to the push grants alone")
    assert _in_flight_pushes(a, b) == 0


@pytest.mark.parametrize("attached", [False, True], ids=["write", "attached"])
def test_writer_daemon_killed_with_pushes_in_flight(tmp_path: pathlib.Path, attached: bool) -> None:
    """The reads awaiting those pushes fail with PeerUnavailableError within the peer
    timeout; the consumer's daemon gives the dead peer's push grant back. Attached:
    B got part of a batch's bytes when the connection ended, and the runs it placed
    them in go back unpublished."""
    with _two_nodes(tmp_path, attached) as (a, b):
        reader = _reader(b)
        _ready_to_push(a, b)
        assert a.daemon.proc is not None and b.daemon.proc is not None
        try:
            refs = _two_in_flight(a, b, attached)
            a.daemon.proc.send_signal(signal.SIGKILL)
            a.daemon.proc.wait(timeout=10)
        finally:
            b.daemon.proc.send_signal(signal.SIGCONT)
        for line in refs:
            start = time.monotonic()
            send_line(reader, line)
            got = read_line(reader, PEER_TIMEOUT + 10)
            assert got.startswith("ERR PeerUnavailableError"), got
            assert time.monotonic() - start < PEER_TIMEOUT + 2
        assert _count(b, a, "pushes_in") == 0  # nothing of the dead peer was published
        pool = b.daemon.pool()
        wait_until(
            lambda: b.used() == 0 and b.daemon.pool()["free_slots"] == pool["slots"],
            10,
            "node B's arena all free (the dead peer's push grant back)",
        )
        assert int(b.peer(a.address).get("credits_in_use", 0)) == 0

        a.daemon.start()
        wait_until(lambda: a.sees(b) and b.sees(a), 15, "the daemons to meet again")
        _fresh_pushes_read(a, b, reader)
        assert _count(b, a, "pushes_in") == 2
        wait_until(lambda: _free_but_grant(a, b), 10, "both arenas back to the push grants alone")


def test_consumer_daemon_killed_with_attached_bytes_in_flight(
    attaching: tuple[Node, Node],
) -> None:
    """The bytes die with the consumer's daemon, but the writer's leases stay
    published until that daemon says it received them: once it is back, the
    reads pull them, nothing is left on either node, and fresh puts are
    attached again."""
    a, b = attaching
    reader = _reader(b)
    _ready_to_push(a, b)
    assert b.daemon.proc is not None
    refs = _frozen_attached(a, b, 2)
    assert a.used() >= 2 * ATTACHED  # not received yet
    assert _count(a, b, "pushes_unreceived") == 2
    b.daemon.proc.send_signal(signal.SIGKILL)
    b.daemon.proc.wait(timeout=10)
    reader.kill()
    wait_until(lambda: not a.sees(b), PEER_TIMEOUT + 5, "node A to mark node B down")
    assert a.used() >= 2 * ATTACHED

    b.daemon.start()
    wait_until(lambda: a.sees(b) and b.sees(a), 15, "the daemons to meet again")
    reader = _reader(b)
    for line in refs:  # pulled from the writer's leases
        send_line(reader, line)
        assert read_line(reader, PEER_TIMEOUT + 10) == line.split()[1]
    _fresh_pushes_read(a, b, reader)
    assert _count(a, b, "pushes_attached") == 4  # node A counts across B's restart
    wait_until(lambda: _free_but_grant(a, b), 10, "both arenas back to the push grants alone")
    # Read by fetch, or with no fetch where B announced them to the reader first
    # (counted once the reader's lingering Release came: the arenas say it did).
    assert _count(b, a, "reads_attached") + _count(b, a, "reads_announced") == 2
    assert _in_flight_pushes(a, b) == 0


@pytest.fixture
def netns() -> Iterator[_netns.Netns]:
    try:
        with _netns.netns_pair("p", rate="10gbit") as pair:
            yield pair
    except _netns.NetnsUnavailable as exc:
        pytest.skip(str(exc))


def test_link_down_mid_stream_then_up(tmp_path: pathlib.Path, netns: _netns.Netns) -> None:
    """Two daemons in two network namespaces (a 10 Gbit/s veth); the link goes down mid-stream. Reads
    awaiting pushes fail with PeerUnavailableError within the peer timeout; once
    the link is back the same DataRefs read (by pull) or fail with StaleRefError
    (their push landed in a voided grant), and new puts are pushed and read."""
    token = _token(tmp_path, "token", "0123456789abcdef-shared-peer-token")
    daemons = []
    for i, name in enumerate(("ns-a", "ns-b")):
        d = tmp_path / name
        d.mkdir()
        daemon = Daemon(
            str(d),
            "--peer-address", f"{netns.addrs[i]}:9092",
            "--peers", f"{netns.addrs[1 - i]}:9092",
            "--peer-token-file", token,
            "--peer-timeout", str(PEER_TIMEOUT),
            node_id=name,
        )  # fmt: skip
        daemon.args[:0] = netns.wrap(i)
        daemons.append(daemon)
    a, b = daemons
    peer_a, peer_b = f"{netns.addrs[0]}:9092", f"{netns.addrs[1]}:9092"

    def peer(d: Daemon, address: str) -> dict[str, Any]:
        return next((p for p in d.status().get("peers", []) if p["address"] == address), {})

    def ready() -> bool:
        return "talker" in peer(a, peer_b).get("stages", []) and bool(
            int(peer(a, peer_b).get("push_grant_bytes", 0))
        )

    def write(n: int, seed: int) -> list[str]:
        args = ["write", "--socket", a.socket, "--split", "--count", str(n), "--seed", str(seed)]
        return _lines(run_worker([*args, "--request", f"s{seed}", "--sizes", str(MiB)]))

    try:
        a.start()
        b.start()
        wait_until(lambda: peer(b, peer_a).get("up"), 15, "the daemons to handshake")
        reader = spawn_worker(["read", "--socket", b.socket])
        assert read_line(reader, 30) == "READY"
        wait_until(ready, 15, "node A to push to node B")
        for line in write(2, 0):
            send_line(reader, line)
            assert read_line(reader, 10) == line.split()[1]
        netns.link(0, up=False)
        cut = write(2, 10)
        for line in cut:
            start = time.monotonic()
            send_line(reader, line)
            got = read_line(reader, PEER_TIMEOUT + 10)
            assert got.startswith("ERR PeerUnavailableError"), got
            assert time.monotonic() - start < PEER_TIMEOUT + 2
        netns.link(0, up=True)
        wait_until(lambda: peer(b, peer_a).get("up") and ready(), 20, "the peers to meet again")
        after = write(2, 20)
        for line in cut:
            # A push the writer's Mooncake retried until the link was back may have
            # landed in the grant the reader's daemon had already voided: the writer's
            # daemon freed its lease on the write's ack, so the bytes are gone. The
            # design promises no copy of them, only a clear error (and no leak).
            send_line(reader, line)
            got = read_line(reader, PEER_TIMEOUT + 10)
            assert got == line.split()[1] or got.startswith("ERR StaleRefError"), got
        for line in after:  # made after the link is back: these must read
            send_line(reader, line)
            assert read_line(reader, PEER_TIMEOUT + 10) == line.split()[1]
        assert int(peer(b, peer_a).get("pushes_in", 0)) >= 4
        wait_until(lambda: all(d.pool()["used_bytes"] == 0 for d in (a, b)), 10, "no lease left")
        # A cut push's lease may be gone (its reader pulled it) while Mooncake still
        # retries the write: the push keeps its credit, and the lease's slots, until
        # the write settles, which the peer timeout bounds.
        wait_until(
            lambda: (
                not any(int(peer(*p).get("credits_in_use", 0)) for p in ((b, peer_a), (a, peer_b)))
            ),
            PEER_TIMEOUT + 10,
            "every push and pull to settle",
        )
    finally:
        for d in (b, a):
            if d.proc is not None and d.proc.poll() is None:
                d.stop()
