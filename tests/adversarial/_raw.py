"""A hand-driven session: raw gRPC calls and raw frames, for tests that misbehave on purpose."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator

import grpc
from relayd_client.wire.framing import LENGTH_BYTES, decode_frame, encode_frame, frame_length
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.proto import relay_pb2_grpc as pb_grpc


@contextlib.contextmanager
def stub(sock: str) -> Iterator[pb_grpc.RelayStub]:
    with grpc.insecure_channel(f"unix:{sock}") as ch:
        yield pb_grpc.RelayStub(ch)


def read_frames(s: socket.socket, timeout: float) -> tuple[list[pb.SessionFrame], bool]:
    """Frames that arrive within ``timeout``, and whether the daemon closed the socket."""
    deadline = time.monotonic() + timeout
    buf = b""
    frames: list[pb.SessionFrame] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return frames, False
        s.settimeout(left)
        try:
            chunk = s.recv(1 << 16)
        except TimeoutError:
            return frames, False
        except ConnectionResetError:
            return frames, True
        if not chunk:
            return frames, True
        buf += chunk
        while len(buf) >= LENGTH_BYTES and len(buf) - LENGTH_BYTES >= frame_length(buf):
            end = LENGTH_BYTES + frame_length(buf)
            frames.append(decode_frame(buf[LENGTH_BYTES:end]))
            buf = buf[end:]


def events(frames: list[pb.SessionFrame]) -> list[pb.Event]:
    return [ev for f in frames for ev in f.event]


class RawSession:
    """Attach + bind by hand; the socket stays open for hand-made frames."""

    def __init__(self, sock: str, stage: str) -> None:
        self.path = sock
        with stub(sock) as st:
            self.attach = st.Attach(
                pb.AttachRequest(protocol_version=1, stages=[stage], pid=os.getpid()), timeout=5
            )
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.attach.session_socket)
        self.send(
            pb.SessionFrame(
                bind=pb.Bind(
                    session_id=self.attach.session_id, session_token=self.attach.session_token
                )
            )
        )
        frames, closed = read_frames(self.sock, 5)
        assert not closed and any(ev.kind == pb.EVENT_KIND_BOUND for ev in events(frames)), frames

    def send(self, f: pb.SessionFrame) -> None:
        self.sock.sendall(encode_frame(f))

    def grant(self, min_bytes: int, timeout: float = 1.0) -> pb.GrantResponse:
        with stub(self.path) as st:
            resp: pb.GrantResponse = st.Grant(
                pb.GrantRequest(
                    session_id=self.attach.session_id,
                    session_token=self.attach.session_token,
                    min_bytes=min_bytes,
                    timeout_seconds=timeout,
                ),
                timeout=timeout + 5,
            )
        return resp

    def close(self) -> None:
        self.sock.close()
