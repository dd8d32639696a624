"""Two real daemons on loopback, real Mooncake over TCP, real client processes.

Node A and node B are two ``relayd serve`` processes with distinct node ids,
sockets, Peer-service ports and Mooncake ports, sharing a peer token file. A
writer stage attaches to A, a reader stage to B; the reader's daemon pulls
every non-inline payload from A's arena into B's through Mooncake.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from relayd_client import (
    AbortedError,
    CorruptRefError,
    DataRef,
    PermissionDeniedError,
    RelayClient,
    StaleRefError,
    _codec,
    _header_tree,
)
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.proto import relay_pb2_grpc as pb_grpc

from relayd_bench import _netns
from tests._daemon import (
    Daemon,
    free_port,
    read_line,
    run_worker,
    send_line,
    spawn_worker,
    wait_until,
)
from tests._mooncake import requires_mooncake
from tests._workers import digest, make_payload

pytestmark = [
    pytest.mark.multinode,
    pytest.mark.timeout(120),
    requires_mooncake,
]

MiB = 1 << 20
PEER_TIMEOUT = 2.0
CREDITS = 4


def _token(tmp: pathlib.Path, name: str, value: str) -> str:
    path = tmp / name
    path.write_text(value + "\n")
    path.chmod(0o600)  # relayd refuses a token other users can read
    return str(path)


class Node:
    """One daemon of the pair, with its fixed Peer-service port (kept across restarts)."""

    def __init__(
        self, tmp: pathlib.Path, name: str, port: int, peer_port: int, token: str, **kw: Any
    ) -> None:
        d = tmp / name
        d.mkdir(exist_ok=True)
        self.name = name
        self.address = f"127.0.0.1:{port}"
        self.daemon = Daemon(
            str(d),
            "--peer-address",
            self.address,
            "--peers",
            f"127.0.0.1:{peer_port}",
            "--peer-token-file",
            token,
            "--peer-timeout",
            str(PEER_TIMEOUT),
            "--peer-credits",
            str(CREDITS),
            node_id=name,
            **kw,
        )

    def peer(self, address: str) -> dict[str, Any]:
        for p in self.daemon.status().get("peers", []):
            if p["address"] == address:
                return dict(p)
        return {}

    def sees(self, other: Node) -> bool:
        return bool(self.peer(other.address).get("up"))

    def used(self) -> int:
        p = self.daemon.pool()
        return p.get("used_bytes", 0) + p.get("granted_bytes", 0)


TOKEN = "0123456789abcdef-shared-peer-token"


def start_pair(
    tmp: pathlib.Path, a_kw: dict[str, Any] | None = None, b_kw: dict[str, Any] | None = None
) -> tuple[Node, Node]:
    """Node A and node B (192 MiB arenas, ``a_kw``/``b_kw`` for ``Daemon``), each the
    other's peer, once both report the handshake."""
    token = _token(tmp, "token", TOKEN)
    pa, pb_ = free_port(), free_port()
    a = Node(tmp, "node-a", pa, pb_, token, pool="192MiB", **(a_kw or {}))
    b = Node(tmp, "node-b", pb_, pa, token, pool="192MiB", **(b_kw or {}))
    a.daemon.start()
    b.daemon.start()
    wait_until(lambda: a.sees(b) and b.sees(a), 15, "the two daemons to handshake")
    return a, b


def stop_pair(a: Node, b: Node) -> None:
    for n in (b, a):
        if n.daemon.running():
            n.daemon.terminate(signal.SIGCONT)  # one a test froze must run to drain
            n.daemon.stop()


@contextlib.contextmanager
def running_pair(
    tmp: pathlib.Path, a_kw: dict[str, Any] | None = None, b_kw: dict[str, Any] | None = None
) -> Iterator[tuple[Node, Node]]:
    a, b = start_pair(tmp, a_kw, b_kw)
    try:
        yield a, b
    finally:
        stop_pair(a, b)


