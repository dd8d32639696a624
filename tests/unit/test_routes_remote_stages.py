"""Which stages the client's route cache marks as on another node (their puts push)."""

from __future__ import annotations

import asyncio
from typing import Any

from relayd_client._routes import RouteKey, Routes
from relayd_client.wire.proto import relay_pb2 as pb

BIG: RouteKey = ("talker", True, (), False)
SMALL: RouteKey = ("talker", True, (), True)


class AnsweringConn:
    """Answers Route with the transport ``answers`` holds for the request's size."""

    def __init__(self, answers: dict[bool, int]) -> None:
        self.answers = answers
        self.timeout = 1.0
        self.socket_fallback = False

    def require_open(self) -> None:
        return None

    async def call(self, method: str, req: Any, timeout: float) -> pb.RouteResponse:
        assert method == "Route"
        fits = req.encoded_bytes <= 100
        return pb.RouteResponse(transport=self.answers[fits], registry_version=1)


def _ask(routes: Routes, key: RouteKey) -> int:
    return asyncio.run(routes.ask(key, 100 if key[3] else 1 << 20, False, False))


def test_a_small_put_answered_inline_keeps_a_remote_reader_marked_for_push() -> None:
    # Inline does not depend on where the reader is: it says nothing against
    # the mooncake answer of the same edge's large puts.
    conn = AnsweringConn({False: pb.TRANSPORT_MOONCAKE, True: pb.TRANSPORT_INLINE})
    routes = Routes(conn, "thinker", cuda_ipc_direct=False)  # type: ignore[arg-type]
    routes.bound(1)
    assert _ask(routes, BIG) == pb.TRANSPORT_MOONCAKE
    assert _ask(routes, SMALL) == pb.TRANSPORT_INLINE
    assert routes.remote_stages == {"talker"}
    assert routes.cached(BIG) == pb.TRANSPORT_MOONCAKE  # the large puts ask no more


def test_a_remote_reader_asked_small_first_is_marked_by_its_first_large_put() -> None:
    conn = AnsweringConn({False: pb.TRANSPORT_MOONCAKE, True: pb.TRANSPORT_INLINE})
    routes = Routes(conn, "thinker", cuda_ipc_direct=False)  # type: ignore[arg-type]
    routes.bound(1)
    assert _ask(routes, SMALL) == pb.TRANSPORT_INLINE
    assert routes.remote_stages == set()
    assert _ask(routes, BIG) == pb.TRANSPORT_MOONCAKE
    assert routes.remote_stages == {"talker"}
