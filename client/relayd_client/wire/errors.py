"""The relayd error tree.

One root, one subclass per wire error code::

    RelayError
    ├── InternalError               - a bug in relayd; report it
    ├── InvalidArgumentError        - a call's arguments are wrong
    │   ├── CorruptRefError         - a DataRef failed its checksum or its layout is inconsistent
    │   └── UnsafePayloadError      - a payload needs pickle and nobody opted in
    ├── VersionMismatchError        - client and daemon (or two daemons) speak different versions
    ├── DaemonUnavailableError      - no daemon answers on the socket, or it went away
    ├── ResourceExhaustedError      - no space before the deadline (pool full, quota reached)
    ├── PermissionDeniedError       - the caller may not do this (another stage's request, uid)
    ├── NotFoundError               - no such lease, request or segment
    ├── StaleRefError               - the DataRef's lease was already read, freed or reused
    ├── StaleEpochError             - the DataRef comes from a daemon that has since restarted
    ├── AbortedError                - the request was aborted
    ├── DrainingError               - the daemon is shutting down and refuses new work
    ├── RelayTimeoutError           - a wait ran past the caller's own deadline
    ├── SessionClosedError          - the client was closed (or never opened)
    ├── PeerUnavailableError        - a remote daemon is dead, unreachable or stopped answering
    ├── StreamError                 - the writer ended the stream with put_error()
    └── KeyExistsError              - a keyed put named a key its consumer has not read yet

Every error crossing gRPC carries its code in the ``relayd-error-code``
trailing metadata; :func:`error_from_code` turns it back into the class above,
so ``except ResourceExhaustedError`` works the same on both sides.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Mirrors ``relayd.v1.ErrorCode`` one to one."""

    UNSPECIFIED = 0
    INTERNAL = 1
    INVALID_ARGUMENT = 2
    VERSION_MISMATCH = 3
    DAEMON_UNAVAILABLE = 4
    RESOURCE_EXHAUSTED = 5
    PERMISSION_DENIED = 6
    NOT_FOUND = 7
    STALE_REF = 8
    STALE_EPOCH = 9
    CORRUPT_REF = 10
    ABORTED = 11
    DRAINING = 12
    TIMEOUT = 13
    UNSAFE_PAYLOAD = 14
    SESSION_CLOSED = 15
    PEER_UNAVAILABLE = 16
    STREAM_ERROR = 17
    KEY_EXISTS = 220


class RelayError(Exception):
    """Root of every error relayd raises."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.__class__.__doc__ or self.__class__.__name__)
        self.message = message


class InternalError(RelayError):
    """Internal relayd error."""

    code = ErrorCode.INTERNAL


class InvalidArgumentError(RelayError):
    """Invalid argument."""

    code = ErrorCode.INVALID_ARGUMENT


class CorruptRefError(InvalidArgumentError):
    """The DataRef is corrupt, truncated or inconsistent."""

    code = ErrorCode.CORRUPT_REF


class UnsafePayloadError(InvalidArgumentError):
    """The payload needs a code-executing codec that was not enabled."""

    code = ErrorCode.UNSAFE_PAYLOAD


class VersionMismatchError(RelayError):
    """Protocol version mismatch."""

    code = ErrorCode.VERSION_MISMATCH


class DaemonUnavailableError(RelayError):
    """The relayd daemon is unavailable."""

    code = ErrorCode.DAEMON_UNAVAILABLE


class ResourceExhaustedError(RelayError):
    """No space became free before the deadline."""

    code = ErrorCode.RESOURCE_EXHAUSTED


class PermissionDeniedError(RelayError):
    """Permission denied."""

    code = ErrorCode.PERMISSION_DENIED


class NotFoundError(RelayError):
    """Not found."""

    code = ErrorCode.NOT_FOUND


class StaleRefError(RelayError):
    """The DataRef's lease was already released, reclaimed or reused."""

    code = ErrorCode.STALE_REF


class StaleEpochError(RelayError):
    """The DataRef was issued by an earlier run of the daemon."""

    code = ErrorCode.STALE_EPOCH


class AbortedError(RelayError):
    """The request was aborted."""

    code = ErrorCode.ABORTED


class DrainingError(RelayError):
    """The daemon is draining and accepts no new work."""

    code = ErrorCode.DRAINING


class RelayTimeoutError(RelayError):
    """The operation timed out."""

    code = ErrorCode.TIMEOUT


class SessionClosedError(RelayError):
    """The client session is closed."""

    code = ErrorCode.SESSION_CLOSED


class PeerUnavailableError(RelayError):
    """A peer daemon is unavailable: dead, unreachable, or silent for --peer-timeout."""

    code = ErrorCode.PEER_UNAVAILABLE


class StreamError(RelayError):
    """The writer ended the stream with an error."""

    code = ErrorCode.STREAM_ERROR


class KeyExistsError(RelayError):
    """The key is already waiting, unread, for the same consumer stage."""

    code = ErrorCode.KEY_EXISTS


_BY_CODE: dict[ErrorCode, type[RelayError]] = {
    cls.code: cls
    for cls in (
        InternalError, InvalidArgumentError, CorruptRefError, UnsafePayloadError,
        VersionMismatchError, DaemonUnavailableError, ResourceExhaustedError,
        PermissionDeniedError, NotFoundError, StaleRefError, StaleEpochError, AbortedError,
        DrainingError, RelayTimeoutError, SessionClosedError, PeerUnavailableError, StreamError,
        KeyExistsError,
    )
}  # fmt: skip


def error_from_code(code: int, message: str) -> RelayError:
    """The exception for a wire error code; unknown codes become InternalError."""
    try:
        cls = _BY_CODE[ErrorCode(code)]
    except (ValueError, KeyError):
        cls = InternalError
    return cls(message)