@pytest.fixture
def pair(tmp_path: pathlib.Path) -> Iterator[tuple[Node, Node]]:
    with running_pair(tmp_path, b_kw={"metrics": True}) as nodes:
        yield nodes


def _lines(cp: subprocess.CompletedProcess[bytes]) -> list[str]:
    return cp.stdout.decode().splitlines()


def _metric(text: str, name: str, **labels: str) -> float | None:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def _held_writes_and_reader(
    a: Node, b: Node, count: int
) -> tuple[list[str], subprocess.Popen[bytes]]:
    """The DataRef lines of ``count`` MiB payloads a writer on A put for B (it stays
    attached, holding them), and a reader on B ready for them."""
    write = ["write", "--socket", a.daemon.socket, "--split", "--count", str(count)]
    writer = spawn_worker([*write, "--sizes", str(MiB), "--hold"])
    refs = [read_line(writer, 30) for _ in range(count)]
    assert read_line(writer, 10) == "HOLDING"
    reader = spawn_worker(["read", "--socket", b.daemon.socket])
    assert read_line(reader, 30) == "READY"
    return refs, reader


def test_round_trips_1b_to_64mib(pair: tuple[Node, Node]) -> None:
    a, b = pair
    sizes = [1, 100, 20_000, MiB, 4 * MiB + 3, 16 * MiB, 64 * MiB]
    w = run_worker(
        ["write", "--socket", a.daemon.socket, "--split", "--sizes", ",".join(map(str, sizes))]
    )
    refs = _lines(w)
    assert [line.split()[2] for line in refs] == ["inline"] * 2 + ["shm"] * 5
    r = run_worker(["read", "--socket", b.daemon.socket], input="\n".join(refs).encode() + b"\n\n")
    assert _lines(r)[1:] == [line.split()[1] for line in refs]
    wait_until(lambda: a.used() == 0 and b.used() == 0, 10, "both arenas back to zero")
    # Inline payloads never touch the peers; every other one was one Mooncake pull.
    assert b.daemon.status()["transfers_by_transport"]["mooncake"] == "5"
    text = b.daemon.scrape()
    assert _metric(text, "relayd_peer_up", peer=a.address) == 1
    assert _metric(text, "relayd_mooncake_credits_capacity", peer=a.address) == CREDITS
    assert _metric(text, "relayd_mooncake_credits_in_use", peer=a.address) == 0
    assert _metric(text, "relayd_transfers_total", transport="mooncake") == 5
    assert _metric(text, "relayd_mooncake_pull_seconds_count") == 5
    shown = subprocess.run(
        [sys.executable, "-m", "relayd", "status", "--socket", b.daemon.socket],
        capture_output=True,
        timeout=30,
        check=True,
    ).stdout.decode()
    assert "node-a" in shown and re.search(r" up/(tcp|grpc) ", shown)


def test_a_read_right_after_the_put_frees_the_origin_lease(pair: tuple[Node, Node]) -> None:
    # The writer's notices linger a moment: the reader's daemon can pull and send
    # ReleaseRemote before the origin daemon has heard of the lease. The release
    # must still free it there (not leave it to the TTL, minutes away).
    a, b = pair

    def published_on_a() -> int:
        return int(a.daemon.status().get("leases_by_state", {}).get("published", "0"))

    async def scenario() -> None:
        async with (
            RelayClient("thinker", a.daemon.socket) as w,
            RelayClient("talker", b.daemon.socket) as r,
        ):
            for i in range(12):
                payload = make_payload(i, 300_000)
                ref = await w.put(payload, to_stage="talker", request_id=f"q{i}")
                assert digest(await r.get(ref.to_bytes())) == digest(payload)
            # The writer stays attached (its event loop running) while we look.
            deadline = time.monotonic() + 10
            while published_on_a() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # polling a status RPC, bounded above
            assert published_on_a() == 0

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_200_concurrent_transfers_respect_credits(pair: tuple[Node, Node]) -> None:
    a, b = pair
    w = run_worker(
        [
            "write",
            "--socket",
            a.daemon.socket,
            "--split",
            "--concurrent",
            "--count",
            "200",
            "--sizes",
            "65536,300000",
        ],
        timeout=90,
    )
    refs = _lines(w)
    assert len(refs) == 200 and all(line.split()[2] == "shm" for line in refs)
    r = run_worker(
        ["read", "--socket", b.daemon.socket, "--concurrent"],
        input="\n".join(refs).encode() + b"\n\n",
        timeout=90,
    )
    got = _lines(r)[1:]
    assert sorted(got) == sorted(line.split()[1] for line in refs)
    peer = b.peer(a.address)
    # Never more pulls in flight than credits, and the credits were actually contended.
    assert 1 < int(peer["pulls_in_flight_max"]) <= CREDITS
    assert int(peer["credits_in_use"]) == 0
    wait_until(lambda: a.used() == 0 and b.used() == 0, 10, "both arenas back to zero")


