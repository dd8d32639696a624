"""Every method ``relayd bench`` knows, by name, in table order.

An entry is data only: the class lives behind ``target`` ("module:Class") and is
imported in the benchmark processes, never here (those modules import torch,
which costs seconds). What the parent must decide before spawning anything, an
entry says: whether it is one process or a pair, whether it needs the daemon,
which cheap imports must work, and which sizes it applies to.

To add a method: write a class against ``relayd_bench._api`` (``PairMethod``,
``AsyncPairMethod``, ``LocalMethod`` or ``AsyncLocalMethod``) and add an
``Entry`` to ``BASELINES`` or ``RELAYD`` below.

A method with ``needs_peer_daemon`` attaches its reader to a second daemon, a
Mooncake peer of the writer's. With ``--reader-socket`` that is the user's; when
the bench starts its own daemon, it starts the peer too, on loopback, which needs
Mooncake to import here (``PEER_REQUIRES``).
"""

from __future__ import annotations

import dataclasses
import importlib

from relayd_client.wire.transport import INLINE_LIMIT

from relayd_bench._api import LATE_HANDOFF_S

STREAM = "stream"  # the workload name; runs the methods in --stream-methods


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    target: str
    summary: str
    local: bool = False  # one process (a LocalMethod) instead of a writer/reader pair
    needs_daemon: bool = False
    requires: tuple[str, ...] = ()  # "module:attr" that must import in the parent
    min_size: int = 0
    max_size: int | None = None
    size_note: str = ""
    needs_peer_daemon: bool = False  # the reader attaches to a second daemon (see above)
    cross_node: bool = False  # with --netns, writer and reader run on the two "nodes"
    # the stream workload may run several streams in one process (see JobSpec.lanes)
    shares_process: bool = True

    def unavailable(self, *, socket: str | None, reader_socket: str | None) -> str | None:
        """Why this method cannot run at all here, or None.

        ``socket`` and ``reader_socket`` are the user's ``--socket`` and
        ``--reader-socket``: without either, the bench starts the daemons itself.
        """
        why = _missing(self.requires)
        if why or not self.needs_peer_daemon or reader_socket:
            return why
        if socket:
            return "with --socket, needs --reader-socket (its Mooncake peer's daemon)"
        why = _missing(PEER_REQUIRES)
        if why:
            return f"needs Mooncake for its peer daemon, or --socket/--reader-socket; {why}"
        return None

    def skip_size(self, size: int) -> str | None:
        if size < self.min_size or (self.max_size is not None and size > self.max_size):
            return self.size_note or "does not apply at this size"
        return None


def _missing(requires: tuple[str, ...]) -> str | None:
    for req in requires:
        module, _, attr = req.partition(":")
        try:
            mod = importlib.import_module(module)
        except Exception as exc:  # any import-time failure means "not ready yet"
            return f"cannot import {module}: {type(exc).__name__}: {exc}"
        if attr and not hasattr(mod, attr):
            return f"{module} has no {attr} yet"
    return None


# What the parent must import to start a second daemon as a Mooncake peer of its own.
PEER_REQUIRES = ("mooncake.engine:TransferEngine",)

BASELINES: tuple[Entry, ...] = (
    Entry("memcpy", "relayd_bench._baselines:Memcpy", "hot in-process copy", local=True),
    Entry("floor", "relayd_bench._baselines:Floor", "pooled /dev/shm, reader copies out"),
    Entry("floor-view", "relayd_bench._baselines:FloorView", "pooled /dev/shm, zero-copy read"),
    Entry("floor-async", "relayd_bench._baselines:FloorAsync", "floor, hooks on an event loop"),
    Entry(
        "shm-per-transfer",
        "relayd_bench._baselines:ShmPerTransfer",
        "new SharedMemory segment per transfer",
    ),
    Entry("pickle-uds", "relayd_bench._baselines:PickleUds", "pickled tensor over a Unix socket"),
    Entry(
        "mooncake-raw",
        "relayd_bench._mooncake:MooncakeRaw",
        "Mooncake TE transfer_sync_read on loopback TCP",
        requires=("mooncake.engine:TransferEngine",),
        cross_node=True,
        # its sync read spins the calling thread until the bytes land: sixteen
        # spinning threads in one process starve each other, so a pair per stream
        shares_process=False,
    ),
    Entry(
        "floor-relay",
        "relayd_bench._relay_floor:FloorRelay",
        "relayd-mooncake's four processes and hops, nothing on them but the bytes: "
        "writer, forwarder, TCP, forwarder, reader",
        cross_node=True,
        shares_process=False,  # a forwarder pair per stream, as each pair of daemons serves one
    ),
    Entry(
        "mooncake-raw-late",
        "relayd_bench._mooncake:MooncakeRawLate",
        f"mooncake-raw, its DataRef handed over {LATE_HANDOFF_S * 1e3:g} ms after the write "
        "and timed from there",
        requires=("mooncake.engine:TransferEngine",),
        cross_node=True,
        shares_process=False,
    ),
)

