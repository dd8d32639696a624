"""A batch of notices to a peer that grew past its usual size (its write was stuck,
or many notices were added at once) crosses whole and in order, as several
messages each well under what gRPC (4 MiB a message) and the notice channel
(``peer_channel.MAX_FRAME``) take, whichever way notices go. Two real nodes in
one process (see ``test_peer_manager``): B sends A releases of leases it pulled
(made up: A has none of them, so frees nothing); A records every batch its
handler gets."""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import pytest
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.peer_channel import MAX_FRAME, NO_CHANNEL
from relayd.peer_notices import _KINDS, MAX_BATCH, MAX_MESSAGE_BYTES, split
from relayd.transports.loopback import Loopback
from tests.unit.test_peer_manager import READER, Node, _up, peer_token, run, until

pytestmark = pytest.mark.timeout(60)

GRPC_MESSAGE_MAX = 4 << 20  # gRPC's default: what a Peer server receives at most
# Releases of 16 long stage names each (what a reader of many stages sends): these
# many make a batch of about 6 MiB.
RELEASES = 3072
STAGES = [READER, *(f"{READER}-{i:02d}-" + "s" * 120 for i in range(15))]


class Recorder:
    """A's notice handler, recording each batch it is given."""

    def __init__(self, node: Node) -> None:
        self.batches: list[pb.PeerNotices] = []
        self._handle = node.peers.push.on_notices
        node.peers.push.on_notices = self  # type: ignore[method-assign]

    def __call__(self, batch: pb.PeerNotices, attached: Sequence[memoryview] = ()) -> int:
        copy = pb.PeerNotices()
        copy.CopyFrom(batch)
        self.batches.append(copy)
        return self._handle(batch, attached)

    def released(self) -> list[int]:
        return [r.lease_id for batch in self.batches for r in batch.released]


@asynccontextmanager
async def nodes(
    tmp_path: pathlib.Path, a_notice_port: int
) -> AsyncIterator[tuple[Node, Node, Recorder]]:
    """A (recording what it is told) and B, which dials A, handshaken both ways."""
    token = peer_token(tmp_path)
    loopback = Loopback()
    a = Node("a", loopback, token, peer_notice_port=a_notice_port)
    b = Node("b", loopback, token, peers=(a.address,))
    recorder = Recorder(a)  # before A starts: its notice listener takes the handler then
    try:
        await a.peers.start()
        await b.peers.start()
        await until(lambda: _up(a, b) and _up(b, a), "the handshake both ways")
        yield a, b, recorder
    finally:
        for node in (b, a):
            await node.close()
            node.dispose()


def _add_releases(b: Node, a: Node, first: int, n: int) -> None:
    for lease_id in range(first, first + n):
        b.peers.notifier.box(a.address).released.add(
            lease_id=lease_id, generation=lease_id, reader_stages=STAGES
        )


def _check_messages(recorder: Recorder, sender: Node, limit: int) -> None:
    """Each message came from ``sender``, with at most MAX_BATCH notices, well under ``limit``."""
    sizes = [(len(b.released), b.ByteSize()) for b in recorder.batches]
    assert all(n <= MAX_BATCH and size <= limit // 2 for n, size in sizes), sizes
    assert {(b.node_id, b.daemon_epoch) for b in recorder.batches} == {
        (sender.settings.node_id, sender.epoch)
    }


def test_a_batch_grown_while_a_notify_write_was_in_flight_arrives_whole_and_in_order(
    tmp_path: pathlib.Path,
) -> None:
    """A has no notice channel: B's notices to it ride Peer.Notify, one write in
    flight at a time. The first MAX_BATCH releases start a write; every later one,
    added while it is in flight, waits for it in one batch of over 4 MiB."""

    async def main() -> None:
        async with nodes(tmp_path, NO_CHANNEL) as (a, b, recorder):
            notifier = b.peers.notifier
            for lease_id in range(1, RELEASES + 1):
                _add_releases(b, a, lease_id, 1)
                notifier.send(a.address, urgent=False)
            assert notifier.box(a.address).ByteSize() > GRPC_MESSAGE_MAX  # the grown batch
            await until(
                lambda: len(recorder.released()) >= RELEASES,
                f"A to get all {RELEASES} releases on Notify",
            )
            assert recorder.released() == list(range(1, RELEASES + 1))
            assert not notifier.has_channel(a.address)
            _check_messages(recorder, b, GRPC_MESSAGE_MAX)

    run(main())


def test_a_batch_larger_than_a_channel_frame_arrives_whole_and_in_order(
    tmp_path: pathlib.Path,
) -> None:
    """B's notices to A go on A's notice channel; one send hands it more releases
    than one frame may carry."""

    async def main() -> None:
        async with nodes(tmp_path, 0) as (a, b, recorder):
            notifier = b.peers.notifier
            await until(lambda: notifier.has_channel(a.address), "B's notice channel to A")
            before, sent = len(recorder.batches), notifier.channel_batches(a.address)
            _add_releases(b, a, 1, RELEASES)
            assert notifier.box(a.address).ByteSize() > MAX_FRAME
            notifier.send(a.address, added=RELEASES)
            await until(
                lambda: len(recorder.released()) >= RELEASES,
                f"A to get all {RELEASES} releases on the notice channel",
            )
            assert recorder.released() == list(range(1, RELEASES + 1))
            assert notifier.has_channel(a.address)  # the channel was not dropped
            sent = notifier.channel_batches(a.address) - sent
            assert sent == len(recorder.batches) - before  # every message on the channel
            _check_messages(recorder, b, MAX_FRAME)

    run(main())


def test_a_batch_of_every_kind_is_cut_in_the_order_its_receiver_handles_it() -> None:
    """Handled one after the other, the messages do what the whole batch would: each
    kind's notices keep their order, and no message holds a kind the receiver
    handles before one an earlier message held (its kinds' order, ``_KINDS``)."""
    batch = pb.PeerNotices()
    for i in range(700):
        batch.landed.add(lease_id=i, request_id=f"r{i}", length=i)
        batch.declined.add(lease_id=i, generation=i)
        batch.freed.add(grant_id=1, slot=i, nslots=1)
        batch.released.add(lease_id=i, generation=i, reader_stages=STAGES)
        batch.received.add(lease_id=i, generation=i)
    messages = split(batch)
    assert all(sum(len(getattr(m, k)) for k in _KINDS) <= MAX_BATCH for m in messages)
    assert all(m.ByteSize() <= MAX_MESSAGE_BYTES for m in messages)
    for kind in _KINDS:
        cut = [n for m in messages for n in getattr(m, kind)]
        assert cut == list(getattr(batch, kind)), kind
    order = [_KINDS.index(k) for m in messages for k in _KINDS if len(getattr(m, k))]
    assert order == sorted(order)
    small = pb.PeerNotices()
    small.freed.add(grant_id=1, slot=0, nslots=1)
    assert split(small) == [small] and split(small)[0] is small