def test_unauthenticated_peer_is_refused(pair: tuple[Node, Node], tmp_path: pathlib.Path) -> None:
    a, _b = pair
    bad = _token(tmp_path, "bad-token", "not-the-token-everyone-else-has")
    c = Node(tmp_path, "node-c", free_port(), int(a.address.rsplit(":", 1)[1]), bad, metrics=True)
    c.daemon.start()
    try:
        wait_until(
            lambda: "token" in c.peer(a.address).get("last_error", ""),
            10,
            "node-c to be refused",
        )
        assert not c.sees(a)
        assert _metric(c.daemon.scrape(), "relayd_peer_up", peer=a.address) == 0
        assert "wrong peer token" in a.daemon.log()
        assert not a.peer(c.address)  # node-a never dialled back an unauthenticated daemon
    finally:
        c.daemon.stop()


def test_wrong_token_and_wrong_version_are_refused_with_clear_errors(
    pair: tuple[Node, Node],
) -> None:
    a, _b = pair
    token = pathlib.Path(a.daemon.args[a.daemon.args.index("--peer-token-file") + 1]).read_bytes()
    with grpc.insecure_channel(a.address) as ch:
        stub = pb_grpc.PeerStub(ch)
        hello = pb.PeerHello(protocol_version=pb.PROTOCOL_VERSION_CURRENT, node_id="intruder")
        with pytest.raises(grpc.RpcError) as info:
            stub.Handshake(hello, timeout=5)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as info:
            stub.ReleaseRemote(pb.ReleaseRemoteRequest(lease_id=1, generation=1), timeout=5)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        hello.protocol_version = 99
        with pytest.raises(grpc.RpcError) as info:
            stub.Handshake(hello, timeout=5, metadata=(("relayd-peer-token-bin", token.strip()),))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "protocol 99" in (info.value.details() or "")


