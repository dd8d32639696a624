"""The relayd daemon the relayd methods talk to: started here, or an already running one.

Started: ``relayd.launch.DaemonProcess`` serving on ``<tmp>/relayd.sock`` with a
``--shm-pool-size 512MiB`` arena, in its own session (a Ctrl-C at the terminal
reaches the benchmark, which then stops the daemon with SIGTERM so it drains and
unlinks its segments). Ready means the standard gRPC health service answers SERVING.

A pair (:func:`start_pair`, for relayd-mooncake) is two such daemons as two nodes
on loopback, configured as the two-daemon tests do: distinct node ids (so distinct
arena names) and sockets, each with its Peer service on a free 127.0.0.1 port and
the other as its static peer, one shared token file (0600). Ready means both are
SERVING and each reports the other up (the handshake swapped Mooncake sessions).
With ``--netns`` each runs in its own network namespace (``ip netns exec``) with
its Peer service on its namespace's address, so peer calls and Mooncake cross the
veth link between them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relayd_client.wire import paths as wire_paths
from relayd_client.wire.peercred import peer_credentials

from relayd.launch import DaemonProcess, DaemonStartError, wait_serving
from relayd_bench._netns import Netns

SHM_DIR = Path(wire_paths.SHM_DIR)
STOP_TIMEOUT_S = 15.0
POLL_S = 0.05
PEER_HOST = "127.0.0.1"
NETNS_PEER_PORT = 9092  # each namespace is fresh: nothing else listens there


class DaemonError(RuntimeError):
    """The daemon could not be started or reached; the message says why."""


@dataclasses.dataclass
class Daemon:
    socket: str
    pid: int | None
    process: DaemonProcess | None = None  # None: a daemon the bench did not start
    exit_code: int | None = None
    leftover_segments: tuple[str, ...] = ()
    transfers: dict[str, int] | None = None  # transfers_by_transport just before the stop
    _owned: frozenset[str] | None = None

    @property
    def started(self) -> bool:
        return self.process is not None

    def log_tail(self, lines: int = 15) -> str:
        if self.process is None:
            return ""
        return "\n".join(self.process.log_tail().splitlines()[-lines:])

    def record_transfers(self) -> None:
        """Remember how many transfers the daemon moved over each transport (best effort)."""
        try:
            counts = status(self.socket).get("transfers_by_transport", {})
        except Exception:  # gone or unreachable: the results say so by the missing counts
            return
        self.transfers = {str(k): int(v) for k, v in counts.items()}

    def terminate(self) -> None:
        """Send SIGTERM (drain) without waiting, so several daemons drain at once."""
        if self.process is None or self.process.proc is None or self._owned is not None:
            return
        # Ours are the segments it has open: other daemons may share this host's /dev/shm.
        self._owned = shm_files_of(self.process.pid)
        self.process.terminate()

    def stop(self) -> None:
        """SIGTERM (drain), then SIGKILL after a grace period; note segments it left behind."""
        if self.process is None or self.process.proc is None:
            return
        self.terminate()
        self.exit_code = self.process.stop(timeout_s=STOP_TIMEOUT_S)
        owned = self._owned or frozenset()
        self.leftover_segments = tuple(sorted(n for n in owned if os.path.exists(SHM_DIR / n)))

    def describe(self) -> dict[str, object]:
        return {
            "socket": self.socket,
            "pid": self.pid,
            "started_by_bench": self.started,
            "exit_code": self.exit_code,
            "leftover_segments": list(self.leftover_segments),
            "transfers_by_transport": self.transfers,
        }

    def _await_ready(self, timeout_s: float) -> None:
        """Wait until it serves; on failure stop it and say why, with its last log lines."""
        assert self.process is not None
        try:
            wait_serving(self.socket, timeout_s, self.process.proc)
        except BaseException as exc:
            self.stop()
            said = " | ".join(
                line.strip() for line in self.log_tail(5).splitlines() if line.strip()
            )
            raise DaemonError(f"{exc}: {said}" if said else str(exc)) from exc


def stop_all(daemons: Sequence[Daemon]) -> None:
    """Stop several daemons, draining at the same time."""
    for d in daemons:
        d.terminate()
    for d in daemons:
        d.stop()


def shm_files_of(pid: int) -> frozenset[str]:
    """Names of the /dev/shm files a process has mapped or open (and not yet unlinked)."""
    prefix = f"{SHM_DIR}/"
    paths: list[str] = []
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps", encoding="utf-8") as f:
        paths += [line.split(maxsplit=5)[-1].rstrip("\n") for line in f]
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                paths.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return frozenset(
        p[len(prefix) :] for p in paths if p.startswith(prefix) and not p.endswith(" (deleted)")
    )


def _spawn(
    tmpdir: Path,
    pool_size: str,
    name: str,
    args: Sequence[str] = (),
    prefix: Sequence[str] = (),
    settings: dict[str, object] | None = None,
) -> Daemon:
    # `ip netns exec` execs the command, so the pid stays the daemon's
    process = DaemonProcess.serve(
        str(tmpdir / f"{name}.sock"),
        *args,
        settings={"shm_pool_size": pool_size, **(settings or {})},
        prefix=prefix,
        log_path=str(tmpdir / f"{name}.log"),
        new_session=True,
    )
    process.spawn()
    return Daemon(process.socket, process.pid, process)


def start(
    tmpdir: Path,
    pool_size: str,
    timeout_s: float,
    settings: dict[str, object] | None = None,
    prefix: Sequence[str] = (),
) -> Daemon:
    """One daemon; ``prefix`` runs it through a wrapper (``relayd_bench._turns``)."""
    d = _spawn(tmpdir, pool_size, "relayd", settings=settings, prefix=prefix)
    d._await_ready(timeout_s)
    return d


def start_pair(
    tmpdir: Path,
    pool_size: str,
    timeout_s: float,
    node_prefix: str,
    netns: Netns | None = None,
    prefix: Sequence[str] = (),
) -> tuple[Daemon, Daemon]:
    """The writer's and the reader's daemon, Mooncake peers on loopback or across the
    namespaces' link (see the module doc); ``prefix`` runs each through a wrapper
    (``relayd_bench._timeline``), inside its namespace."""
    token = tmpdir / "peer-token"
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    if netns is None:
        addresses = [f"{PEER_HOST}:{port}" for port in free_ports(2)]
    else:
        addresses = [f"{addr}:{NETNS_PEER_PORT}" for addr in netns.addrs]
    deadline = time.monotonic() + timeout_s
    daemons: list[Daemon] = []
    try:
        for k, role in enumerate(("writer", "reader")):
            args = ["--node-id", f"{node_prefix}-{role}", "--peer-address", addresses[k]]
            args += ["--peers", addresses[1 - k], "--peer-token-file", str(token)]
            inside = netns.wrap(k) if netns is not None else []
            daemons.append(_spawn(tmpdir, pool_size, f"relayd-{role}", args, [*inside, *prefix]))
        for d in daemons:  # both start up at once; each waits out what is left of the budget
            d._await_ready(max(deadline - time.monotonic(), 0.0))
        writer, reader = daemons
        wait_peered(writer, addresses[1], deadline)
        wait_peered(reader, addresses[0], deadline)
    except BaseException:
        stop_all(daemons)
        raise
    return writer, reader


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on loopback right now (held together, so distinct)."""
    held = [socket.socket() for _ in range(n)]
    try:
        for s in held:
            s.bind((PEER_HOST, 0))
        return [int(s.getsockname()[1]) for s in held]
    finally:
        for s in held:
            s.close()


