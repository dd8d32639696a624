"""The client's memory of landed pushes its daemon announced (``_remote.Announced``)."""

from __future__ import annotations

import asyncio

import pytest
from relayd_client import _remote
from relayd_client.wire.dataref import DataRef
from relayd_client.wire.errors import PermissionDeniedError
from relayd_client.wire.proto import relay_pb2 as pb

EPOCH = "eb"  # the reader's daemon's
LOCAL = pb.LeaseRef(pool="shm", segment=0, slot=8, nslots=2, offset=8192, length=300)


def _ref(lease_id: int, request_id: str = "r1", to_stage: str = "talker") -> pb.DataRef:
    m = pb.DataRef(request_id=request_id, to_stage=to_stage, transport=pb.TRANSPORT_SHM)
    m.origin.node_id, m.origin.daemon_epoch = "node-a", "ea"
    m.lease.lease_id = m.lease.generation = lease_id
    m.lease.slot, m.lease.length = 3, 300
    return m


def _landed(lease_id: int, request_id: str = "r1", to_stage: str = "talker") -> pb.LandedPush:
    return pb.LandedPush(
        origin_node_id="node-a",
        origin_daemon_epoch="ea",
        lease_id=lease_id,
        generation=lease_id,
        lease=LOCAL,
        request_id=request_id,
        to_stage=to_stage,
    )


def test_a_get_takes_the_local_lease_once() -> None:
    announced = _remote.Announced()
    announced.add(_landed(7), EPOCH)
    assert announced.take(_ref(7), EPOCH) == LOCAL
    assert announced.take(_ref(7), EPOCH) is None  # a second get fetches
    assert len(announced) == 0


def test_the_local_dataref_names_the_lease_where_the_push_landed() -> None:
    remote = _ref(7)
    local = _remote.local_ref(remote, LOCAL, "node-b", EPOCH)
    assert local.lease == LOCAL
    assert (local.origin.node_id, local.origin.daemon_epoch) == ("node-b", EPOCH)
    assert local.transport == pb.TRANSPORT_SHM
    assert (local.request_id, local.to_stage) == ("r1", "talker")
    assert (remote.origin.node_id, remote.lease.slot) == ("node-a", 3)  # left as it was


def test_another_lease_or_generation_is_not_announced() -> None:
    announced = _remote.Announced()
    announced.add(_landed(7), EPOCH)
    other = _ref(7)
    other.lease.generation = 8
    assert announced.take(other, EPOCH) is None
    other = _ref(7)
    other.origin.daemon_epoch = "a restarted writer's daemon"
    assert announced.take(other, EPOCH) is None
    assert announced.take(_ref(7), EPOCH) is not None


def test_an_announcement_from_another_daemon_epoch_is_not_read() -> None:
    """Leases are numbered afresh after a restart: an old one could match a new header."""
    announced = _remote.Announced()
    announced.add(_landed(7), "the daemon before its restart")
    assert announced.take(_ref(7), EPOCH) is None
    assert len(announced) == 0


@pytest.mark.parametrize(("request_id", "to_stage"), [("r2", "talker"), ("r1", "vocoder")])
def test_a_dataref_that_does_not_match_its_push_is_refused(request_id: str, to_stage: str) -> None:
    announced = _remote.Announced()
    announced.add(_landed(7), EPOCH)
    with pytest.raises(PermissionDeniedError, match="does not match"):
        announced.take(_ref(7, request_id, to_stage), EPOCH)


def test_memory_is_bounded_oldest_first() -> None:
    announced = _remote.Announced()
    for n in range(1, _remote.ANNOUNCED_MAX + 6):
        announced.add(_landed(n), EPOCH)
    assert len(announced) == _remote.ANNOUNCED_MAX
    assert all(announced.take(_ref(n), EPOCH) is None for n in range(1, 6))
    assert announced.take(_ref(_remote.ANNOUNCED_MAX + 5), EPOCH) is not None


def test_forget_drop_request_and_clear() -> None:
    announced = _remote.Announced()
    for n, rid in ((1, "r1"), (2, "r2"), (3, "r2"), (4, "r3")):
        announced.add(_landed(n, rid), EPOCH)
    announced.forget(_ref(1))
    assert announced.take(_ref(1), EPOCH) is None
    announced.drop_request("r2")
    assert len(announced) == 1
    announced.clear()
    assert len(announced) == 0


def test_a_fetch_in_flight_is_told_once_when_its_push_is_announced() -> None:
    announced = _remote.Announced()
    told: list[pb.LeaseRef | None] = []

    def fetch() -> None:
        told.append(announced.take(_ref(7), EPOCH))

    key = announced.when_added(_ref(7), fetch)
    announced.add(_landed(8), EPOCH)  # another push: not this fetch's
    assert told == []
    announced.add(_landed(7), EPOCH)
    assert len(told) == 1 and told[0] == LOCAL
    assert len(announced) == 1  # lease 8's, still there for its get; 7's was taken
    announced.add(_landed(7), EPOCH)  # once told, no longer waiting
    assert len(told) == 1
    announced.stop_waiting(key, fetch)