def test_killed_origin_daemon_fails_fast_then_transfers_resume(pair: tuple[Node, Node]) -> None:
    a, b = pair
    refs, reader = _held_writes_and_reader(a, b, 6)
    # The daemons exchange who serves which stage (handshake, then heartbeats).
    wait_until(lambda: "talker" in a.peer(b.address).get("stages", []), 10, "a to know talker")
    wait_until(lambda: "thinker" in b.peer(a.address).get("stages", []), 10, "b to know thinker")
    for line in refs[:3]:  # mid-stream: the first half arrives
        send_line(reader, line)
        assert read_line(reader, 10) == line.split()[1]
    assert a.daemon.proc is not None
    a.daemon.proc.send_signal(signal.SIGKILL)
    a.daemon.proc.wait(timeout=10)
    for line in refs[3:]:
        start = time.monotonic()
        send_line(reader, line)
        got = read_line(reader, PEER_TIMEOUT + 5)
        elapsed = time.monotonic() - start
        assert got.startswith("ERR PeerUnavailableError"), got
        assert elapsed < PEER_TIMEOUT + 1.0, f"error took {elapsed:.2f}s"
    wait_until(lambda: b.used() == 0, 10, "the reader's arena back to zero")
    wait_until(lambda: not b.sees(a), 10, "node-b to mark node-a down")
    assert _metric(b.daemon.scrape(), "relayd_peer_up", peer=a.address) == 0
    assert int(b.peer(a.address)["credits_in_use"]) == 0

    a.daemon.start()  # same ports, new epoch and Mooncake session
    wait_until(lambda: b.sees(a), 15, "node-b to reconnect to the restarted node-a")
    wait_until(lambda: a.sees(b), 15, "the restarted node-a to reach node-b")
    w = run_worker(
        ["write", "--socket", a.daemon.socket, "--split", "--count", "3", "--sizes", str(MiB)]
    )
    fresh = _lines(w)
    for line in fresh:
        send_line(reader, line)
        assert read_line(reader, 10) == line.split()[1]
    # A routed edge to the reader is cross-node: talker is a peer's stage.
    edges = a.daemon.status().get("edges", [])
    assert all(e["transport"] == "TRANSPORT_MOONCAKE" for e in edges if e["to_stage"] == "talker")
    send_line(reader, "")
    assert reader.wait(timeout=10) == 0
    wait_until(lambda: a.used() == 0 and b.used() == 0, 10, "both arenas back to zero")


def test_abort_on_reader_node_frees_the_request_on_the_origin(pair: tuple[Node, Node]) -> None:
    a, b = pair
    w = run_worker(
        [
            "write",
            "--socket",
            a.daemon.socket,
            "--request",
            "rab",
            "--count",
            "3",
            "--sizes",
            "300000",
        ]
    )
    refs = _lines(w)
    assert a.daemon.pool()["used_bytes"] > 0

    async def abort_then_read() -> None:
        from relayd_client import DataRef

        async with RelayClient("talker", b.daemon.socket) as c:
            await c.abort("rab")
            with pytest.raises((AbortedError, StaleRefError)):
                await c.get(DataRef.from_bytes(bytes.fromhex(refs[0].split()[0])))

    asyncio.run(abort_then_read())
    wait_until(lambda: a.daemon.pool()["used_bytes"] == 0, 10, "the origin to free the request")
    wait_until(lambda: a.used() == 0 and b.used() == 0, 10, "both arenas back to zero")


def test_a_stage_that_never_touched_a_request_cannot_abort_it_on_another_node(
    pair: tuple[Node, Node],
) -> None:
    """Only a stage that wrote or reads a request may abort it. A node that does
    not know the request cannot check that, so its peers check the stages."""
    a, b = pair
    refs = _lines(run_worker(["write", "--socket", a.daemon.socket, "--request", "rst",
                              "--sizes", "300000"]))  # fmt: skip
    held = a.daemon.pool()["used_bytes"]
    assert held > 0

    async def stranger_aborts() -> None:
        async with RelayClient("stranger", b.daemon.socket) as c:
            await c.abort("rst")

    asyncio.run(stranger_aborts())
    assert a.daemon.pool()["used_bytes"] == held  # the writer's lease is still there
    line = refs[0]
    r = run_worker(["read", "--socket", b.daemon.socket], input=line.encode() + b"\n\n")
    assert _lines(r)[1:] == [line.split()[1]]  # and its reader reads it, bytes intact
    wait_until(lambda: a.used() == 0 and b.used() == 0, 10, "both arenas back to zero")


def test_second_read_of_a_pulled_ref_is_stale(pair: tuple[Node, Node]) -> None:
    a, b = pair
    refs = _lines(run_worker(["write", "--socket", a.daemon.socket, "--sizes", "300000"]))
    line = refs[0]
    r = run_worker(["read", "--socket", b.daemon.socket], input=line.encode() + b"\n\n")
    assert _lines(r)[1:] == [line.split()[1]]
    # The writer's lease is released in the background once the copy is verified.
    wait_until(lambda: a.used() == 0, 10, "the writer's lease to be released")
    r = run_worker(["read", "--socket", b.daemon.socket], input=line.encode() + b"\n\n")
    assert _lines(r)[1].startswith("ERR StaleRefError"), _lines(r)
    wait_until(lambda: b.used() == 0, 10, "the reader's arena back to zero")


