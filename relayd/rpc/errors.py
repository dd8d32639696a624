"""Exception -> gRPC status at the daemon's boundary (the inverse lives in the client)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from relayd_client.wire.errors import InternalError, RelayError
from relayd_client.wire.status import ERROR_CODE_KEY, STATUS_FOR_CODE

log = logging.getLogger(__name__)

R = TypeVar("R")


async def abort_with(context: grpc.aio.ServicerContext[Any, Any], err: RelayError) -> None:
    context.set_trailing_metadata(((ERROR_CODE_KEY, str(int(err.code))),))
    await context.abort(STATUS_FOR_CODE[err.code], err.message or str(err))


def mapped(
    fn: Callable[..., Awaitable[R]],
) -> Callable[..., Awaitable[R]]:
    """Decorate a servicer method: RelayError -> its status, anything else -> INTERNAL."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> R:
        try:
            return await fn(self, request, context)
        except RelayError as err:
            await abort_with(context, err)
        except Exception as exc:
            # context.abort raises its own exception type; only real bugs land here.
            if isinstance(exc, grpc.aio.AbortError):
                raise
            log.exception("internal error in %s", fn.__name__)
            await abort_with(context, InternalError(f"{type(exc).__name__}: {exc}"))
        raise AssertionError("unreachable")  # abort() always raises

    return wrapper
