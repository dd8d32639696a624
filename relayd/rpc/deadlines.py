"""A gRPC call's deadline, as the daemon's handlers that wait or hold something keep it.

A handler that waits (for space, for a pull) stops :data:`ANSWER_TIME_S`
before the call's deadline (:func:`within_deadline`), for its answer to reach
the caller in time. One that gets to its answer with less than half of that
left (:func:`too_late`: its loop was busy) answers a caller that has given up
or is about to: whatever the answer would hand over (a grant, a lease, a
keyed entry) is given back, or never made, and the call fails with
RelayTimeoutError.

The server's deadline is the caller's timeout from the request's arrival, so
it comes no sooner than the caller's: a call this deems in time may still
reach a caller that gave up (a stalled caller, an answer slow on the wire).

A call on the session socket has no deadline of its own: one whose wait may
outlast its caller (a keyed put handed to another node) carries the caller's
timeout, cut the same way (:func:`within_timeout`); the client waits a grace
longer than that timeout, for the answer's way back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeAlias

from relayd_client.wire.errors import RelayTimeoutError

log = logging.getLogger(__name__)

# grpc ships no type stubs; the servicer context is untyped.
Ctx: TypeAlias = Any

# A call that waits stops this long before its deadline, for the answer to
# reach the client in time.
ANSWER_TIME_S = 0.05


def within_deadline(timeout: float, context: Ctx) -> float:
    """``timeout``, cut to end :data:`ANSWER_TIME_S` before the call's deadline."""
    remaining: float | None = context.time_remaining()
    if remaining is None:
        return timeout
    return min(timeout, max(remaining - ANSWER_TIME_S, 0.0))


def too_late(context: Ctx) -> bool:
    """The call has less than half of :data:`ANSWER_TIME_S` left: an answer sent
    now would not reach its caller in time."""
    remaining: float | None = context.time_remaining()
    return remaining is not None and remaining < ANSWER_TIME_S / 2


def give_back_if_too_late(
    context: Ctx, what: str, taken_back: str, session_id: str, give_back: Callable[[], object]
) -> None:
    """When the call is :func:`too_late`: ``give_back()`` what its answer would hand
    over (logged as ``taken_back``, "grant 7 taken back"), before anything is sent, so
    no answer ever names it, and fail the call with RelayTimeoutError.

    A caller that never learns what it was handed (a grant's id, a lease) cannot
    give it back, and it would stay held until its session closes or its TTL.
    """
    if not too_late(context):
        return
    log.info("%s: its answer would come too late", taken_back, extra={"session_id": session_id})
    give_back()
    raise RelayTimeoutError(f"the {what} came too late for the call's deadline")


def within_timeout(timeout: float) -> float | None:
    """A session call's ``timeout`` (its caller's, from the frame's arrival), cut to end
    :data:`ANSWER_TIME_S` before it; None: the call says none (<= 0 or NaN)."""
    if not timeout > 0:
        return None
    return max(timeout - ANSWER_TIME_S, 0.0)
