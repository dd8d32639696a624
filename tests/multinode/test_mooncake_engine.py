"""MooncakeTransport between two daemon-like processes.

Each peer is a separate process running this file as a script (see
``_peer_main``): it starts a MooncakeTransport on its own port, registers a
``/dev/shm`` file it mmaps, prints its session id and region address, then
answers JSON-line commands on stdin (fill, sha, pull, close). The test process
only orchestrates; it never touches Mooncake itself except in the in-process
tests at the end.

Tests that need Mooncake skip with a reason when ``mooncake.engine`` cannot be
imported. The network-namespace test runs only as root with ``ip`` available.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import hashlib
import json
import mmap
import os
import pathlib
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from relayd_client.wire.errors import (
    ErrorCode,
    InternalError,
    InvalidArgumentError,
    PeerUnavailableError,
    RelayError,
    RelayTimeoutError,
)

from relayd.config import Settings
from relayd.transports import mooncake as mc
from relayd.transports import mooncake_engine as engine
from relayd.transports.base import (
    MemoryRegion,
    PullError,
    PullFailedError,
    PullOp,
    PullTimeoutError,
    TransferState,
    TransportUnavailableError,
)
from relayd.transports.credits import CreditPool
from relayd_bench import _netns
from relayd_bench._netns import Netns
from tests._mooncake import requires_mooncake

pytestmark = pytest.mark.timeout(120)

PEER_TIMEOUT = 2.0
REGION = (64 << 20) + (1 << 20)  # 64 MiB plus room for unaligned offsets
SHM_PREFIX = f"relayd-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
REPO = pathlib.Path(__file__).resolve().parents[2]


# --- the peer process ---------------------------------------------------------------


def _peer_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--size", type=int, default=REGION)
    parser.add_argument("--timeout", type=float, default=PEER_TIMEOUT)
    parser.add_argument("--shm", required=True, help="file name under /dev/shm")
    args = parser.parse_args(argv)
    asyncio.run(_serve(args))


async def _serve(args: argparse.Namespace) -> None:
    path = pathlib.Path("/dev/shm") / args.shm
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, args.size)
        region = mmap.mmap(fd, args.size)
    finally:
        os.close(fd)
    anchor = ctypes.c_char.from_buffer(region)
    base = ctypes.addressof(anchor)
    settings = Settings(peer_address=f"{args.host}:0", peer_timeout=args.timeout)
    transport = mc.MooncakeTransport(settings)
    try:
        await transport.start()
        await transport.register(MemoryRegion(args.name, base, args.size))
        _reply({"session": transport.session_id, "addr": base, "size": args.size})
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            request = json.loads(line)
            if request["cmd"] == "close":
                started = time.monotonic()
                await transport.close()
                _reply({"closed_in": time.monotonic() - started})
                break
            _reply(await _handle(transport, region, base, request))
    finally:
        await transport.close()
        del anchor
        region.close()
        path.unlink(missing_ok=True)


async def _handle(
    transport: mc.MooncakeTransport, region: mmap.mmap, base: int, req: dict[str, Any]
) -> dict[str, Any]:
    cmd = req["cmd"]
    if cmd == "fill":
        data = os.urandom(req["length"])
        region[req["offset"] : req["offset"] + len(data)] = data
        return {"sha": hashlib.sha256(data).hexdigest()}
    if cmd == "sha":
        return {
            "sha": hashlib.sha256(region[req["offset"] : req["offset"] + req["length"]]).hexdigest()
        }
    if cmd == "pull":
        ops = [PullOp(base + lo, remote, n) for lo, remote, n in req["ops"]]
        then = [PullOp(base + lo, remote, n) for lo, remote, n in req.get("then", [])]
        started = time.monotonic()
        result: dict[str, Any] = {}
        try:
            await transport.pull(req["peer"], ops, timeout=req["timeout"], then=then)
            result["ok"] = True
        except RelayError as exc:
            result["elapsed"] = time.monotonic() - started
            result.update(ok=False, error=type(exc).__name__, message=str(exc))
            result["bases"] = [cls.__name__ for cls in type(exc).__mro__]
            if isinstance(exc, PullError):
                result["in_flight"] = exc.in_flight
                if exc.in_flight and req.get("wait_settled"):
                    await asyncio.wait_for(exc.settled, 60)
                    result["settled_after"] = time.monotonic() - started
        else:
            result["elapsed"] = time.monotonic() - started
        return result
    if cmd == "pull_concurrently":
        # Each entry is one pull of one op, all started at once, bounded by credits.
        credits = CreditPool(req["credits"])
        in_flight, peak = [0], [0]

        async def one(lo: int, remote: int, n: int) -> None:
            async with credits.acquire(req["peer"], timeout=30):
                in_flight[0] += 1
                peak[0] = max(peak[0], in_flight[0])
                try:
                    await transport.pull(req["peer"], [PullOp(base + lo, remote, n)], timeout=30)
                finally:
                    in_flight[0] -= 1

        await asyncio.gather(*(one(*op) for op in req["ops"]))
        return {"ok": True, "peak": peak[0]}
    raise ValueError(f"unknown command {cmd!r}")


def _reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


# --- the test side -------------------------------------------------------------------


@dataclasses.dataclass
class Peer:
    name: str
    proc: subprocess.Popen[bytes]
    log: pathlib.Path
    session: str = ""
    addr: int = 0

    def call(self, request: dict[str, Any], wait: float = 60.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        return self.read(wait)

    def read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            raise AssertionError(f"peer {self.name} gave no answer; its log:\n{self.tail()}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def tail(self) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])
        except OSError:
            return "(no log)"

    def fill(self, offset: int, length: int) -> str:
        return str(self.call({"cmd": "fill", "offset": offset, "length": length})["sha"])

    def sha(self, offset: int, length: int) -> str:
        return str(self.call({"cmd": "sha", "offset": offset, "length": length})["sha"])

    def pull(
        self,
        source: Peer,
        ops: list[tuple[int, int, int]],
        timeout: float = 30.0,
        then: list[tuple[int, int, int]] = [],  # noqa: B006 - read only
        **extra: Any,
    ) -> dict[str, Any]:
        """``ops`` and ``then`` = (our offset, their offset, length)."""
        wire = [[lo, source.addr + ro, n] for lo, ro, n in ops]
        after = [[lo, source.addr + ro, n] for lo, ro, n in then]
        request = {"cmd": "pull", "peer": source.session, "ops": wire, "timeout": timeout}
        request["then"] = after
        return self.call({**request, **extra}, wait=timeout + 70)

    def stop(self) -> None:
        with contextlib.suppress(OSError, AssertionError, ValueError):
            if self.proc.poll() is None:
                self.call({"cmd": "close"}, wait=20)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=20)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


PeerFactory = Callable[..., Peer]


@pytest.fixture
def spawn_peer(tmp_path: pathlib.Path) -> Iterator[PeerFactory]:
    """Start peer processes; stop them and remove their /dev/shm files afterwards."""
    peers: list[Peer] = []

    def spawn(name: str, host: str = "127.0.0.1", wrap: tuple[str, ...] = ()) -> Peer:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        log = tmp_path / f"{name}.log"
        with log.open("wb") as err:
            proc = subprocess.Popen(
                [*wrap, sys.executable, __file__, "--name", name, "--host", host,
                 "--shm", f"{SHM_PREFIX}-{name}"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, cwd=REPO,
            )  # fmt: skip
        peer = Peer(name, proc, log)
        peers.append(peer)
        info = peer.read(60)
        peer.session, peer.addr = info["session"], info["addr"]
        return peer

    try:
        yield spawn
    finally:
        for peer in peers:
            if peer.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(peer.proc.pid, signal.SIGCONT)
            peer.stop()
        for leftover in pathlib.Path("/dev/shm").glob(f"{SHM_PREFIX}-*"):
            leftover.unlink(missing_ok=True)


@pytest.fixture
def pair(spawn_peer: PeerFactory) -> tuple[Peer, Peer]:
    return spawn_peer("a"), spawn_peer("b")


def _assert_failed_fast(reply: dict[str, Any], bound: float) -> None:
    assert not reply["ok"], reply
    assert {"PeerUnavailableError", "RelayTimeoutError"} & set(reply["bases"]), reply
    # A hang check, not a performance assertion.
    assert reply["elapsed"] < bound, reply


@requires_mooncake
@pytest.mark.multinode
@pytest.mark.parametrize("size", [1, 4 << 10, 1 << 20, 16 << 20, 64 << 20])
def test_pull_is_byte_exact(pair: tuple[Peer, Peer], size: int) -> None:
    a, b = pair
    expected = a.fill(5, size)  # unaligned on both sides
    reply = b.pull(a, [(3, 5, size)])
    assert reply["ok"], reply
    assert b.sha(3, size) == expected


@requires_mooncake
@pytest.mark.multinode
def test_batched_pull_of_several_ops(pair: tuple[Peer, Peer]) -> None:
    a, b = pair
    # (their offset, our offset, length): scattered, odd sizes, written in reverse order.
    layout = [
        (0, 40 << 20, 1),
        (1 << 20, 30 << 20, (100 << 10) + 1),
        (3 << 20, 20 << 20, 1 << 20),
        (8 << 20, 7, 3 << 20),
        (12 << 20, 50 << 20, 9 << 20),
    ]
    expected = [a.fill(ro, n) for ro, _, n in layout]
    reply = b.pull(a, [(lo, ro, n) for ro, lo, n in reversed(layout)])
    assert reply["ok"], reply
    assert [b.sha(lo, n) for _, lo, n in layout] == expected


@requires_mooncake
@pytest.mark.multinode
def test_then_ops_land_after_the_body_and_never_start_after_it_failed(
    pair: tuple[Peer, Peer],
) -> None:
    a, b = pair
    body, flag = a.fill(0, 3 << 20), a.fill(5 << 20, 16)
    reply = b.pull(a, [(8 << 20, 0, 3 << 20)], then=[(12 << 20, 5 << 20, 16)])
    assert reply["ok"], reply
    assert (b.sha(8 << 20, 3 << 20), b.sha(12 << 20, 16)) == (body, flag)
    # The body fails (its remote range is not registered): the flag is never read.
    before = b.fill(13 << 20, 16)
    reply = b.pull(a, [(0, REGION - 10, 11)], then=[(13 << 20, 5 << 20, 16)], timeout=PEER_TIMEOUT)
    assert reply["error"] == "PullFailedError" and reply["in_flight"] is False, reply
    assert b.sha(13 << 20, 16) == before
    # A body-less pull is its "then" alone.
    assert b.pull(a, [], then=[(14 << 20, 5 << 20, 16)])["ok"]
    assert b.sha(14 << 20, 16) == flag


@requires_mooncake
@pytest.mark.multinode
def test_many_concurrent_pulls_bounded_by_credits(pair: tuple[Peer, Peer]) -> None:
    a, b = pair
    sizes = [(i * 37 % 5 + 1) * (97 << 10) + i for i in range(40)]  # 97 KiB .. 485 KiB
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    expected = a.fill(0, sum(sizes))
    wire = [[(20 << 20) + off, a.addr + off, n] for off, n in zip(offsets, sizes, strict=True)]
    request = {"cmd": "pull_concurrently", "peer": a.session, "ops": wire, "credits": 4}
    reply = b.call(request, wait=90)
    assert reply == {"ok": True, "peak": 4}, reply
    assert b.sha(20 << 20, sum(sizes)) == expected


@requires_mooncake
@pytest.mark.multinode
def test_both_daemons_pull_from_each_other(pair: tuple[Peer, Peer]) -> None:
    a, b = pair
    from_a, from_b = a.fill(0, 1 << 20), b.fill(2 << 20, 1 << 20)
    assert b.pull(a, [(4 << 20, 0, 1 << 20)])["ok"]
    assert a.pull(b, [(4 << 20, 2 << 20, 1 << 20)])["ok"]
    assert (b.sha(4 << 20, 1 << 20), a.sha(4 << 20, 1 << 20)) == (from_a, from_b)


@requires_mooncake
@pytest.mark.multinode
def test_pull_outside_registered_region_is_rejected_before_submit(
    pair: tuple[Peer, Peer],
) -> None:
    a, b = pair
    reply = b.pull(a, [(REGION - 10, 0, 11)])
    assert reply["error"] == "InvalidArgumentError", reply


@requires_mooncake
@pytest.mark.multinode
def test_remote_range_not_registered_fails_without_hang(pair: tuple[Peer, Peer]) -> None:
    a, b = pair
    reply = b.pull(a, [(0, REGION - 10, 11)], timeout=PEER_TIMEOUT)
    _assert_failed_fast(reply, 3 * PEER_TIMEOUT)
    assert reply["error"] == "PullFailedError" and reply["in_flight"] is False, reply
    assert b.pull(a, [(0, 0, 4096)])["ok"]  # the engine stays usable


@requires_mooncake
@pytest.mark.multinode
def test_pull_from_killed_peer_fails_within_timeout(pair: tuple[Peer, Peer]) -> None:
    a, b = pair
    assert b.pull(a, [(0, 0, 1 << 20)])["ok"]  # the session is warm
    a.proc.kill()
    a.proc.wait(timeout=20)
    for _ in range(3):  # the first call and the ones after the reconnect cooldown
        reply = b.pull(a, [(0, 0, 1 << 20)], timeout=PEER_TIMEOUT)
        _assert_failed_fast(reply, 3 * PEER_TIMEOUT)
        assert reply["in_flight"] is False, reply


@requires_mooncake
@pytest.mark.multinode
def test_pull_from_peer_that_died_before_first_contact(spawn_peer: PeerFactory) -> None:
    a, b = spawn_peer("a"), spawn_peer("b")
    a.proc.kill()
    a.proc.wait(timeout=20)
    reply = b.pull(a, [(0, 0, 4096)], timeout=PEER_TIMEOUT)
    _assert_failed_fast(reply, 3 * PEER_TIMEOUT)


@requires_mooncake
@pytest.mark.multinode
def test_hung_peer_times_out_in_flight_then_settles(pair: tuple[Peer, Peer]) -> None:
    a, b = pair
    assert b.pull(a, [(0, 0, 1 << 20)])["ok"]  # warm: a hung first contact costs 60 s
    os.kill(a.proc.pid, signal.SIGSTOP)
    try:
        reply = b.pull(a, [(0, 0, 16 << 20)], timeout=1.0, wait_settled=True)
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    assert reply["error"] == "PullTimeoutError", reply
    assert reply["in_flight"] is True, reply
    assert reply["elapsed"] < 3 * 1.0, reply
    # Mooncake fails the stuck transfer after MC_TCP_STATUS_TIMEOUT_SEC = peer_timeout.
    assert reply["settled_after"] < 3 * PEER_TIMEOUT, reply
    expected = a.fill(0, 1 << 20)
    assert b.pull(a, [(0, 0, 1 << 20)])["ok"]
    assert b.sha(0, 1 << 20) == expected


@pytest.fixture
def netns_pair() -> Iterator[Netns]:
    """Two network namespaces joined by a veth pair; removed afterwards."""
    try:
        with _netns.netns_pair() as pair:
            yield pair
    except _netns.NetnsUnavailable as exc:
        pytest.skip(str(exc))


@requires_mooncake
@pytest.mark.multinode
def test_pull_across_network_namespaces(spawn_peer: PeerFactory, netns_pair: Netns) -> None:
    (ns_a, ns_b), (ip_a, ip_b) = netns_pair.names, netns_pair.addrs
    a = spawn_peer("a", host=ip_a, wrap=("ip", "netns", "exec", ns_a))
    b = spawn_peer("b", host=ip_b, wrap=("ip", "netns", "exec", ns_b))
    assert a.session.startswith(f"{ip_a}:") and b.session.startswith(f"{ip_b}:")
    expected = a.fill(1, 16 << 20)
    assert b.pull(a, [(0, 1, 16 << 20)])["ok"]
    assert b.sha(0, 16 << 20) == expected
    a.proc.kill()
    a.proc.wait(timeout=20)
    _assert_failed_fast(b.pull(a, [(0, 0, 4096)], timeout=PEER_TIMEOUT), 3 * PEER_TIMEOUT)


# --- in one process: lifecycle and error paths -------------------------------------------


def _anonymous_region(name: str, size: int) -> tuple[mmap.mmap, ctypes.c_char, MemoryRegion]:
    buf = mmap.mmap(-1, size)
    anchor = ctypes.c_char.from_buffer(buf)
    return buf, anchor, MemoryRegion(name, ctypes.addressof(anchor), size)


@requires_mooncake
@pytest.mark.multinode
def test_session_id_is_the_advertised_host_and_rpc_port() -> None:
    """The rest of the lifecycle is the contract's: tests/unit/test_transport_contract.py."""

    async def main() -> None:
        settings = Settings(peer_address="127.0.0.1:0", peer_timeout=PEER_TIMEOUT)
        async with mc.MooncakeTransport(settings) as a:
            host, port = a.session_id.rsplit(":", 1)
            assert host == "127.0.0.1" and int(port) > 0

    asyncio.run(asyncio.wait_for(main(), 60))