@pytest.fixture
def netns() -> Iterator[_netns.Netns]:
    try:
        with _netns.netns_pair("d") as pair:
            yield pair
    except _netns.NetnsUnavailable as exc:
        pytest.skip(str(exc))


def test_two_daemons_in_separate_network_namespaces(
    tmp_path: pathlib.Path, netns: _netns.Netns
) -> None:
    """Different addresses on a veth pair, as on two hosts; clients reach their
    daemon's Unix socket from the root namespace (the filesystem is shared)."""
    token = _token(tmp_path, "token", "0123456789abcdef-shared-peer-token")
    nodes = []
    for i, name in enumerate(("ns-a", "ns-b")):
        d = tmp_path / name
        d.mkdir()
        daemon = Daemon(
            str(d),
            "--peer-address",
            f"{netns.addrs[i]}:9092",
            "--peers",
            f"{netns.addrs[1 - i]}:9092",
            "--peer-token-file",
            token,
            "--peer-timeout",
            str(PEER_TIMEOUT),
            node_id=name,
        )
        daemon.args[:0] = netns.wrap(i)
        nodes.append(daemon)
    a, b = nodes
    try:
        a.start()
        b.start()

        def up(d: Daemon, address: str) -> bool:
            return any(p.get("up") and p["address"] == address for p in d.status().get("peers", []))

        wait_until(lambda: up(b, f"{netns.addrs[0]}:9092"), 15, "the daemons to handshake")
        refs = _lines(
            run_worker(["write", "--socket", a.socket, "--split", "--sizes", f"{MiB},{8 * MiB}"])
        )
        r = run_worker(["read", "--socket", b.socket], input="\n".join(refs).encode() + b"\n\n")
        assert _lines(r)[1:] == [line.split()[1] for line in refs]
        # Mooncake advertises (and the reader dialled) node A's namespace address.
        assert b.status()["peers"][0]["mooncake_session"].startswith(netns.addrs[0] + ":")
    finally:
        for d in (b, a):
            if d.proc is not None and d.proc.poll() is None:
                d.stop()


def test_frozen_origin_daemon_is_peer_unavailable(pair: tuple[Node, Node]) -> None:
    """A writer's daemon that stops answering mid-stream (SIGSTOP) is the same error for the
    reader as a dead one: PeerUnavailableError, not a bare timeout."""
    a, b = pair
    refs, reader = _held_writes_and_reader(a, b, 2)
    wait_until(lambda: "thinker" in b.peer(a.address).get("stages", []), 10, "b to know thinker")
    send_line(reader, refs[0])
    assert read_line(reader, 10) == refs[0].split()[1]
    assert a.daemon.proc is not None
    a.daemon.proc.send_signal(signal.SIGSTOP)
    try:
        send_line(reader, refs[1])
        got = read_line(reader, PEER_TIMEOUT * 4 + 10)
        assert got.startswith("ERR PeerUnavailableError "), got
        wait_until(lambda: b.used() == 0, 10, "the reader's arena back to zero")
    finally:
        a.daemon.proc.send_signal(signal.SIGCONT)
    send_line(reader, "")
    assert reader.wait(timeout=10) == 0


def test_a_healthy_start_and_stop_log_no_engine_noise(pair: tuple[Node, Node]) -> None:
    """Mooncake's glog lines go through relayd's log; the ones every healthy start
    prints ("Local segment descriptor not found" at ERROR) are debug, not errors."""
    a, b = pair
    for node in (a, b):
        assert node.daemon.stop() == 0
        log = _log(node)  # the whole log: the engine line comes first
        assert not re.search(r"(?m)^[IWEF]\d{4} ", log), log
        assert " ERROR " not in log and "Local segment descriptor" not in log, log
        assert "mooncake engine up" in log


