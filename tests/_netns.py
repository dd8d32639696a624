"""Two network namespaces joined by a veth pair, for tests of two "nodes" on one host."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
from collections.abc import Iterator


class NetnsUnavailable(Exception):
    """This host cannot create them (not root, no iproute2, no permission)."""


@dataclasses.dataclass
class Netns:
    names: tuple[str, str]
    addrs: tuple[str, str]
    devs: tuple[str, str] = ("", "")  # the veth ends, one in each namespace

    def link(self, i: int, up: bool) -> None:
        """Take namespace ``i``'s end of the veth pair down or up."""
        cmd = ["ip", "-n", self.names[i], "link", "set", self.devs[i], "up" if up else "down"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=30)

    def wrap(self, i: int) -> list[str]:
        """Prefix that runs a command inside namespace ``i``."""
        return ["ip", "netns", "exec", self.names[i]]


@contextlib.contextmanager
def netns_pair(suffix: str = "", rate: str | None = None) -> Iterator[Netns]:
    """Only namespaces and links created here are touched, and all are removed after.

    ``rate`` (e.g. ``"10gbit"``) shapes both ends of the veth with a token bucket
    (``tc ... tbf``), as a NIC of that speed would.
    """
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise NetnsUnavailable("network namespaces need root and iproute2")
    tag = f"{os.getpid() % 100000}{suffix}"
    names = (f"relaydt{tag}a", f"relaydt{tag}b")
    subnet = f"10.213.{(os.getpid() + len(suffix) * 7) % 250}"
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
            done = subprocess.run(step, capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                raise NetnsUnavailable(
                    f"cannot set up network namespaces: {' '.join(step)}: {done.stderr}"
                )
        yield Netns(names, addrs, veth)
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