def test_a_fetch_that_ended_is_not_told_and_leaves_a_later_fetch_waiting() -> None:
    announced = _remote.Announced()
    first: list[int] = []
    second: list[int] = []

    def fetch_1() -> None:
        first.append(1)

    def fetch_2() -> None:
        second.append(1)

    key = announced.when_added(_ref(7), fetch_1)
    announced.when_added(_ref(7), fetch_2)  # a second get of the same DataRef
    announced.stop_waiting(key, fetch_1)  # the first one's end keeps the second's wait
    announced.add(_landed(7), EPOCH)
    assert (first, second) == ([], [1])
    key = announced.when_added(_ref(9), fetch_1)
    announced.stop_waiting(key, fetch_1)
    announced.add(_landed(9), EPOCH)
    announced.when_added(_ref(10), fetch_1)
    announced.clear()  # a re-attach: the session's fetches failed with it
    announced.add(_landed(10), EPOCH)
    assert first == []


def test_a_stage_is_waited_for_from_its_first_announcement_until_one_is_not_heard() -> None:
    announced = _remote.Announced()
    assert not announced.announces("talker")  # no announcement yet: fetch at once
    announced.add(_landed(7), EPOCH)
    assert announced.announces("talker") and not announced.announces("thinker")
    announced.unheard("talker")  # a get waited in vain: the daemon stopped announcing
    assert not announced.announces("talker")
    announced.add(_landed(8), EPOCH)  # and started again
    assert announced.announces("talker")
    announced.clear()  # a re-attach: a new daemon says again what it announces
    assert not announced.announces("talker")


class _NoSession:
    def fetch(self, *args: object) -> None:
        raise AssertionError("a FetchCall was sent for a fetch answered already")


def test_a_fetch_answered_by_its_announcement_asks_the_daemon_nothing() -> None:
    async def main() -> pb.DataRef:
        answer: asyncio.Future[pb.FetchResponse] = asyncio.get_running_loop().create_future()
        answer.set_result(pb.FetchResponse(lease=LOCAL, node_id="node-b", daemon_epoch=EPOCH))
        return await _remote.fetch(_NoSession(), DataRef(_ref(7)), 1.0, answer)  # type: ignore[arg-type]

    local = asyncio.run(main())
    assert local.lease == LOCAL and local.origin.node_id == "node-b"


def test_a_declined_push_tells_the_fetch_waiting_for_it_and_nothing_else() -> None:
    announced = _remote.Announced()
    told: list[pb.LeaseRef | None] = []
    declined = _landed(7)
    declined.ClearField("lease")
    announced.when_added(_ref(7), lambda: told.append(announced.take(_ref(7), EPOCH)))
    announced.declined(_landed(8))  # another push: not this fetch's
    assert told == []
    announced.declined(declined)
    assert told == [None]  # told, with nothing to read: it fetches
    assert len(announced) == 0 and not announced.announces("talker")


def test_a_get_of_a_push_declined_before_it_came_does_not_wait() -> None:
    announced = _remote.Announced()
    announced.add(_landed(7), EPOCH)  # the daemon announces talker's pushes here
    pushed = [_ref(n) for n in (8, 9)]
    for m in pushed:
        m.push = True
    assert announced.expects(pushed[0]) and announced.expects(pushed[1])
    unpushed = _ref(10)
    assert not announced.expects(unpushed)  # its writer asked for no push: fetch
    declined = _landed(8)
    declined.ClearField("lease")
    announced.declined(declined)  # nobody waits for it yet
    assert not announced.expects(pushed[0]) and announced.expects(pushed[1])
    announced.forget(pushed[0])  # read: forgotten
    assert announced.expects(pushed[0])
    announced.declined(declined)
    announced.clear()
    assert not announced.expects(pushed[0])  # nothing announced to the new session yet


def test_a_get_whose_announcement_is_gone_fetches_without_waiting() -> None:
    announced = _remote.Announced()
    announced.add(_landed(7), EPOCH)
    m = _ref(8)
    m.push = True
    assert announced.expects(m)
    announced.fetch_now(m)  # announced, then freed before the get read it
    assert not announced.expects(m) and announced.announces("talker")


def test_a_fetch_told_from_another_thread_is_answered_on_its_loop() -> None:
    """A blocking get's thread hears announcements on the announcement socket; a
    fetch in flight on the loop it tells has its futures set there, not on the
    telling thread (``_remote.on_loop``), and the loop wakes for it."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        ran_on: list[object] = []
        done = loop.create_future()

        def fn() -> None:
            ran_on.append(asyncio._get_running_loop())
            if not done.done():
                done.set_result(None)

        told = _remote.on_loop(loop, fn)
        await asyncio.to_thread(told)  # the loop waits here, asleep, until it is told
        await asyncio.wait_for(done, 5)
        assert ran_on == [loop]
        told()  # on the loop itself: at once
        assert ran_on == [loop, loop]

    asyncio.run(scenario())
    closed = asyncio.new_event_loop()
    closed.close()
    _remote.on_loop(closed, lambda: None)()  # nobody waits there: nothing to tell
