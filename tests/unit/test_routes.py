"""The client's route cache: an answer is kept exactly while no newer registry was seen."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from relayd_client._routes import RouteKey, Routes
from relayd_client.wire.proto import relay_pb2 as pb

KEY: RouteKey = ("talker", True, (), False)


class FakeConn:
    """Answers Route at ``version``; ``during`` runs while the call is in flight."""

    def __init__(self, version: int, during: Callable[[], None] = lambda: None) -> None:
        self.version = version
        self.during = during
        self.calls = 0
        self.timeout = 1.0
        self.socket_fallback = False

    def require_open(self) -> None:
        return None

    async def call(self, method: str, req: Any, timeout: float) -> pb.RouteResponse:
        assert method == "Route"
        self.calls += 1
        self.during()
        await asyncio.sleep(0)
        return pb.RouteResponse(transport=pb.TRANSPORT_SHM, registry_version=self.version)


def _routes(conn: FakeConn, seen: int) -> Routes:
    routes = Routes(conn, "thinker", cuda_ipc_direct=False)  # type: ignore[arg-type]
    routes.registry_version = seen
    return routes


def test_an_answer_is_cached_when_its_registry_event_lands_during_the_call() -> None:
    # The reader's bind announces v2 while the writer's first Route is in
    # flight, and the daemon answered at v2: the answer is current.
    conn = FakeConn(2)
    routes = _routes(conn, 1)
    conn.during = lambda: routes.registry(2)
    assert asyncio.run(routes.ask(KEY, 100, False, False)) == pb.TRANSPORT_SHM
    assert routes.cached(KEY) == pb.TRANSPORT_SHM
    assert routes.registry_version == 2


def test_an_answer_older_than_an_event_seen_during_the_call_is_not_cached() -> None:
    conn = FakeConn(2)
    routes = _routes(conn, 1)
    conn.during = lambda: routes.registry(3)
    assert asyncio.run(routes.ask(KEY, 100, False, False)) == pb.TRANSPORT_SHM
    assert routes.cached(KEY) is None
    assert routes.registry_version == 3


def test_a_newer_answer_than_any_event_is_cached_and_a_new_event_drops_it() -> None:
    conn = FakeConn(5)
    routes = _routes(conn, 1)
    asyncio.run(routes.ask(KEY, 100, False, False))
    assert (routes.cached(KEY), routes.registry_version) == (pb.TRANSPORT_SHM, 5)
    routes.registry(5)  # the event of the answer's own version, arriving late
    assert routes.cached(KEY) == pb.TRANSPORT_SHM
    routes.registry(6)
    assert routes.cached(KEY) is None


def test_an_event_older_than_the_answer_taken_changes_nothing() -> None:
    routes = _routes(FakeConn(4), 1)
    asyncio.run(routes.ask(KEY, 100, False, False))
    routes.registry(3)  # sent before the answer, on the session socket
    assert (routes.cached(KEY), routes.registry_version) == (pb.TRANSPORT_SHM, 4)


def test_a_new_bind_forgets_every_answer_even_at_a_lower_version() -> None:
    # A restarted daemon counts its registry from the start again.
    routes = _routes(FakeConn(4), 1)
    asyncio.run(routes.ask(KEY, 100, False, False))
    routes.remote_stages.add("talker")
    routes.bound(1)
    assert (routes.cached(KEY), routes.registry_version, routes.remote_stages) == (None, 1, set())
