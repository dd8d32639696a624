"""Push to the consumer's node: two real daemons, real Mooncake, real clients.

The consumer stage (``talker``) attaches to node B first, so node A knows it is
served there; A's writer then puts, A's daemon writes the bytes into its push
grant at B, and B's reader finds a local lease. Pull stays the fallback.
"""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import grpc
import pytest
from relayd_client import AbortedError, RelayClient
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.proto import relay_pb2_grpc as pb_grpc

from tests._daemon import wait_until
from tests._mooncake import requires_mooncake
from tests._workers import digest, make_payload
from tests.multinode.test_two_daemons import (
    TOKEN,
    MiB,
    Node,
    _metric,
    start_pair,
    stop_pair,
)

pytestmark = [
    pytest.mark.multinode,
    pytest.mark.timeout(120),
    requires_mooncake,
]


def _pair(
    tmp: pathlib.Path, b_env: dict[str, str], a_env: dict[str, str] | None = None
) -> tuple[Node, Node]:
    return start_pair(tmp, {"metrics": True, "env": a_env}, {"metrics": True, "env": b_env})


@pytest.fixture
def nodes(tmp_path: pathlib.Path, request: pytest.FixtureRequest) -> Any:
    """Node A (the writer's) and B; a param is B's environment, or (B's, A's)."""
    param = getattr(request, "param", {})
    b_env, a_env = param if isinstance(param, tuple) else (param, None)
    a, b = _pair(tmp_path, b_env, a_env)
    try:
        yield a, b
    finally:
        stop_pair(a, b)


def _count(node: Node, other: Node, field: str) -> int:
    return int(node.peer(other.address).get(field, 0))


def _pulls(node: Node) -> float:
    return _metric(node.daemon.scrape(), "relayd_mooncake_pull_seconds_count") or 0.0


def _ready_to_push(a: Node, b: Node) -> None:
    wait_until(lambda: "talker" in a.peer(b.address).get("stages", []), 10, "a to know talker")
    wait_until(lambda: _count(a, b, "push_grant_bytes") > 0, 10, "a push grant at b")


def _free_but_grant(a: Node, b: Node) -> bool:
    """No leases on either node, and each arena free but for the push grant the
    other node holds there."""
    for here, other in ((a, b), (b, a)):
        pool = here.daemon.pool()
        grant = _count(other, here, "push_grant_bytes")
        if here.used() or pool["free_slots"] * pool["slot_size"] != pool["capacity_bytes"] - grant:
            return False
    return True


def _arenas_and_peers(a: Node, b: Node) -> dict[str, object]:
    """Each node's pool, its leases and its view of the other: a lost peer's grant
    is held in quarantine, a leak is not."""
    return {
        name: {
            "pool": here.daemon.pool(),
            "peer": here.peer(other.address),
            "leases": here.daemon.status().get("leases", []),
        }
        for name, here, other in (("a", a, b), ("b", b, a))
    }


# Node B with no notice channel: node A's notices to it ride Peer.Notify.
NO_CHANNEL = {"RELAYD_PEER_NOTICE_PORT": "-1"}
# Node A writing every push by Mooncake, none attached to its Landed notice.
NO_ATTACH = {"RELAYD_PUSH_ATTACH_MAX": "0"}