def wait_peered(d: Daemon, peer_address: str, deadline: float) -> None:
    """Until ``d`` reports the peer at ``peer_address`` up, or DaemonError at ``deadline``."""
    why = "not listed yet"
    while True:
        if d.process is not None and not d.process.running():
            raise DaemonError(f"{d.socket}: relayd exited with code {d.process.exit_code}")
        try:
            peers = status(d.socket).get("peers", [])
        except Exception as exc:  # grpc.RpcError, or the daemon going away
            peers, why = [], f"status: {exc}"
        for p in peers:
            if p.get("address") == peer_address:
                if p.get("up"):
                    return
                why = f"down: {p.get('last_error') or 'no handshake yet'}"
        if time.monotonic() > deadline:
            raise DaemonError(f"{d.socket} does not see its peer {peer_address} ({why})")
        time.sleep(POLL_S)


def status(sock: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """The daemon's Status reply as a dict (proto field names)."""
    from google.protobuf.json_format import MessageToDict

    from relayd.operator import operator_session

    with operator_session(sock, timeout_s) as op:
        reply = op.status(timeout_s)
    result: dict[str, Any] = MessageToDict(reply, preserving_proto_field_name=True)
    return result


def attach(sock: str, timeout_s: float) -> Daemon:
    """An already running daemon: check it answers, and find its pid for CPU accounting."""
    wait_ready(sock, timeout_s)
    return Daemon(sock, peer_pid(sock))


def peer_pid(path: str) -> int | None:
    """The pid listening on a Unix socket (SO_PEERCRED), so --socket needs no --pid."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(2.0)
        s.connect(path)
        return peer_credentials(s)[0] or None
    except OSError:
        return None
    finally:
        s.close()


def wait_ready(sock: str, timeout_s: float) -> None:
    try:
        wait_serving(sock, timeout_s)
    except DaemonStartError as exc:
        raise DaemonError(str(exc)) from None