@requires_mooncake
@pytest.mark.multinode
def test_silent_peer_quarantines_until_the_submit_ends() -> None:
    """A "peer" that accepts TCP and never answers holds Mooncake's first-contact
    handshake (60 s, no knob) inside the submit: the pull must still return at its
    deadline, say the op may be in flight, and settle once the submit ends."""

    async def main() -> None:
        settings = Settings(peer_address="127.0.0.1:0", peer_timeout=PEER_TIMEOUT)
        buf, anchor, region = _anonymous_region("r", 1 << 20)
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel accepts; nobody ever reads or answers
        peer = f"127.0.0.1:{silent.getsockname()[1]}"
        transport = mc.MooncakeTransport(settings)
        try:
            await transport.start()
            await transport.register(region)
            first = asyncio.ensure_future(
                transport.pull(peer, [PullOp(region.base, 4096, 4096)], timeout=1.0)
            )
            second = asyncio.ensure_future(
                transport.pull(peer, [PullOp(region.base + 8192, 4096, 4096)], timeout=1.0)
            )
            started = time.monotonic()
            results = await asyncio.gather(first, second, return_exceptions=True)
            assert time.monotonic() - started < 3.0
            stuck, queued = results
            assert isinstance(stuck, PullTimeoutError) and stuck.in_flight, stuck
            # Only one submit per unreached peer runs; the other never left the queue.
            assert isinstance(queued, PullTimeoutError) and not queued.in_flight, queued
            assert queued.settled.done() and not stuck.settled.done()
            silent.close()  # the handshake sees EOF and the submit fails
            await asyncio.wait_for(stuck.settled, 30)
            await asyncio.wait_for(transport.wait_settled([PullOp(region.base, 1, 1 << 20)]), 5)
        finally:
            silent.close()
            await transport.close()
            del anchor
            buf.close()

    asyncio.run(asyncio.wait_for(main(), 90))