@pytest.mark.parametrize(
    "nodes",
    [{}, NO_CHANNEL, ({}, NO_ATTACH)],
    indirect=True,
    ids=["channel", "notify", "channel-no-attach"],
)
def test_puts_to_a_remote_consumer_are_pushed_and_read_locally(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    sizes = [300_000, MiB, 9 * MiB, 16 * MiB + 3]
    channel = (b.daemon.env or {}).get("RELAYD_PEER_NOTICE_PORT") != "-1"
    attach = channel and (a.daemon.env or {}).get("RELAYD_PUSH_ATTACH_MAX") != "0"
    # What the default --push-attach-max (16 MiB) sends after its Landed notice: a
    # lease holds its header and layout too, so 16 MiB + 3 of tensor is more than that.
    attached = sum(n < 16 * MiB for n in sizes) if attach else 0

    async def scenario() -> None:
        async with RelayClient("talker", b.daemon.socket) as r:
            _ready_to_push(a, b)
            if channel:
                wait_until(lambda: a.peer(b.address).get("notice_channel"), 10, "a's channel")
            async with RelayClient("thinker", a.daemon.socket) as w:
                for i, n in enumerate(sizes):
                    payload = make_payload(i, n)
                    ref = await w.put(payload, to_stage="talker", request_id=f"p{i}")
                    assert ref.proto.push
                    assert digest(await r.get(ref.to_bytes())) == digest(payload)

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert _count(b, a, "pushes_in") == len(sizes)
    # An attached push counts as out once node B's (lingering) receipt came.
    wait_until(lambda: _count(a, b, "pushes_out") == len(sizes), 10, "every push out")
    assert _count(a, b, "pushes_unreceived") == 0
    assert _count(a, b, "pushes_declined") == 0
    assert _pulls(b) == 0  # not one pull: every read found its local copy
    # What each read waited for on the network: nothing, the push's Landed notice,
    # or (attached) at most the notice that brought the bytes.
    # A read whose push had landed and been announced before its get asked
    # nothing, so it is counted as announced, not as landed or attached.
    assert _count(a, b, "pushes_attached") == attached
    reads = ("reads_attached", "reads_landed", "reads_awaited", "reads_announced")
    # An announced read is counted once its (lingering) Release reached B.
    wait_until(lambda: sum(_count(b, a, f) for f in reads) == len(sizes), 10, "every read counted")
    fetched_attached = _count(b, a, "reads_attached")
    fetched_other = _count(b, a, "reads_landed") + _count(b, a, "reads_awaited")
    announced = _count(b, a, "reads_announced")
    assert fetched_attached <= attached
    assert fetched_other <= len(sizes) - attached
    assert fetched_attached + fetched_other + announced == len(sizes)
    assert _count(b, a, "reads_pulled") == 0
    # The same counts, as Prometheus scrapes them.
    scraped_a, scraped_b = a.daemon.scrape(), b.daemon.scrape()
    assert _metric(scraped_a, "relayd_peer_pushes_out_total", peer=b.address) == len(sizes)
    assert _metric(scraped_a, "relayd_peer_pushes_attached_total", peer=b.address) == attached
    assert _metric(scraped_a, "relayd_peer_pushes_declined_total", peer=b.address) == 0
    assert _metric(scraped_a, "relayd_peer_pushes_unreceived", peer=b.address) == 0
    assert _metric(scraped_b, "relayd_peer_pushes_in_total", peer=a.address) == len(sizes)
    assert _metric(scraped_b, "relayd_peer_reads_total", peer=a.address, waited="attached") == (
        fetched_attached
    )
    assert _metric(scraped_b, "relayd_peer_reads_total", peer=a.address, waited="announced") == (
        announced
    )
    assert _metric(scraped_b, "relayd_peer_reads_total", peer=a.address, waited="pulled") == 0
    # The Landed notices went on node B's notice channel when it has one.
    path = _metric(scraped_a, "relayd_peer_notice_channel", peer=b.address)
    assert path == (1 if channel else 0)
    if channel:
        assert _count(a, b, "notice_batches") >= len(sizes)
    else:
        assert not a.peer(b.address).get("notice_channel")
        assert _count(a, b, "notice_batches") == 0
    wait_until(lambda: _free_but_grant(a, b), 10, "both arenas back to the push grant alone")
    assert int(b.peer(a.address)["credits_in_use"]) == 0
    assert int(a.peer(b.address).get("credits_in_use", 0)) == 0


def test_a_put_before_the_consumer_is_known_is_pulled(nodes: tuple[Node, Node]) -> None:
    a, b = nodes

    async def scenario() -> None:
        async with RelayClient("thinker", a.daemon.socket) as w:
            payload = make_payload(7, 2 * MiB)
            ref = await w.put(payload, to_stage="talker", request_id="early")
            assert not ref.proto.push
            async with RelayClient("talker", b.daemon.socket) as r:
                assert digest(await r.get(ref.to_bytes())) == digest(payload)

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert _count(b, a, "pushes_in") == 0
    assert _pulls(b) == 1
    assert _count(b, a, "reads_pulled") == 1
    # the data, then the writer's slot header: two Mooncake phases, one after the other
    assert _count(b, a, "pull_phases") == 2
    wait_until(lambda: _free_but_grant(a, b), 10, "both arenas back to the push grant alone")


@pytest.mark.parametrize("nodes", [{"RELAYD_PUSH_GRANT_SIZE": "2MiB"}], indirect=True)
def test_a_push_that_finds_no_room_falls_back_to_the_pull(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    sizes = [MiB, 3 * MiB, MiB]  # the 3 MiB one cannot fit the 2 MiB grant

    async def scenario() -> None:
        async with RelayClient("talker", b.daemon.socket) as r:
            _ready_to_push(a, b)
            async with RelayClient("thinker", a.daemon.socket) as w:
                for i, n in enumerate(sizes):
                    payload = make_payload(i, n)
                    ref = await w.put(payload, to_stage="talker", request_id=f"f{i}")
                    assert digest(await r.get(ref.to_bytes())) == digest(payload)

    asyncio.run(asyncio.wait_for(scenario(), 60))
    # The 3 MiB put is declined; the 1 MiB after it is too if the first one's run
    # has not come back yet (frees linger), else pushed.
    declined = _count(a, b, "pushes_declined")
    assert declined in (1, 2)
    assert _count(b, a, "pushes_in") == 3 - declined
    assert _pulls(b) == declined
    assert _count(b, a, "pull_phases") == 2 * _count(b, a, "reads_pulled") == 2 * declined
    wait_until(lambda: _free_but_grant(a, b), 10, "both arenas back to the push grant alone")


def test_abort_frees_pushed_leases_on_both_nodes(nodes: tuple[Node, Node]) -> None:
    a, b = nodes

    async def scenario() -> None:
        async with RelayClient("talker", b.daemon.socket) as r:
            _ready_to_push(a, b)
            async with RelayClient("thinker", a.daemon.socket) as w:
                refs = [
                    await w.put(make_payload(i, MiB), to_stage="talker", request_id="gone")
                    for i in range(4)
                ]
                await w.abort("gone")
                for ref in refs:
                    with pytest.raises(AbortedError):
                        await r.get(ref.to_bytes())

    asyncio.run(asyncio.wait_for(scenario(), 60))
    wait_until(
        lambda: _free_but_grant(a, b),
        10,
        "both arenas back to the push grant alone",
        state=lambda: _arenas_and_peers(a, b),
    )
    assert int(b.peer(a.address)["credits_in_use"]) == 0


def test_hostile_push_notices_are_refused(nodes: tuple[Node, Node]) -> None:
    a, b = nodes

    async def attach_and_check() -> None:
        async with RelayClient("talker", b.daemon.socket):
            _ready_to_push(a, b)
            epoch = str(b.peer(a.address)["daemon_epoch"])
            grant = _count(a, b, "push_grant_bytes") // (64 << 10)
            meta = (("relayd-peer-token-bin", TOKEN.encode()),)
            with grpc.insecure_channel(b.address) as ch:
                stub = pb_grpc.PeerStub(ch)
                # Not a connected peer (or not its epoch): refused outright.
                with pytest.raises(grpc.RpcError) as info:
                    stub.Notify(
                        iter([pb.PeerNotices(node_id="node-x", daemon_epoch="e")]),
                        timeout=5,
                        metadata=meta,
                    )
                assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
                bad = [
                    # past the end of the grant
                    pb.PushLanded(lease_id=1, generation=1, grant_id=1, slot=grant, nslots=1,
                                  length=10, request_id="h", from_stage="thinker",
                                  to_stage="talker"),
                    # longer than its run
                    pb.PushLanded(lease_id=2, generation=2, grant_id=1, slot=0, nslots=1,
                                  length=(64 << 10) + 1, request_id="h", from_stage="thinker",
                                  to_stage="talker"),
                    # a stage nobody serves on node B
                    pb.PushLanded(lease_id=3, generation=3, grant_id=1, slot=0, nslots=1,
                                  length=10, request_id="h", from_stage="thinker",
                                  to_stage="nobody"),
                    # some other grant
                    pb.PushLanded(lease_id=4, generation=4, grant_id=99, slot=0, nslots=1,
                                  length=10, request_id="h", from_stage="thinker",
                                  to_stage="talker"),
                    # bytes said to follow it, on a stream that carries none
                    pb.PushLanded(lease_id=5, generation=5, grant_id=1, slot=0, nslots=1,
                                  length=10, request_id="h", from_stage="thinker",
                                  to_stage="talker", attached=10),
                ]  # fmt: skip
                # ...and a flood of questions about pushes it never made here:
                # each is looked up, none answered.
                asked = [pb.LeaseKey(lease_id=i, generation=i) for i in range(1, 20_000)]
                stub.Notify(
                    iter(
                        [
                            pb.PeerNotices(
                                node_id="node-a", daemon_epoch=epoch, landed=bad, unreceived=asked
                            )
                        ]
                    ),
                    timeout=5,
                    metadata=meta,
                )
            assert b.daemon.proc is not None and b.daemon.proc.poll() is None
            assert b.used() == 0  # no lease was made of any of them
            assert _count(b, a, "pushes_in") == 0

    asyncio.run(asyncio.wait_for(attach_and_check(), 60))
    log = b.daemon.log()
    assert "lies outside the push grant" in log
    assert "does not fit" in log
    assert "is not served on this node" in log
    assert "names no push grant" in log
    assert "attaches 10 bytes for a length of 10; 0 came" in log


def test_keyed_puts_across_nodes_ride_the_push(nodes: tuple[Node, Node]) -> None:
    a, b = nodes

    async def scenario() -> None:
        async with RelayClient("talker", b.daemon.socket) as r:
            _ready_to_push(a, b)
            async with RelayClient("thinker", a.daemon.socket) as w:
                for i in range(3):
                    payload = make_payload(i, MiB)
                    await w.put(payload, to_stage="talker", request_id=f"k{i}", key=f"key{i}")
                    got = await r.get_key(f"key{i}", from_stage="thinker", timeout=10)
                    assert digest(got) == digest(payload)

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert _count(b, a, "pushes_in") == 3
    assert _pulls(b) == 0
    wait_until(lambda: _free_but_grant(a, b), 10, "both arenas back to the push grant alone")


def test_a_writer_daemon_with_pushes_off_declines_at_once(tmp_path: pathlib.Path) -> None:
    """The writer's client asks for a push; its daemon, with pushes off, says no, and
    the reader's daemon (which gave it no grant) pulls at once instead of waiting."""
    a, b = _pair(tmp_path, {}, {"RELAYD_PUSH_GRANT_SIZE": "0"})
    try:

        async def scenario() -> None:
            async with RelayClient("talker", b.daemon.socket) as r:
                wait_until(lambda: "talker" in a.peer(b.address).get("stages", []), 10, "stages")
                async with RelayClient("thinker", a.daemon.socket) as w:
                    for i in range(2):
                        payload = make_payload(i, MiB)
                        ref = await w.put(payload, to_stage="talker", request_id=f"o{i}")
                        assert ref.proto.push
                        assert digest(await r.get(ref.to_bytes())) == digest(payload)

        asyncio.run(asyncio.wait_for(scenario(), 60))
        assert _count(a, b, "pushes_declined") == 2
        assert _pulls(b) == 2
        assert "did not arrive" not in b.daemon.log()
    finally:
        stop_pair(a, b)
