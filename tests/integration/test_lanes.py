"""Put and read lanes (relayd_client._steady) against a real daemon: a structure put
and read before, into a lease or inline, goes through its lanes; anything else,
and any error, takes the general path and ends as it always did."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from relayd_client import (
    AbortedError,
    DataRef,
    InvalidArgumentError,
    RelayClient,
    SyncRelayClient,
    Transport,
    UnsafePayloadError,
)
from relayd_client._steady import NO_LANE

from tests._daemon import Daemon, running_daemon, wait_until
from tests._daemon import drained as _drained
from tests._daemon import metric as _metric
from tests._fixtures import separate_processes

__all__ = ["separate_processes"]  # the autouse fixture: clients here use the arena

pytestmark = pytest.mark.timeout(120)

SIZE = 256 << 10
SMALL = 1 << 10  # a payload this size goes inline, in the DataRef
CALL_TIMEOUT = 30


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    with running_daemon(str(tmp_path)) as d:
        yield d
        wait_until(lambda: _drained(d), 10, f"the arena back to zero: {d.pool()}")


def _tensor(seed: int, n: int = SIZE, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 100, (n,), dtype=torch.int64, generator=g).to(dtype)


def _digest(obj: Any) -> str:
    h = hashlib.sha256()
    for key, t in sorted(obj.items()):
        h.update(f"{key}{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Spies:
    """How many puts were planned by the general path, and which reads took a lane."""

    def __init__(self, writer: RelayClient, reader: RelayClient) -> None:
        self.planned = 0
        self.laned: list[bool] = []
        plan, read = writer._writer.plan, reader._reader.lanes.read

        def planned(*args: Any) -> Any:
            self.planned += 1
            return plan(*args)

        def laned(ref: DataRef) -> Any:
            got = read(ref)
            self.laned.append(got is not NO_LANE)
            return got

        writer._writer.plan = planned  # type: ignore[method-assign]
        reader._reader.lanes.read = laned  # type: ignore[method-assign]


def _sync_pair(daemon: Daemon) -> tuple[SyncRelayClient, SyncRelayClient, Spies]:
    w = SyncRelayClient("thinker", daemon.socket)
    r = SyncRelayClient("talker", daemon.socket)
    w.open()
    r.open()
    return w, r, Spies(w._client, r._client)


def test_repeated_blocking_puts_and_gets_go_through_their_lanes(daemon: Daemon) -> None:
    w, r, spies = _sync_pair(daemon)
    with w, r:
        for i in range(5):
            payload = {"h": _tensor(i), "scale": _tensor(100 + i, 64, torch.float32)}
            ref = w.put(payload, to_stage="talker", request_id="q", chunk_id=i)
            assert ref.chunk_id == i
            assert _digest(r.get(ref.to_bytes())) == _digest(payload)
    assert spies.planned == 1  # the first put only
    assert spies.laned == [False, True, True, True, True]


@pytest.mark.parametrize(("size", "transport"), [(SIZE, Transport.SHM), (SMALL, Transport.INLINE)])
def test_repeated_async_puts_and_gets_go_through_their_lanes(
    daemon: Daemon, size: int, transport: Transport
) -> None:
    async def main() -> tuple[int, list[bool]]:
        async with (
            RelayClient("thinker", daemon.socket) as w,
            RelayClient("talker", daemon.socket) as r,
        ):
            spies = Spies(w, r)
            for i in range(5):
                payload = {"h": _tensor(i, size)}
                ref = await w.put(payload, to_stage="talker", request_id=f"q{i}")
                assert ref.transport is transport
                assert _digest(await r.get(ref.to_bytes())) == _digest(payload)
            return spies.planned, spies.laned

    planned, laned = asyncio.run(asyncio.wait_for(main(), CALL_TIMEOUT))
    assert planned == 1
    assert laned == [False, True, True, True, True]


# Puts a lane does not cover, after a lane for {"h": uint8[SIZE]} without a chunk id.
OTHERS: dict[str, Callable[[int], tuple[dict[str, Any], int | None]]] = {
    "another dtype": lambda i: ({"h": _tensor(i, SIZE // 2, torch.int16)}, None),
    "another shape": lambda i: ({"h": _tensor(i, SIZE - 64)}, None),
    "another key": lambda i: ({"g": _tensor(i)}, None),
    "one more key": lambda i: ({"h": _tensor(i), "g": _tensor(i + 1)}, None),
    "not contiguous": lambda i: ({"h": _tensor(i, 2 * SIZE)[::2]}, None),
    "a chunk": lambda i: ({"h": _tensor(i)}, 0),
}


@pytest.mark.parametrize("other", list(OTHERS))
def test_a_put_a_lane_does_not_cover_takes_the_general_path(daemon: Daemon, other: str) -> None:
    w, r, spies = _sync_pair(daemon)
    with w, r:
        for i in range(2):  # learned, then taken
            payload = {"h": _tensor(i)}
            assert _digest(r.get(w.put(payload, to_stage="talker", request_id="q"))) == (
                _digest(payload)
            )
        assert spies.planned == 1
        payload, chunk = OTHERS[other](7)
        ref = w.put(payload, to_stage="talker", request_id="q", chunk_id=chunk)
        assert spies.planned == 2
        assert _digest(r.get(ref.to_bytes())) == _digest(payload)


def test_one_tensor_under_two_keys_takes_the_general_path(daemon: Daemon) -> None:
    w, r, spies = _sync_pair(daemon)
    with w, r:
        for i in range(2):
            payload = {"a": _tensor(i), "b": _tensor(i + 1)}
            r.get(w.put(payload, to_stage="talker", request_id="q"))
        assert spies.planned == 1
        t = _tensor(5)
        ref = w.put({"a": t, "b": t}, to_stage="talker", request_id="q")
        assert spies.planned == 2
        got = r.get(ref.to_bytes())
        assert torch.equal(got["a"], t) and got["a"] is got["b"]  # one slot, as put


def test_a_laned_put_raises_what_the_general_put_raises(daemon: Daemon) -> None:
    w, r, spies = _sync_pair(daemon)
    with w, r:
        payload = {"h": _tensor(0)}
        r.get(w.put(payload, to_stage="talker", request_id="q", chunk_id=0))
        w.abort("gone")
        errors, planned = [], []
        for _ in range(2):  # through the lane learned above, then with no lane to take
            for call in (
                lambda: w.put(payload, to_stage="talker", request_id="", chunk_id=1),
                lambda: w.put(payload, to_stage="talker", request_id="q", chunk_id=-1),
                lambda: w.put(payload, to_stage="talker", request_id="gone", chunk_id=1),
            ):
                with pytest.raises((InvalidArgumentError, AbortedError)) as caught:
                    call()
                errors.append((type(caught.value), str(caught.value)))
            planned.append(spies.planned)
            w._client._put_lanes._lanes.clear()
        # The lane refused the bad names itself; the aborted request it left to the
        # general path, which planned it and raised. Without the lane, all three planned.
        assert planned == [2, 5]
        assert errors[:3] == errors[3:]
        assert [e[0] for e in errors[:3]] == [InvalidArgumentError] * 2 + [AbortedError]


def test_a_lane_asks_the_router_again_once_its_answer_is_forgotten(daemon: Daemon) -> None:
    w, r, spies = _sync_pair(daemon)
    with w, r:
        for i in range(2):
            r.get(w.put({"h": _tensor(i)}, to_stage="talker", request_id="q"))
        assert spies.planned == 1
        w._client._routes.forget()  # what a new registry version does
        payload = {"h": _tensor(9)}
        ref = w.put(payload, to_stage="talker", request_id="q")
        assert spies.planned == 2
        assert _digest(r.get(ref.to_bytes())) == _digest(payload)
        r.get(w.put(payload, to_stage="talker", request_id="q"))
        assert spies.planned == 2  # learned again


def test_repeated_small_puts_and_gets_go_through_their_inline_lanes(tmp_path: Path) -> None:
    with running_daemon(str(tmp_path), metrics=True) as d:
        w, r, spies = _sync_pair(d)
        with w, r:
            for i in range(5):
                payload = {"h": _tensor(i, SMALL), "scale": _tensor(50 + i, 8, torch.float32)}
                ref = w.put(payload, to_stage="talker", request_id="q")  # (a chunk is leased)
                assert ref.transport is Transport.INLINE
                assert _digest(r.get(ref.to_bytes())) == _digest(payload)
        assert spies.planned == 1
        assert spies.laned == [False, True, True, True, True]
        # A put through its lane is counted as any inline put is.
        wait_until(
            lambda: _metric(d.scrape(), "relayd_transfers_total", transport="inline") == 5,
            10,
            "five inline transfers counted",
        )
        assert _drained(d)


def test_an_inline_lane_gives_way_to_the_route_and_to_an_abort(daemon: Daemon) -> None:
    w, r, spies = _sync_pair(daemon)
    with w, r:
        for i in range(2):
            r.get(w.put({"h": _tensor(i, SMALL)}, to_stage="talker", request_id="q").to_bytes())
        assert (spies.planned, spies.laned) == (1, [False, True])
        w._client._routes.forget()  # what a new registry version does
        payload = {"h": _tensor(9, SMALL)}
        ref = w.put(payload, to_stage="talker", request_id="q")
        assert spies.planned == 2  # asked the router again
        # An inline DataRef of a request the reader aborted is refused, lane or not.
        r.abort("q")
        with pytest.raises(AbortedError):
            r.get(ref.to_bytes())
        assert spies.laned == [False, True, False]
        r.get(w.put(payload, to_stage="talker", request_id="q2").to_bytes())
        assert spies.laned == [False, True, False, True]  # the lane stays


@pytest.mark.parametrize("size", [SIZE, SMALL])
def test_a_pickled_put_neither_teaches_nor_takes_a_lane(daemon: Daemon, size: int) -> None:
    """``pickle=True`` encodes the header with pickle, which a reader refuses unless
    it opted in: a lane learned from such a put would send the next plain put's
    header pickled too, and a pickled put through a plain lane would not be one."""
    w, r, spies = _sync_pair(daemon)
    with w, r, SyncRelayClient("talker", daemon.socket, allow_pickle=True) as rp:
        pickled = w.put({"h": _tensor(0, size)}, to_stage="talker", request_id="q", pickle=True)
        assert _digest(rp.get(pickled.to_bytes())) == _digest({"h": _tensor(0, size)})
        for i in range(1, 4):  # plain puts: the first learns a lane, the rest take it
            payload = {"h": _tensor(i, size)}
            ref = w.put(payload, to_stage="talker", request_id="q")
            assert _digest(r.get(ref.to_bytes())) == _digest(payload)
        assert spies.planned == 2
        pickled = w.put({"h": _tensor(9, size)}, to_stage="talker", request_id="q", pickle=True)
        assert spies.planned == 3  # not through the lane
        with pytest.raises(UnsafePayloadError):
            r.get(pickled.to_bytes())  # a reader that did not opt in refuses it, as asked
        assert _digest(rp.get(pickled.to_bytes())) == _digest({"h": _tensor(9, size)})


def test_an_async_pickled_put_takes_no_lane(daemon: Daemon) -> None:
    async def main() -> int:
        async with (
            RelayClient("thinker", daemon.socket) as w,
            RelayClient("talker", daemon.socket, allow_pickle=True) as r,
        ):
            spies = Spies(w, r)
            for pickle in (False, False, True):
                payload = {"h": _tensor(int(pickle), SMALL)}
                ref = await w.put(payload, to_stage="talker", request_id="q", pickle=pickle)
                assert _digest(await r.get(ref.to_bytes())) == _digest(payload)
            return spies.planned

    assert asyncio.run(asyncio.wait_for(main(), CALL_TIMEOUT)) == 2  # the first, the pickled


def _put_fields(ref: DataRef) -> dict[str, Any]:
    """A put's DataRef as the reader sees it, but for what each put draws anew:
    its object id, and its lease's place and ids."""
    m = ref.fields
    lease = m.lease
    return {
        "shape": m.shape.wire,
        "transport": m.transport,
        "push": m.push,
        "chunk_id": m.chunk_id,
        "request_id": m.request_id,
        "inline_data": m.inline_data,
        "lease": (lease.pool, lease.length, lease.nslots, lease.generation == lease.lease_id),
    }


@pytest.mark.parametrize(("size", "transport"), [(SIZE, Transport.SHM), (SMALL, Transport.INLINE)])
def test_a_put_through_its_lane_makes_the_general_paths_dataref(
    daemon: Daemon, size: int, transport: Transport
) -> None:
    w, r, spies = _sync_pair(daemon)
    with w, r:
        payload = {"h": _tensor(3, size), "scale": _tensor(4, 16, torch.float32)}
        general = w.put(payload, to_stage="talker", request_id="q")
        laned = w.put(payload, to_stage="talker", request_id="q")
        assert spies.planned == 1
        assert general.transport is laned.transport is transport
        assert _put_fields(laned) == _put_fields(general)
        assert laned.fields.object_id != general.fields.object_id
        for ref in (general, laned):
            assert _digest(r.get(ref.to_bytes())) == _digest(payload)
