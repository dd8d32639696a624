"""The one mapping between relayd errors and gRPC status codes.

The daemon aborts an RPC with ``STATUS_FOR_CODE[err.code]`` and puts the
relayd code in the ``relayd-error-code`` trailing metadata; the client turns
any ``grpc.RpcError`` back into the matching :class:`RelayError` subclass with
:func:`from_rpc_error`. Errors raised by gRPC itself (no relayd code) are
mapped from their status alone.
"""

from __future__ import annotations

import contextlib

import grpc

from .errors import (
    DaemonUnavailableError,
    ErrorCode,
    InternalError,
    PermissionDeniedError,
    RelayError,
    RelayTimeoutError,
    error_from_code,
)

ERROR_CODE_KEY = "relayd-error-code"

STATUS_FOR_CODE: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.UNSPECIFIED: grpc.StatusCode.UNKNOWN,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.VERSION_MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.DAEMON_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.STALE_REF: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.STALE_EPOCH: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.CORRUPT_REF: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.ABORTED: grpc.StatusCode.ABORTED,
    ErrorCode.DRAINING: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.UNSAFE_PAYLOAD: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.SESSION_CLOSED: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.PEER_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.STREAM_ERROR: grpc.StatusCode.ABORTED,
    ErrorCode.KEY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
}

_FALLBACK: dict[grpc.StatusCode, type[RelayError]] = {
    grpc.StatusCode.UNAVAILABLE: DaemonUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: RelayTimeoutError,
    grpc.StatusCode.CANCELLED: DaemonUnavailableError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNAUTHENTICATED: PermissionDeniedError,
}


def _status(exc: grpc.RpcError) -> grpc.StatusCode:
    return exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN


def relayd_code(exc: grpc.RpcError) -> str | bytes | None:
    """The relayd error code the daemon sent with ``exc``, as sent; None: none."""
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    return next((value for key, value in trailing or () if key == ERROR_CODE_KEY), None)


def unanswered(exc: grpc.RpcError) -> bool:
    """Whether ``exc`` is gRPC's own UNAVAILABLE: the call got no answer from the
    daemon (its connection failed or died), not an error the daemon sent."""
    return _status(exc) == grpc.StatusCode.UNAVAILABLE and relayd_code(exc) is None


def from_rpc_error(exc: grpc.RpcError) -> RelayError:
    """The RelayError a failed RPC stands for."""
    status = _status(exc)
    details = (exc.details() if hasattr(exc, "details") else "") or str(status)
    code = relayd_code(exc)
    if code is not None:
        with contextlib.suppress(ValueError):
            return error_from_code(int(code), details)
    cls = _FALLBACK.get(status, InternalError)
    if cls is DaemonUnavailableError:
        details = f"relayd daemon unavailable: {details}"
    return cls(details)