# --- without Mooncake: pure logic -----------------------------------------------------


def test_importing_the_module_does_not_import_mooncake() -> None:
    code = "import sys, relayd.transports.mooncake; assert 'mooncake' not in sys.modules"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, timeout=60
    )
    assert done.returncode == 0, done.stderr.decode()


def test_environment_is_derived_from_settings() -> None:
    env = mc.mooncake_environment(Settings(peer_timeout=2.5, mooncake_protocol="tcp"), {})
    assert env["MC_TCP_STATUS_TIMEOUT_SEC"] == "3"
    assert env["MC_HANDSHAKE_CONNECT_TIMEOUT"] == "3"
    assert env["MC_TRANSFER_TIMEOUT"] == "5"  # Mooncake's floor
    assert env["MC_FORCE_TCP"] == "1" and env["MC_FORCE_HCA"] is None
    assert env["MC_LOG_LEVEL"] == "WARNING"
    rdma = mc.mooncake_environment(
        Settings(peer_timeout=60, mooncake_protocol="rdma", log_level="debug"),
        {"MC_LOG_LEVEL": "TRACE"},
    )
    assert rdma["MC_FORCE_TCP"] is None and rdma["MC_FORCE_HCA"] == "1"
    assert rdma["MC_TRANSFER_TIMEOUT"] == "60"
    assert "MC_LOG_LEVEL" not in rdma  # the operator's own value stays


