"""Peer entries of a ``--peers`` name that resolves to addresses which change over
time (a Kubernetes headless service whose pods are replaced): two nodes in one
process on real parts (see ``test_peer_manager``), the name resolved by a
stand-in for DNS."""

from __future__ import annotations

import pathlib

import pytest

from relayd import peer_links
from relayd.transports.loopback import Loopback
from tests._daemon import free_port
from tests.unit.test_peer_manager import Node, _up, peer_token, run, until

pytestmark = pytest.mark.timeout(60)

SERVICE = "relayd.example.svc:9092"


def test_an_address_the_name_no_longer_resolves_to_is_dropped_once_down(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod was replaced: its old address, down and gone from the name, leaves the
    peer table (and stops being dialled); a live peer the name still names stays."""
    token = peer_token(tmp_path)
    loopback = Loopback()
    gone = f"127.0.0.1:{free_port()}"  # nothing listens there: a pod that went
    names: dict[str, list[str]] = {}
    monkeypatch.setattr(peer_links, "_resolve", lambda entry: list(names[entry]))
    monkeypatch.setattr(peer_links, "RESOLVE_INTERVAL", 0.05)

    async def main() -> None:
        a = Node("a", loopback, token)
        names[SERVICE] = [a.address, gone]
        b = Node("b", loopback, token, peers=(SERVICE,))
        try:
            await a.peers.start()
            await b.peers.start()
            links = b.peers.links
            await until(lambda: _up(b, a), "B to greet A")
            await until(lambda: gone in links.peers and links.peers[gone].last_error, "a dial")
            dialling = links.peers[gone].task
            assert dialling is not None
            names[SERVICE] = [a.address]
            await until(lambda: gone not in links.peers, "the gone address to leave", timeout=5.0)
            await until(dialling.done, "its dial loop to end", timeout=5.0)
            assert [address for address, _ in links.others()] == [a.address]
            assert _up(b, a)
        finally:
            for node in (b, a):
                await node.close()
                node.dispose()

    run(main())
