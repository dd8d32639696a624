"""A raw gRPC call to the daemon's Relay service on its own thread, as a client
that gives up at its deadline: for the tests of answers that come too late."""

from __future__ import annotations

import threading
from typing import Any

import grpc
from relayd_client.wire.proto import relay_pb2_grpc as pb_grpc


def raw_call(
    target: str,
    rpc: str,
    request: Any,
    deadline: float,
    outcome: list[object],
    ended: threading.Event,
) -> threading.Thread:
    """``Relay.<rpc>(request)`` with a ``deadline`` s timeout, started on a thread: its
    answer, or its ``grpc.RpcError``, goes in ``outcome``, and ``ended`` is set either way."""

    def call() -> None:
        try:
            with grpc.insecure_channel(target) as channel:
                outcome.append(getattr(pb_grpc.RelayStub(channel), rpc)(request, timeout=deadline))
        except grpc.RpcError as exc:
            outcome.append(exc)
        finally:
            ended.set()

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread
