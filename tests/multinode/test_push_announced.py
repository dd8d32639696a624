"""Landed pushes announced to their reader: two real daemons, real Mooncake, real clients.

When a push lands on node B and one session alone serves its stage, B tells
that session where (a ``LandedPush`` frame); a get of the DataRef then reads the
local lease and asks B nothing. Each test waits until the client holds the
announcement, so what it checks is the read that follows, not the race.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import pathlib
import signal
import time
from typing import Any

import pytest
from relayd_client import AbortedError, RelayClient, SyncRelayClient, _remote

from tests._daemon import async_wait_until, wait_until
from tests._mooncake import requires_mooncake
from tests._workers import digest, make_payload
from tests.multinode.test_push import _count, _free_but_grant, _ready_to_push
from tests.multinode.test_two_daemons import Node, _metric, running_pair

pytestmark = [
    pytest.mark.multinode,
    pytest.mark.timeout(120),
    requires_mooncake,
]

SIZES = (300_000, 1 << 20, 5 << 20)  # every one attached to its Landed notice by default
DEADLINE = 10.0


@pytest.fixture
def nodes(tmp_path: pathlib.Path) -> Any:
    with running_pair(tmp_path, {"metrics": True}, {"metrics": True}) as pair:
        yield pair


def _announced(client: RelayClient) -> int:
    """Announcements the client holds and no get has taken yet."""
    return len(client._reader.announced)


def _released(node: Node, via: str) -> float:
    return _metric(node.daemon.scrape(), "relayd_released_leases_total", via=via) or 0.0


def _no_fetch_counted(a: Node, b: Node) -> bool:
    return all(
        _count(b, a, field) == 0
        for field in ("reads_landed", "reads_awaited", "reads_attached", "reads_pulled")
    )


async def _put_announcement_held(
    session: Any, w: RelayClient, nodes: tuple[Node, Node], payload: Any, request_id: str
) -> tuple[Any, Any]:
    """Put ``payload`` for talker with the reader's session socket paused: B has
    announced the push when this returns, and the announcement waits in the
    socket until the caller resumes reading (the transport returned)."""
    a, b = nodes
    transport = session._transport
    assert transport is not None
    transport.pause_reading()
    announced = _count(b, a, "pushes_announced")
    ref = await w.put(payload, to_stage="talker", request_id=request_id)
    await asyncio.to_thread(
        wait_until,
        lambda: _count(b, a, "pushes_announced") == announced + 1,
        DEADLINE,
        "B to announce the push",
    )
    return transport, ref


def test_an_announced_push_is_read_with_no_fetch(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    payloads = [make_payload(i, n) for i, n in enumerate(SIZES)]

    async def scenario() -> None:
        async with RelayClient("talker", b.daemon.socket) as r:
            _ready_to_push(a, b)
            async with RelayClient("thinker", a.daemon.socket) as w:
                for i, payload in enumerate(payloads):
                    ref = await w.put(payload, to_stage="talker", request_id=f"p{i}")
                    await async_wait_until(lambda: _announced(r) == 1, DEADLINE, "the announcement")
                    assert digest(await r.get(ref.to_bytes())) == digest(payload)
                    assert _announced(r) == 0  # taken by the get
                # A zero-copy get of an announced push holds the lease until released.
                payload = make_payload(9, 1 << 20)
                ref = await w.put(payload, to_stage="talker", request_id="view")
                await async_wait_until(lambda: _announced(r) == 1, DEADLINE, "the announcement")
                async with r.view(ref.to_bytes()) as got:
                    assert digest(got) == digest(payload)
                    assert b.used() > 0

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert _count(b, a, "pushes_announced") == len(SIZES) + 1
    wait_until(
        lambda: _count(b, a, "reads_announced") == len(SIZES) + 1, DEADLINE, "the reads counted"
    )
    assert _no_fetch_counted(a, b)
    # On a node with no writer no frame would take the Release ring: the run has
    # to go back to the peer's push grant, so each Release rode a frame.
    assert (_released(b, "frame"), _released(b, "ring")) == (len(SIZES) + 1, 0)
    wait_until(lambda: _free_but_grant(a, b), DEADLINE, "both arenas back to the push grants")


def _landings_on_the_loop(monkeypatch: pytest.MonkeyPatch, client: RelayClient) -> list[int]:
    """Spy on the client's loop thread: the LandedPush frames it handles."""
    session = client._conn.session
    handle, landed = session._on_frame, []

    def watched(frame: Any) -> None:
        landed.append(len(frame.landed))
        handle(frame)

    monkeypatch.setattr(session, "_on_frame", watched)
    return landed