@pytest.mark.parametrize(
    ("address", "host"),
    [("", "127.0.0.1"), ("10.0.0.5:7070", "10.0.0.5"), ("[fd00::5]:7070", "fd00::5"),
     ("node-a.cluster:1", "node-a.cluster"), ("fd00::5", "fd00::5")],
)  # fmt: skip
def test_advertised_host(address: str, host: str) -> None:
    assert mc.advertised_host(address) == host


@pytest.mark.parametrize("address", ["0.0.0.0:7070", "[::]:7070", ":7070"])
def test_wildcard_peer_address_is_refused(address: str) -> None:
    with pytest.raises(InvalidArgumentError, match="routable"):
        mc.advertised_host(address)


def test_return_codes_map_to_typed_errors() -> None:
    assert isinstance(engine.mooncake_error(engine.Call.REGISTER, -7, "x"), InvalidArgumentError)
    assert isinstance(engine.mooncake_error(engine.Call.SUBMIT, 0, "x"), PeerUnavailableError)
    assert isinstance(
        engine.mooncake_error(engine.Call.INITIALIZE, -1, "x"), TransportUnavailableError
    )
    assert [engine.transfer_state(rc) for rc in (1, 0, -1, -2)] == [
        TransferState.DONE, TransferState.PENDING, TransferState.FAILED, TransferState.TIMEOUT,
    ]  # fmt: skip
    assert not TransferState.TIMEOUT.terminal  # bytes may still land
    with pytest.raises(InternalError):
        engine.transfer_state(7)
    assert issubclass(PullTimeoutError, RelayTimeoutError) and issubclass(PullError, RelayError)
    # They cross the wire as the codes of the classes they refine.
    assert PullFailedError.code is ErrorCode.PEER_UNAVAILABLE
    assert PullTimeoutError.code is ErrorCode.TIMEOUT


def test_preflight_names_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    problem = mc.preflight(Settings())
    assert problem is not None and engine.PACKAGE in problem
    monkeypatch.delitem(sys.modules, "mooncake.engine")
    rdma = Settings(mooncake_protocol="rdma", mooncake_device="mlx5_0")
    assert "no RDMA device" in (mc.rdma_problem(rdma, infiniband=tmp_path / "none") or "")
    (tmp_path / "mlx5_1").mkdir()
    assert "mlx5_0" in (mc.rdma_problem(rdma, infiniband=tmp_path) or "")
    (tmp_path / "mlx5_0").mkdir()
    assert mc.rdma_problem(rdma, infiniband=tmp_path) is None
    assert mc.rdma_problem(Settings(mooncake_protocol="tcp"), infiniband=tmp_path / "x") is None


if __name__ == "__main__":
    _peer_main(sys.argv[1:])
