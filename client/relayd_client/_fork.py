"""Which process a session belongs to, across ``fork()``.

A session is usable only in the process that opened it. A forked child shares
the parent's session socket, grants, arena mapping and event loop's epoll set:
a put there would cut a lease from slots the parent also hands out, and a
close there would reach the parent's socket and loop. Nor can a child open a
session of its own once its parent opened one: gRPC's asyncio stack does not
survive a fork (an Attach there hung until its deadline, with or without
``GRPC_ENABLE_FORK_SUPPORT``). A child forked before any session was opened is
a process like any other.
"""

from __future__ import annotations

import os

from .wire.errors import SessionClosedError

HINT = (
    "start stage processes with multiprocessing's 'spawn' method, or open clients "
    "only in the processes that use them"
)

#: Forks this process has been through (counted in the child). A connection
#: keeps the count it was opened at; a different one means "forked since".
forks = 0
_opened_here = False  # this process opened a session, so it started gRPC
_opened_before_fork = False  # this process is a fork of one that had


def _count() -> None:
    global forks, _opened_before_fork
    forks += 1
    _opened_before_fork = _opened_before_fork or _opened_here


os.register_at_fork(after_in_child=_count)


def opening() -> int:
    """A session is about to open here: the fork count to keep with it.

    SessionClosedError in a child forked after its parent opened one.
    """
    global _opened_here
    if _opened_before_fork:
        raise SessionClosedError(
            "this process was forked from one that had opened a relayd client, and "
            f"gRPC does not work in such a child; {HINT}"
        )
    _opened_here = True
    return forks


def refused(opened_pid: int) -> SessionClosedError:
    """The error for a call on a session opened by ``opened_pid`` before a fork."""
    return SessionClosedError(
        f"this client was opened in process {opened_pid}, before a fork: a "
        f"forked child cannot use its parent's session; {HINT}"
    )