def test_the_blocking_client_hears_and_reads_an_announced_push_on_its_own_thread(
    nodes: tuple[Node, Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its announcements come on the session's announcement socket, which the
    get reads itself: the loop thread handles none of them."""
    a, b = nodes
    with SyncRelayClient("talker", b.daemon.socket) as r:
        assert r._client._conn.session.apart is not None
        on_loop = _landings_on_the_loop(monkeypatch, r._client)
        _ready_to_push(a, b)
        with SyncRelayClient("thinker", a.daemon.socket) as w:
            for i, n in enumerate(SIZES):
                payload = make_payload(i, n)
                ref = w.put(payload, to_stage="talker", request_id=f"s{i}")
                wait_until(
                    lambda n=i + 1: _count(b, a, "pushes_announced") == n,
                    DEADLINE,
                    "B to announce",
                )
                assert digest(r.get(ref.to_bytes())) == digest(payload)
                assert _announced(r._client) == 0  # taken by the get
        assert sum(on_loop) == 0
    wait_until(lambda: _count(b, a, "reads_announced") == len(SIZES), DEADLINE, "the reads counted")
    assert _no_fetch_counted(a, b)
    assert (_released(b, "frame"), _released(b, "ring")) == (len(SIZES), 0)
    wait_until(lambda: _free_but_grant(a, b), DEADLINE, "both arenas back to the push grants")


def test_an_announcement_socket_the_client_closed_leaves_announcements_to_the_loop(
    nodes: tuple[Node, Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """B finds the socket closed and tells on the session socket instead: the
    loop thread hears it, and the get reads the push with no fetch all the same."""
    a, b = nodes
    with SyncRelayClient("talker", b.daemon.socket) as r:
        apart = r._client._conn.session.apart
        assert apart is not None
        apart.close()
        on_loop = _landings_on_the_loop(monkeypatch, r._client)
        _ready_to_push(a, b)
        with SyncRelayClient("thinker", a.daemon.socket) as w:
            for i in range(2):
                payload = make_payload(i, 1 << 20)
                ref = w.put(payload, to_stage="talker", request_id=f"c{i}")
                wait_until(lambda: _announced(r._client) == 1, DEADLINE, "the loop to hear it")
                assert digest(r.get(ref.to_bytes())) == digest(payload)
        assert sum(on_loop) == 2
    wait_until(lambda: _count(b, a, "reads_announced") == 2, DEADLINE, "the reads counted")
    assert _no_fetch_counted(a, b)
    wait_until(lambda: _free_but_grant(a, b), DEADLINE, "both arenas back to the push grants")


def test_an_announcement_that_crosses_the_fetch_answers_the_get(nodes: tuple[Node, Node]) -> None:
    """The push lands while the reader's FetchCall is on its way: B announces it,
    no fetch waiting yet, then answers the fetch too. The get reads where the
    announcement said, without waiting for that answer."""
    a, b = nodes
    payload = make_payload(4, 1 << 20)
    answered_early: list[bool] = []

    async def scenario() -> None:
        async with RelayClient("talker", b.daemon.socket) as r:
            _ready_to_push(a, b)
            session, reader = r._conn.session, r._reader
            answer_from_announcement = reader._answer_from_announcement

            def watched(ref: Any, answer: asyncio.Future[Any]) -> None:
                answer_from_announcement(ref, answer)
                answered_early.append(answer.done())

            reader._answer_from_announcement = watched  # type: ignore[method-assign]
            async with RelayClient("thinker", a.daemon.socket) as w:
                transport, ref = await _put_announcement_held(session, w, nodes, payload, "crossed")
                get = asyncio.ensure_future(r.get(ref.to_bytes()))
                await async_wait_until(lambda: bool(session._calls), DEADLINE, "the FetchCall")
                transport.resume_reading()  # the announcement first, then the answer
                assert digest(await get) == digest(payload)

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert answered_early == [True]
    assert _count(b, a, "reads_attached") == 1  # B answered the fetch all the same
    wait_until(lambda: _free_but_grant(a, b), DEADLINE, "both arenas back to the push grants")


def test_a_stage_served_twice_is_not_announced(nodes: tuple[Node, Node]) -> None:
    """Either session may hold the DataRef, so neither is told: both fetch as before."""
    a, b = nodes
    payload = make_payload(1, 1 << 20)

    async def scenario() -> None:
        async with (
            RelayClient("talker", b.daemon.socket) as r,
            RelayClient("talker", b.daemon.socket) as other,
        ):
            _ready_to_push(a, b)
            async with RelayClient("thinker", a.daemon.socket) as w:
                ref = await w.put(payload, to_stage="talker", request_id="twice")
                await asyncio.to_thread(
                    wait_until, lambda: _count(b, a, "pushes_in") == 1, DEADLINE, "the landing"
                )
                assert digest(await r.get(ref.to_bytes())) == digest(payload)
            assert _announced(r) == _announced(other) == 0

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert _count(b, a, "pushes_announced") == 0
    assert _count(b, a, "reads_attached") == 1  # read by a fetch that found it landed
    wait_until(lambda: _free_but_grant(a, b), DEADLINE, "both arenas back to the push grants")


def test_an_announced_push_aborted_before_its_get_is_not_read(nodes: tuple[Node, Node]) -> None:
    """The abort frees the landed lease; the announcement the reader still holds
    names memory that is no longer that lease's, so the get asks the daemon,
    which says why."""
    a, b = nodes

    async def scenario() -> None:
        async with RelayClient("talker", b.daemon.socket) as r:
            _ready_to_push(a, b)
            async with RelayClient("thinker", a.daemon.socket) as w:
                ref = await w.put(make_payload(2, 1 << 20), to_stage="talker", request_id="gone")
                await async_wait_until(lambda: _announced(r) == 1, DEADLINE, "the announcement")
                await w.abort("gone")
                await asyncio.to_thread(wait_until, lambda: b.used() == 0, DEADLINE, "B to free it")
                with pytest.raises(AbortedError):
                    await r.get(ref.to_bytes())
                assert _announced(r) == 0  # the abort's announcement forgotten
                # The node still works: the next push is announced and read.
                payload = make_payload(3, 1 << 20)
                ref = await w.put(payload, to_stage="talker", request_id="next")
                await async_wait_until(
                    lambda: _announced(r) == 1, DEADLINE, "the next announcement"
                )
                assert digest(await r.get(ref.to_bytes())) == digest(payload)

    asyncio.run(asyncio.wait_for(scenario(), 60))
    wait_until(lambda: _free_but_grant(a, b), DEADLINE, "both arenas back to the push grants")
    assert _count(b, a, "pushes_announced") == 2
    assert _count(b, a, "reads_announced") == 1  # the aborted one was reclaimed, not read


def test_a_get_before_its_push_lands_waits_for_the_announcement_and_asks_nothing(
    nodes: tuple[Node, Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once B has announced a push for the stage, a get that comes before the next
    one's announcement waits for it instead of sending a FetchCall."""
    a, b = nodes
    # Longer than the test takes: the get must end by the announcement, not the wait.
    monkeypatch.setattr(_remote, "ANNOUNCE_WAIT_S", 3600.0)
    payloads = [make_payload(5, 1 << 20), make_payload(6, 1 << 20)]

    async def scenario() -> None:
        async with RelayClient("talker", b.daemon.socket) as r:
            _ready_to_push(a, b)
            session, announced = r._conn.session, r._reader.announced
            async with RelayClient("thinker", a.daemon.socket) as w:
                ref = await w.put(payloads[0], to_stage="talker", request_id="first")
                await async_wait_until(lambda: _announced(r) == 1, DEADLINE, "the announcement")
                assert digest(await r.get(ref.to_bytes())) == digest(payloads[0])
                assert announced.announces("talker")
                transport, ref = await _put_announcement_held(
                    session, w, nodes, payloads[1], "second"
                )
                get = asyncio.ensure_future(r.get(ref.to_bytes()))
                await async_wait_until(lambda: announced._fetching, DEADLINE, "the get to wait")
                assert not session._calls  # no FetchCall went
                transport.resume_reading()
                assert digest(await get) == digest(payloads[1])
                assert not session._calls

    asyncio.run(asyncio.wait_for(scenario(), 60))
    wait_until(lambda: _count(b, a, "reads_announced") == 2, DEADLINE, "the reads counted")
    assert _no_fetch_counted(a, b)
    wait_until(lambda: _free_but_grant(a, b), DEADLINE, "both arenas back to the push grants")


def test_a_get_that_hears_nothing_fetches_and_waits_no_more_for_that_stage(
    nodes: tuple[Node, Node],
) -> None:
    """After a second session serves the stage, B announces no more: the first get
    waits its bound in vain and fetches; the next ones fetch at once."""
    a, b = nodes
    payloads = [make_payload(i, 1 << 20) for i in range(3)]

    async def scenario() -> None:
        async with RelayClient("talker", b.daemon.socket) as r:
            _ready_to_push(a, b)
            announced = r._reader.announced
            async with RelayClient("thinker", a.daemon.socket) as w:
                ref = await w.put(payloads[0], to_stage="talker", request_id="alone")
                await async_wait_until(lambda: _announced(r) == 1, DEADLINE, "the announcement")
                assert digest(await r.get(ref.to_bytes())) == digest(payloads[0])
                assert announced.announces("talker")
                async with RelayClient("talker", b.daemon.socket):
                    for i in (1, 2):
                        ref = await w.put(payloads[i], to_stage="talker", request_id=f"two{i}")
                        assert digest(await r.get(ref.to_bytes())) == digest(payloads[i])
                        assert not announced.announces("talker")

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert _count(b, a, "pushes_announced") == 1
    fetched = sum(_count(b, a, f) for f in ("reads_landed", "reads_awaited", "reads_attached"))
    assert fetched == 2
    wait_until(lambda: _free_but_grant(a, b), DEADLINE, "both arenas back to the push grants")


def test_a_get_waiting_for_a_push_its_writer_declined_fetches_at_once(
    nodes: tuple[Node, Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's daemon declines the push that cannot fit its grant at B; B tells the
    reader, whose get stops waiting for the announcement and B pulls the bytes."""
    a, b = nodes
    monkeypatch.setattr(_remote, "ANNOUNCE_WAIT_S", 3600.0)  # only the decline ends the wait

    async def scenario() -> None:
        async with RelayClient("talker", b.daemon.socket) as r:
            _ready_to_push(a, b)
            small = make_payload(7, 1 << 20)
            big = make_payload(8, _count(a, b, "push_grant_bytes") + (1 << 20))  # cannot fit
            async with RelayClient("thinker", a.daemon.socket) as w:
                ref = await w.put(small, to_stage="talker", request_id="fits")
                await async_wait_until(lambda: _announced(r) == 1, DEADLINE, "the announcement")
                assert digest(await r.get(ref.to_bytes())) == digest(small)
                announced = r._reader.announced
                for i in range(2):
                    ref = await w.put(big, to_stage="talker", request_id=f"too-big{i}")
                    assert ref.proto.push
                    if i:  # the decline is here before the get: it does not wait at all
                        await async_wait_until(lambda: announced._declined, DEADLINE, "the decline")
                    got = await asyncio.wait_for(r.get(ref.to_bytes()), DEADLINE)
                    assert digest(got) == digest(big)
                    assert announced.announces("talker")  # told, not unheard
                    assert not announced._declined  # forgotten once read

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert _count(a, b, "pushes_declined") == 2
    assert _count(b, a, "reads_pulled") == 2
    wait_until(lambda: _free_but_grant(a, b), DEADLINE, "both arenas back to the push grants")


def _learn_announced(
    nodes: tuple[Node, Node], w: SyncRelayClient, r: SyncRelayClient, payload: Any
) -> None:
    """One push read once B announced it: ``r`` then waits for the stage's next ones."""
    a, b = nodes
    ref = w.put(payload, to_stage="talker", request_id="learn")
    wait_until(lambda: _count(b, a, "pushes_announced") == 1, DEADLINE, "B to announce")
    if r._client._conn.session.apart is None:  # heard by the loop thread, on its own time
        wait_until(lambda: _announced(r._client) == 1, DEADLINE, "the loop to hear it")
    assert digest(r.get(ref.to_bytes())) == digest(payload)
    assert r._client._reader.announced.announces("talker")


@pytest.mark.parametrize("apart", [True, False], ids=["apart", "no-socket"])
def test_the_blocking_client_waits_for_the_announcement_on_its_own_thread(
    nodes: tuple[Node, Node], monkeypatch: pytest.MonkeyPatch, apart: bool
) -> None:
    """A blocking get that comes before its push lands (A's daemon stopped until
    the get waits) hears the announcement on the caller's thread and reads there:
    no FetchCall, nothing run on the loop, no LandedPush handled there. Without
    an announcement socket (a daemon that sent none) the loop thread hears it
    and tells the waiting get, which reads on its own thread all the same."""
    a, b = nodes
    monkeypatch.setattr(_remote, "ANNOUNCE_WAIT_S", 3600.0)
    payloads = [make_payload(10, 1 << 20), make_payload(11, 1 << 20)]
    with SyncRelayClient("talker", b.daemon.socket) as r:
        _ready_to_push(a, b)
        client = r._client
        session, announced = client._conn.session, client._reader.announced
        if not apart:
            assert session.apart is not None
            session.apart.close()  # B's writes there fail: it tells on the session socket
            session.apart = None
        on_loop = _landings_on_the_loop(monkeypatch, client)
        with SyncRelayClient("thinker", a.daemon.socket) as w:
            _learn_announced(nodes, w, r, payloads[0])
            ran: list[Any] = []
            run = r._run

            def spied(coro: Any, *args: Any) -> Any:
                ran.append(coro)
                return run(coro, *args)

            monkeypatch.setattr(r, "_run", spied)
            a.daemon.proc.send_signal(signal.SIGSTOP)  # the Publish waits in A's socket
            try:
                ref = w.put(payloads[1], to_stage="talker", request_id="waited")
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    get = pool.submit(r.get, ref.to_bytes())
                    wait_until(lambda: announced._fetching, DEADLINE, "the get to wait")
                    assert not get.done() and not session._calls  # no FetchCall went
                    a.daemon.proc.send_signal(signal.SIGCONT)
                    assert digest(get.result(DEADLINE)) == digest(payloads[1])
            finally:
                a.daemon.proc.send_signal(signal.SIGCONT)
            assert ran == [] and not session._calls
        assert sum(on_loop) == (0 if apart else 2)
    wait_until(lambda: _count(b, a, "reads_announced") == 2, DEADLINE, "the reads counted")
    assert _no_fetch_counted(a, b)
    wait_until(lambda: _free_but_grant(a, b), DEADLINE, "both arenas back to the push grants")


def test_a_get_waiting_while_another_thread_listens_is_told_by_it(
    nodes: tuple[Node, Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One thread at a time reads the announcement socket; a get that finds it
    taken waits on its own event, which the listening thread sets, and reads."""
    a, b = nodes
    monkeypatch.setattr(_remote, "ANNOUNCE_WAIT_S", 3600.0)
    payloads = [make_payload(12, 1 << 20), make_payload(13, 1 << 20)]
    with SyncRelayClient("talker", b.daemon.socket) as r:
        _ready_to_push(a, b)
        client = r._client
        apart, announced = client._conn.session.apart, client._reader.announced
        assert apart is not None
        with SyncRelayClient("thinker", a.daemon.socket) as w:
            _learn_announced(nodes, w, r, payloads[0])
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                with apart.lock:  # this thread listens; the get cannot
                    ref = w.put(payloads[1], to_stage="talker", request_id="told")
                    get = pool.submit(r.get, ref.to_bytes())
                    wait_until(lambda: announced._fetching, DEADLINE, "the get to wait")
                    deadline = time.monotonic() + DEADLINE
                    while not get.done():  # as the get's own listening would
                        assert time.monotonic() < deadline, "no announcement heard"
                        frames = apart.listen(0.05)
                        assert frames is not None
                        for frame in frames:
                            announced.hear(frame, client._conn.daemon_epoch)
                        if frames:
                            break
                assert digest(get.result(DEADLINE)) == digest(payloads[1])
    wait_until(lambda: _count(b, a, "reads_announced") == 2, DEADLINE, "the reads counted")
    assert _no_fetch_counted(a, b)
