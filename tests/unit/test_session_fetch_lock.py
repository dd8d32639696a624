"""A cross-node get's FetchCall and a blocking client's caller thread share the
pending frame: the call joins it under the session lock, so a frame the caller
swaps out and sends at that moment cannot take the call along unsent."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

from relayd_client._session import SessionChannel
from relayd_client.wire.proto import relay_pb2 as pb

WAIT_S = 10.0


class _WatchedLock:
    """An RLock that says when another thread waits for it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.waiting = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        self.waiting.set()
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class _Transport:
    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.frames.append(data)

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False


def test_a_fetch_call_is_not_lost_to_a_frame_a_caller_thread_sends() -> None:
    lock = _WatchedLock()
    channel = SessionChannel(lambda frame: None, lambda: None, lock=lock)  # type: ignore[arg-type]
    transport = _Transport()
    sent: list[pb.SessionFrame] = []
    holding = threading.Event()

    def caller() -> None:
        # A caller thread in the middle of sending the pending frame (as
        # _send_from_thread does, lock held) when the loop adds the FetchCall:
        # what it swaps out and sends must not be what the call joined.
        with lock:
            holding.set()
            lock.waiting.wait(WAIT_S)
            frame, channel._pending = channel._pending, pb.SessionFrame()
            sent.append(frame)

    async def main() -> None:
        channel._loop = asyncio.get_running_loop()
        channel._transport = transport  # type: ignore[assignment]
        thread = threading.Thread(target=caller)
        thread.start()
        assert holding.wait(WAIT_S)
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        answer.set_result(pb.FetchResponse())
        with contextlib.suppress(Exception):
            await channel.fetch(b"ref", 1.0, answer)
        thread.join(WAIT_S)
        assert not thread.is_alive()

    asyncio.run(main())
    # Else the call joined the frame outside the lock, where a caller's swap
    # can leave it in a frame already encoded and sent: lost, the get times out.
    assert not [f for f in sent if f.fetch]
    calls = [pb.SessionFrame.FromString(d[4:]) for d in transport.frames]
    assert [c.data_ref for f in calls for c in f.fetch] == [b"ref"]
