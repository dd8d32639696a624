"""The operator's session: what ``relayd status``, ``drain`` and ``top`` call through.

Status and Drain need a bound session, because only the session socket tells
the daemon who is calling (SO_PEERCRED); the full status and Drain need that
caller to be root, the daemon's uid or a member of ``--admin-gid``. The CLI
attaches, binds with ``operator`` set (no data path: it is not placed among
the stages and maps nothing), makes its calls and closes, all blocking.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

import grpc
from relayd_client.wire.errors import DaemonUnavailableError, error_from_code
from relayd_client.wire.framing import (
    LENGTH_BYTES,
    MAX_FRAME,
    decode_frame,
    encode_frame,
    frame_length,
    session_socket_path,
)
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.proto import relay_pb2_grpc as pb_grpc
from relayd_client.wire.version import PROTOCOL_VERSION

OPERATOR_STAGE = "relayd-cli"


def _read_frame(sock: socket.socket) -> pb.SessionFrame:
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise DaemonUnavailableError("the daemon closed the operator session")
            data += chunk
        return data

    n = frame_length(exactly(LENGTH_BYTES))
    if n > MAX_FRAME:
        raise DaemonUnavailableError(f"daemon sent a {n}-byte frame")
    return decode_frame(exactly(n))


class OperatorSession:
    """A bound session's id and token, and the stub to call with them."""

    def __init__(self, stub: pb_grpc.RelayStub, session_id: str, token: bytes) -> None:
        self.stub = stub
        self.session_id = session_id
        self.token = token

    def status(self, timeout: float) -> pb.StatusResponse:
        resp: pb.StatusResponse = self.stub.Status(
            pb.StatusRequest(session_id=self.session_id, session_token=self.token),
            timeout=timeout,
        )
        return resp

    def drain(self, grace: float, timeout: float) -> pb.DrainResponse:
        resp: pb.DrainResponse = self.stub.Drain(
            pb.DrainRequest(
                grace_seconds=grace, session_id=self.session_id, session_token=self.token
            ),
            timeout=timeout,
        )
        return resp


@contextlib.contextmanager
def operator_session(socket_path: str, timeout: float = 5.0) -> Iterator[OperatorSession]:
    """Attach and bind as the operator; ``grpc.RpcError`` or ``RelayError`` if refused."""
    with grpc.insecure_channel(f"unix:{socket_path}") as channel:
        stub = pb_grpc.RelayStub(channel)
        attach = stub.Attach(
            pb.AttachRequest(
                protocol_version=PROTOCOL_VERSION,
                stages=[OPERATOR_STAGE],
                pid=os.getpid(),
            ),
            timeout=timeout,
        )
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(session_socket_path(socket_path))
            bind = pb.SessionFrame(
                bind=pb.Bind(
                    session_id=attach.session_id,
                    session_token=attach.session_token,
                    operator=True,
                )
            )
            sock.sendall(encode_frame(bind))
            while True:
                frame = _read_frame(sock)
                for ev in frame.event:
                    if ev.kind == pb.EVENT_KIND_ERROR:
                        raise error_from_code(ev.code, ev.message)
                if any(ev.kind == pb.EVENT_KIND_BOUND for ev in frame.event):
                    break
            yield OperatorSession(stub, attach.session_id, attach.session_token)
