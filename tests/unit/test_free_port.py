"""The tests' port picker stays out of the ranges other listeners draw from at random."""

from __future__ import annotations

import socket

from tests._daemon import MOONCAKE_RPC_PORTS, free_port


def test_ports_are_bindable_distinct_and_outside_mooncakes_rpc_range() -> None:
    # A daemon's Mooncake engine listens on a random port of its RPC range;
    # a metrics port picked there was once taken between pick and bind.
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert not [p for p in ports if p in MOONCAKE_RPC_PORTS]
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