# One Entry per way relayd moves a payload; classes in relayd_bench._relayd.
_CLIENT = ("relayd_client:RelayClient", "relayd_client:DataRef")
_SHM_NOTE = f"puts <= {INLINE_LIMIT // 1024} KiB go inline (see relayd-inline)"


def _cross_node(name: str, cls: str, what: str) -> Entry:
    """A relayd method whose reader is attached to a peer daemon (another node)."""
    return Entry(
        name,
        f"relayd_bench._relayd:{cls}",
        what,
        needs_daemon=True,
        requires=_CLIENT,
        min_size=INLINE_LIMIT + 1,
        size_note=_SHM_NOTE,
        needs_peer_daemon=True,
        cross_node=True,
    )


RELAYD: tuple[Entry, ...] = (
    Entry(
        "relayd-local",
        "relayd_bench._relayd:RelaydLocal",
        "both stages in one process (local_object)",
        local=True,
        needs_daemon=True,
        requires=_CLIENT,
    ),
    Entry(
        "relayd-inline",
        "relayd_bench._relayd:RelaydInline",
        "payload inside the DataRef",
        needs_daemon=True,
        requires=_CLIENT,
        max_size=INLINE_LIMIT,
        size_note=f"inline applies only to puts <= {INLINE_LIMIT // 1024} KiB",
    ),
    Entry(
        "relayd-shm",
        "relayd_bench._relayd:RelaydShm",
        "daemon arena, reader get() copies",
        needs_daemon=True,
        requires=_CLIENT,
        min_size=INLINE_LIMIT + 1,
        size_note=_SHM_NOTE,
    ),
    Entry(
        "relayd-sync",
        "relayd_bench._relayd:RelaydSync",
        "blocking client (SyncRelayClient), reader get() copies",
        needs_daemon=True,
        requires=(*_CLIENT, "relayd_client:SyncRelayClient"),
    ),
    Entry(
        "relayd-shm-view",
        "relayd_bench._relayd:RelaydShmView",
        "daemon arena, reader view() zero-copy",
        needs_daemon=True,
        requires=_CLIENT,
        min_size=INLINE_LIMIT + 1,
        size_note=_SHM_NOTE,
    ),
    _cross_node(
        "relayd-mooncake",
        "RelaydMooncake",
        "reader on a peer daemon; the writer's daemon pushes there (or the reader's pulls)",
    ),
    _cross_node(
        "relayd-mooncake-view",
        "RelaydMooncakeView",
        "relayd-mooncake, reader view() zero-copy (mooncake-raw reads in place too)",
    ),
    _cross_node(
        "relayd-mooncake-sync",
        "RelaydMooncakeSync",
        "relayd-mooncake with the blocking client (SyncRelayClient) on both sides",
    ),
    _cross_node(
        "relayd-mooncake-late",
        "RelaydMooncakeLate",
        f"relayd-mooncake, its DataRef handed over {LATE_HANDOFF_S * 1e3:g} ms after the put "
        "(as through a scheduler) and timed from there: the push has landed",
    ),
)

ENTRIES: dict[str, Entry] = {e.name: e for e in BASELINES + RELAYD}
# A column as wide as the longest method name and a gap: --list, progress lines.
NAME_WIDTH = max(len(name) for name in (*ENTRIES, STREAM)) + 2
DEFAULT_STREAM_METHODS = ("floor", "relayd-shm")


def known_names() -> list[str]:
    return [*ENTRIES, STREAM]


def select(spec: str | None) -> list[str]:
    """Names from a comma list ("all" or None: everything), in registry order."""
    if spec is None or spec.strip() in ("", "all"):
        return known_names()
    wanted = [p.strip() for p in spec.split(",") if p.strip()]
    groups = {"baselines": [e.name for e in BASELINES], "relayd": [e.name for e in RELAYD]}
    names: set[str] = set()
    for w in wanted:
        if w in groups:
            names.update(groups[w])
        elif w in ENTRIES or w == STREAM:
            names.add(w)
        else:
            raise ValueError(f"unknown method {w!r}; known: {', '.join(known_names())}")
    return [n for n in known_names() if n in names]
