"""Event-loop factory: ``auto`` takes uvloop when it imports, asyncio otherwise."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


def loop_factory(name: str = "auto") -> Callable[[], asyncio.AbstractEventLoop]:
    if name in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if name == "uvloop":
                raise RuntimeError("--loop uvloop requested but uvloop is not installed") from None
            log.debug("uvloop not installed; using asyncio")
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop
