"""A ``Peer.Notify`` stream that the receiving daemon ends with an error, after
the sender's write of a batch has returned, is seen by the sender at once: it
logs and counts the notices that batch carried as lost (they are not sent again),
and its next batch goes on a fresh stream. The receiver logs why it ended the
stream. Two real nodes in one process (see ``test_peer_manager``): B sends A
releases of leases it pulled (made up: A has none of them, so frees nothing),
on Notify, A having no notice channel.
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Sequence

import pytest
from relayd_client.wire.errors import PermissionDeniedError
from relayd_client.wire.proto import relay_pb2 as pb

from relayd.peer_channel import NO_CHANNEL
from tests.unit.test_peer_manager import Node, run, until
from tests.unit.test_peer_notice_batch_cap import _add_releases, nodes

pytestmark = pytest.mark.timeout(60)

# The stream's end is known to B as soon as A's status reaches it: well within this.
REPORTED_WITHIN = 5.0


class Refuser:
    """A's notice handler, refusing the next batch once ``armed``, as it refuses a
    batch from a node it does not know as a peer (which ends the stream)."""

    def __init__(self, node: Node) -> None:
        self.armed = False
        self.refused = 0
        self._handle = node.peers.push.on_notices
        node.peers.push.on_notices = self  # type: ignore[method-assign]

    def __call__(self, batch: pb.PeerNotices, attached: Sequence[memoryview] = ()) -> int:
        if self.armed:
            self.armed = False
            self.refused += 1
            raise PermissionDeniedError("refused for the test")
        return self._handle(batch, attached)


def _warnings(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == logger and r.levelno == logging.WARNING
    ]


def test_a_notify_stream_the_peer_ends_with_an_error_is_reported_and_reopened(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        async with nodes(tmp_path, NO_CHANNEL) as (a, b, recorder):
            refuser = Refuser(a)
            notifier = b.peers.notifier
            _add_releases(b, a, 1, 1)
            notifier.send(a.address)
            await until(lambda: recorder.released() == [1], "A to get the first release")

            refuser.armed = True
            _add_releases(b, a, 2, 3)
            notifier.send(a.address, added=3)
            await until(lambda: refuser.refused == 1, "A to refuse the second batch")
            # Nothing more is written to A meanwhile: B must see the stream's end
            # itself, not at its next write.
            await until(
                lambda: any(a.address in m for m in _warnings(caplog, "relayd.peer_notices")),
                "B to log the notices lost with the Notify stream A ended",
                REPORTED_WITHIN,
            )
            # At least the refused batch's; the first one's too when it went within
            # the peer timeout before: what a stream's end may have lost.
            lost = notifier.lost(a.address)
            assert 3 <= lost <= 4
            [refused] = _warnings(caplog, "relayd.rpc.peer_service")
            assert b.settings.node_id in refused and "refused for the test" in refused

            _add_releases(b, a, 5, 1)
            notifier.send(a.address)
            await until(lambda: recorder.released() == [1, 5], "A to get a later release")
            assert notifier.lost(a.address) == lost

    run(main())