def _published(node: Node) -> int:
    return int(node.daemon.status().get("leases_by_state", {}).get("published", "0"))


def _log(node: Node) -> str:
    return pathlib.Path(node.daemon.log_path).read_text(errors="replace")


@pytest.fixture
def pull_pair(tmp_path: pathlib.Path) -> Iterator[tuple[Node, Node]]:
    """Two daemons that never push: every cross-node read is a pull."""
    env = {"RELAYD_PUSH_GRANT_SIZE": "0"}
    with running_pair(tmp_path, {"env": env}, {"env": env}) as nodes:
        yield nodes


def _readdress_then_read(a: Node, b: Node) -> None:
    async def scenario() -> None:
        async with (
            RelayClient("thinker", a.daemon.socket) as w,
            RelayClient("talker", b.daemon.socket) as r,
            RelayClient("eavesdropper", b.daemon.socket) as e,
        ):
            payload = make_payload(21, 2 * MiB)
            ref = await w.put(payload, to_stage="talker", request_id="victim")
            forged = pb.DataRef()
            forged.CopyFrom(ref.proto)
            forged.to_stage = "eavesdropper"
            try:
                # A pushed copy is refused at once; a pull may copy (Mooncake reads
                # need no consent of the writer's daemon, see SECURITY.md), but the
                # writer's daemon must not free the lease for a stage it is not for.
                await e.get(DataRef(forged))
            except PermissionDeniedError:
                pass
            else:
                await asyncio.to_thread(
                    wait_until,
                    lambda: "is addressed to stage 'talker'" in _log(a) or not _published(a),
                    15,
                    "node A to answer node B's release of the re-addressed lease",
                )
                assert _published(a) == 1, "node A freed the lease for another stage's reader"
            assert digest(await r.get(ref)) == digest(payload)

    asyncio.run(asyncio.wait_for(scenario(), 90))
    wait_until(lambda: a.used() == 0 and b.used() == 0, 15, "both arenas back to zero")


def test_a_readdressed_pulled_ref_does_not_free_the_real_readers_lease(
    pull_pair: tuple[Node, Node],
) -> None:
    _readdress_then_read(*pull_pair)
    a, _b = pull_pair
    assert "is addressed to stage 'talker'" in _log(a)


def test_a_readdressed_pushed_ref_is_refused(pair: tuple[Node, Node]) -> None:
    _readdress_then_read(*pair)


def test_a_forged_foreign_ref_is_refused_before_the_pull(pair: tuple[Node, Node]) -> None:
    a, b = pair

    async def scenario() -> None:
        async with (
            RelayClient("thinker", a.daemon.socket) as w,
            RelayClient("talker", b.daemon.socket) as r,
        ):
            for seed, forge in enumerate(
                (
                    lambda m: setattr(
                        m, "header", _codec.encode({"x": _header_tree.TensorSlot(1000)})
                    ),
                    lambda m: setattr(m.tensors[0], "offset", m.lease.length + (1 << 30)),
                )
            ):
                payload = make_payload(30 + seed, 2 * MiB)
                ref = await w.put(payload, to_stage="talker", request_id=f"real{seed}")
                forged = pb.DataRef()
                forged.CopyFrom(ref.proto)
                forge(forged)
                with pytest.raises(CorruptRefError):
                    await r.get(DataRef(forged))
                assert digest(await r.get(ref)) == digest(payload)

    asyncio.run(asyncio.wait_for(scenario(), 90))
    wait_until(lambda: a.used() == 0 and b.used() == 0, 15, "both arenas back to zero")
    # One pull per real read; the forged ones never reached the peer.
    assert b.daemon.status()["transfers_by_transport"]["mooncake"] == "2"
