"""Two network namespaces joined by a veth pair: two "nodes" on one host.

The bench's ``--netns`` run and the multinode tests both use this. Every name is
unique to the call (namespaces and veth ends), the addresses are private
(10.213.0.0/16) and exist only inside the two namespaces, and everything created
is removed on the way out, whatever ends the block (an error, Ctrl-C).

A process or thread joins a namespace with :func:`enter` (``setns(2)`` applies to
the calling thread only); :func:`socket_in` creates a socket inside one without
moving the caller, and :func:`tcp_pair` gives two connected TCP sockets whose
traffic crosses the veth link, one end in each namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import secrets
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/var/run/netns"
SUBNET_PREFIX = "10.213"  # private; only ever configured inside the pair's namespaces
STEP_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 10.0


class NetnsUnavailable(Exception):
    """This host cannot create them (not root, no iproute2, no permission)."""


@dataclasses.dataclass(frozen=True)
class Netns:
    names: tuple[str, str]
    addrs: tuple[str, str]
    devs: tuple[str, str] = ("", "")  # the veth ends, one in each namespace

    def link(self, i: int, up: bool) -> None:
        """Take namespace ``i``'s end of the veth pair down or up."""
        cmd = ["ip", "-n", self.names[i], "link", "set", self.devs[i], "up" if up else "down"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=STEP_TIMEOUT_S)

    def tx_bytes(self, i: int) -> int:
        """Bytes namespace ``i``'s end of the veth has sent so far."""
        cmd = ["ip", "-n", self.names[i], "-j", "-s", "link", "show", "dev", self.devs[i]]
        done = subprocess.run(
            cmd, check=True, capture_output=True, text=True, timeout=STEP_TIMEOUT_S
        )
        [link] = json.loads(done.stdout)
        return int(link["stats64"]["tx"]["bytes"])

    def wrap(self, i: int) -> list[str]:
        """Prefix that runs a command inside namespace ``i``."""
        return ["ip", "netns", "exec", self.names[i]]


def check_available() -> None:
    """NetnsUnavailable unless this process may create namespaces with iproute2."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsUnavailable(f"network namespaces need iproute2 ({', '.join(missing)} missing)")


@contextlib.contextmanager
def netns_pair(suffix: str = "", rate: str | None = None) -> Iterator[Netns]:
    """Only namespaces and links created here are touched, and all are removed after.

    ``rate`` (e.g. ``"10gbit"``) shapes both ends of the veth with a token bucket
    (``tc ... tbf``), as a NIC of that speed would.
    """
    check_available()
    tag = secrets.token_hex(3) + suffix[:3]  # veth names: at most 15 characters
    names = (f"relaydt{tag}a", f"relaydt{tag}b")
    subnet = f"{SUBNET_PREFIX}.{secrets.randbelow(250)}"
    addrs = (f"{subnet}.1", f"{subnet}.2")
    veth = (f"rdt{tag}a", f"rdt{tag}b")
    steps = [
        ["ip", "netns", "add", names[0]],
        ["ip", "netns", "add", names[1]],
        ["ip", "link", "add", veth[0], "netns", names[0], "type", "veth",
         "peer", "name", veth[1], "netns", names[1]],
    ]  # fmt: skip
    for ns, dev, addr in zip(names, veth, addrs, strict=True):
        steps += [
            ["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev],
            ["ip", "-n", ns, "link", "set", dev, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
        ]
        if rate:
            steps.append(
                ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                 "burst", "1mb", "latency", "10ms"]
            )  # fmt: skip
    try:
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
            if done.returncode != 0:
                raise NetnsUnavailable(
                    f"cannot set up network namespaces: {' '.join(step)}: {done.stderr.strip()}"
                )
        yield Netns(names, addrs, veth)
    finally:
        # deleting a namespace deletes its veth end, and with it the other end
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=STEP_TIMEOUT_S)


def enter(name: str) -> None:
    """Move the calling thread into namespace ``name`` (new sockets are created there)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def socket_in(name: str) -> socket.socket:
    """A TCP socket created inside namespace ``name``; the caller stays where it is."""
    made: list[socket.socket] = []
    failed: list[BaseException] = []

    def create() -> None:  # a thread of its own, so only it changes namespace
        try:
            enter(name)
            made.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        except BaseException as exc:
            failed.append(exc)

    t = threading.Thread(target=create, name="relayd-netns-socket")
    t.start()
    t.join(STEP_TIMEOUT_S)
    if failed:
        raise failed[0]
    if not made:
        raise OSError(f"no socket created in network namespace {name}")
    return made[0]


def tcp_pair(names: tuple[str, str], listen_addr: str) -> tuple[socket.socket, socket.socket]:
    """Two connected TCP sockets: the first in ``names[0]`` (at ``listen_addr``), the
    second in ``names[1]``; what one sends crosses the veth link to the other."""
    listener = socket_in(names[0])
    client = socket_in(names[1])
    try:
        listener.settimeout(CONNECT_TIMEOUT_S)
        client.settimeout(CONNECT_TIMEOUT_S)
        listener.bind((listen_addr, 0))
        listener.listen(1)
        client.connect(listener.getsockname())
        server, _ = listener.accept()
    except BaseException:
        client.close()
        raise
    finally:
        listener.close()
    for s in (server, client):
        s.settimeout(None)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return server, client
