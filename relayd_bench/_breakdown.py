"""``relayd bench --breakdown``: where a put and a get spend their time, step by step.

One process, warm, a writer and a reader client of one daemon (the process-local
stage table hidden, so the bytes go through the arena as between processes).
Each transfer is put, ``to_bytes``, ``from_bytes``, get, stop-and-wait. For
the timed pass the client's own steps are wrapped with ``perf_counter_ns``
(the wrappers are installed here, on the two client objects and the modules
they call, and removed after: the clients carry no instrumentation of their
own, so it costs nothing when not measuring). An untimed pass before it gives
the real per-call totals; "other" is the median, over the timed pass's
transfers, of what each call spent outside its steps, wrapper overhead
included (~0.2 us a step).

Rows are medians over the measured transfers, in microseconds, for both
clients (``RelayClient`` and ``SyncRelayClient``), next to a memcpy of the
same size (the copy's own cost, timed like the table's calls), the number of
distinct lease slots the writer used in steady state, and the same memcpy
into that many buffers in turn. A writer reuses a run only once the daemon
has heard its Release, which it reads when a frame wakes it; between frames
the writer cuts fresh runs, and a copy into one that left the caches costs
up to three times a hot one. The cycled memcpy says how much of the copy
in's excess over the hot one is that. It is one process's view, where the
reader's copy out warms the writer's caches too; in two processes the lines
sit in the reader's core either way (the floor measured the same rotating
through 72 slots as through 4 at 256 KiB and 4 MiB, 8-16% slower at 1 MiB).

The daemon's side comes from the daemon the breakdown starts (not one named
by ``--socket``), run through :mod:`relayd_bench._turns`: per transfer, how
many turns it took on the clients' session frames and their CPU, and the
median turn step by step (thread CPU, in the untimed pass).

Two tables: warm, the calls back to back; and cold, each put and each get
after :data:`COLD_PAUSE_S` asleep. A third gives the daemon's lease table
alone, in this process (:mod:`relayd_bench._lease_steps`), for the sizes that
take a lease. Cold is what a stage sees: a stream's
chunks come 20 ms apart, and a stop-and-wait process sleeps a round trip
between its calls. On a small VM a call made after an idle millisecond
costs several times what it costs back to back, its caches and branch
predictors cold; a step's cold cost follows how much code and data it
touches more than its warm cost, so the cold table shows which steps to cut.
Cold steps do not add up like warm ones: the first steps after the pause
also pay for code that later ones share (the interpreter's own paths, the
timing wrappers), so read the totals as exact and the split as indicative.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from relayd_bench import _daemon, _lease_steps, _timeline, _turns
from relayd_bench._coldcall import COLD_PAUSE_S, median_us
from relayd_bench._table import fmt_size

WRITER, READER = "breakdown-writer", "breakdown-reader"
WARMUP, MEASURED = 100, 400
MIN_MEASURED = 40
# The cold table's transfers, as a share of the warm one's (its pauses dominate its time).
COLD_SHARE = 0.5

# (row label, where: "part:attr" for a method of one of the client's parts, else "module:attr")
PUT_STEPS: tuple[tuple[str, str], ...] = (
    ("a dict of tensors: keys (header remembered)", "_flatten:flat_tensors"),
    ("other payloads: flatten", "_flatten:flatten"),
    ("other payloads: header encode", "_codec:encode"),
    ("shape lookup", "writer:shape"),
    ("plan (DataRef fields, inline check)", "writer:plan"),
    ("route (cached)", "routes:cached"),
    ("lease cut (allocator)", "grants:cut"),
    ("reserve notice", "notices:reserve"),
    ("DataRef lease fields (before the copy)", "writer:_ref_for"),
    ("copy in", "_copies:pack_at"),
    ("seal: slot header, publish notice", "writer:_seal_header"),
    ("DataRef serialize + crc (to_bytes)", "dataref:to_bytes"),
)
GET_STEPS: tuple[tuple[str, str], ...] = (
    ("DataRef parse + validate (from_bytes)", "dataref:from_bytes"),
    ("stage, kind, abort checks", "reader:check_readable"),
    ("header decode", "checks:decode_header"),
    ("lease checks + layout check", "reader:lease_region"),
    ("allocate + copy out", "reader:read_region"),
    ("inline: layout check, allocate + copy out", "reader:_read_inline"),
    ("header re-check + release notice", "reader:end_read"),
    ("rebuild payload", "_flatten:rebuild"),
)
# The totals, uninstrumented: as a stage sees them (a structure put and read
# before takes its lanes, relayd_client._steady), and with the lanes off (the
# general path, whose steps the rows below them time).
PUT_TOTAL, PUT_GENERAL = "put: total (uninstrumented)", "put: general path (lanes off)"
GET_TOTAL, GET_GENERAL = "get: total (uninstrumented)", "get: general path (lanes off)"
# Steps nested in another step: shown, but not subtracted twice from "other".
NESTED = {"_flatten:flat_tensors", "_flatten:flatten", "_codec:encode", "writer:shape"}
# Not in "other"'s sum either: to_bytes runs after put returns.
UNSUMMED = NESTED | {"dataref:to_bytes"}
# What each call spent outside its steps, per transfer (wrappers included, ~0.2 us a step).
OTHER_PUT, OTHER_GET = "other:put", "other:get"
# The parts of a RelayClient whose methods are steps (its attributes `_<part>`).
PARTS = ("writer", "routes", "grants", "notices", "reader", "checks")


class _Timers:
    def __init__(self) -> None:
        self.samples: dict[str, list[int]] = {}
        self.current: dict[str, int] = {}

    def wrap(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        current = self.current
        clock = time.perf_counter_ns

        if asyncio.iscoroutinefunction(fn):

            async def timed_async(*a: Any, **kw: Any) -> Any:
                t0 = clock()
                try:
                    return await fn(*a, **kw)
                finally:
                    current[key] = current.get(key, 0) + clock() - t0

            return timed_async

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = clock()
            try:
                return fn(*a, **kw)
            finally:
                current[key] = current.get(key, 0) + clock() - t0

        return timed

    def commit(self, put_ns: int, get_ns: int) -> None:
        """End one timed transfer whose put and get took ``put_ns`` and ``get_ns``."""
        current = self.current
        for key, total, steps in ((OTHER_PUT, put_ns, PUT_STEPS), (OTHER_GET, get_ns, GET_STEPS)):
            current[key] = total - sum(current.get(w, 0) for _, w in steps if w not in UNSUMMED)
        for key, ns in current.items():
            self.samples.setdefault(key, []).append(ns)
        self.current.clear()

    def medians(self) -> dict[str, float | None]:
        """Each step's median, and each call's "other"."""
        keys = [where for _, where in PUT_STEPS + GET_STEPS] + [OTHER_PUT, OTHER_GET]
        return {key: self.median_us(key) for key in keys}

    def median_us(self, key: str) -> float | None:
        values = self.samples.get(key)
        return statistics.median(values) / 1000 if values else None


@contextlib.contextmanager
def _instrumented(timers: _Timers, writer: Any, reader: Any) -> Iterator[None]:
    """Wrap every step on the two (inner) client objects and the shared modules."""
    from relayd_client import _codec, _copies, _flatten  # type: ignore[import-not-found, unused-ignore]
    from relayd_client.wire.dataref import DataRef  # type: ignore[import-not-found, unused-ignore]

    modules = {"_flatten": _flatten, "_copies": _copies, "_codec": _codec}
    undo: list[tuple[Any, str, Any]] = []  # (owner, attribute, what was there; None: delete)
    try:
        for steps, client in ((PUT_STEPS, writer), (GET_STEPS, reader)):
            for _, where in steps:
                scope, attr = where.split(":")
                if scope in PARTS:
                    part = getattr(client, f"_{scope}")
                    setattr(part, attr, timers.wrap(where, getattr(part, attr)))
                    undo.append((part, attr, None))
                    continue
                owner: Any = DataRef if scope == "dataref" else modules[scope]
                original = owner.__dict__[attr]
                if isinstance(original, classmethod):
                    setattr(owner, attr, classmethod(timers.wrap(where, original.__func__)))
                else:
                    setattr(owner, attr, timers.wrap(where, original))
                undo.append((owner, attr, original))
        yield
    finally:
        for owner, attr, original in reversed(undo):
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)


def _payload(size: int) -> dict[str, torch.Tensor]:
    return {"t": torch.randint(0, 256, (size,), dtype=torch.uint8)}


@contextlib.contextmanager
def _lanes_off(writer: Any, reader: Any) -> Iterator[None]:
    """Every put and get of the two (inner) client objects takes the general path."""
    from relayd_client._steady import NO_LANE  # type: ignore[import-not-found, unused-ignore]

    writer._put_lanes.put = lambda *a, **kw: None
    reader._reader.lanes.read = lambda ref: NO_LANE
    try:
        yield
    finally:
        del writer._put_lanes.put, reader._reader.lanes.read


class _Result:
    def __init__(self) -> None:
        self.put_us: float = 0.0
        self.get_us: float = 0.0
        # The same transfers with the lanes off: what the steps below add up to.
        self.general_put_us: float = 0.0
        self.general_get_us: float = 0.0
        self.steps: dict[str, float | None] = {}
        self.daemon: dict[str, float | None] = {}  # its turns in the window (see _turns)
        self.window: _turns.Window | None = None  # the untimed pass's measured transfers
        self.slots = 0
        self.cycled_us: float | None = None  # the memcpy into `slots` buffers in turn
        self.transport = ""
        self._puts: list[int] = []
        self._gets: list[int] = []
        self._slots: set[int] = set()
        self._start_ns = 0

    def begin(self) -> None:
        """The measured transfers start: the daemon's turns count from here."""
        self._start_ns = time.monotonic_ns()

    def sample(self, put_ns: int, get_ns: int, ref: Any) -> None:
        """One measured transfer: its put and get times, and the lease slot it used."""
        self._puts.append(put_ns)
        self._gets.append(get_ns)
        self._slots.add(ref.proto.lease.slot)

    def totals(self, last: Any) -> None:
        """Medians of the samples; ``last``: the last DataRef put (its transport)."""
        self.window = _turns.Window(self._start_ns, time.monotonic_ns(), len(self._puts))
        self.put_us = statistics.median(self._puts) / 1000
        self.get_us = statistics.median(self._gets) / 1000
        self.slots = len(self._slots) if last.proto.HasField("lease") else 0
        self.transport = str(last.transport.value)

    def general(self, samples: list[tuple[int, int]]) -> None:
        """The medians of (put ns, get ns) of transfers with the lanes off."""
        self.general_put_us = statistics.median(p for p, _ in samples) / 1000
        self.general_get_us = statistics.median(g for _, g in samples) / 1000


def _measure_sync(sock: str, size: int, warmup: int, measured: int, pause: float) -> _Result:
    from relayd_client import DataRef, SyncRelayClient  # type: ignore[import-not-found, unused-ignore]

    out = _Result()
    payload = _payload(size)
    clock = time.perf_counter_ns

    def sleep(seconds: float) -> None:
        if seconds:
            time.sleep(seconds)

    with SyncRelayClient(WRITER, sock) as w, SyncRelayClient(READER, sock) as r:

        def transfer(request_id: str) -> tuple[int, int, Any]:
            """One transfer: (put ns, from_bytes + get ns, its DataRef)."""
            sleep(pause)
            t0 = clock()
            ref = w.put(payload, to_stage=READER, request_id=request_id)
            t1 = clock()
            wire = ref.to_bytes()
            sleep(pause)
            t2 = clock()
            r.get(DataRef.from_bytes(wire))
            return t1 - t0, clock() - t2, ref

        for i in range(warmup + measured):
            if i == warmup:
                out.begin()
            put_ns, get_ns, ref = transfer(f"b{i}")
            if i >= warmup:
                out.sample(put_ns, get_ns, ref)
        out.totals(ref)
        timers = _Timers()
        with _lanes_off(w._client, r._client):
            out.general([transfer(f"g{i}")[:2] for i in range(measured)])
            with _instrumented(timers, w._client, r._client):
                for i in range(measured):
                    put_ns, get_ns, _ = transfer(f"s{i}")
                    timers.commit(put_ns, get_ns)
        out.steps = timers.medians()
    return out


async def _measure_async(sock: str, size: int, warmup: int, measured: int, pause: float) -> _Result:
    from relayd_client import DataRef, RelayClient  # type: ignore[import-not-found, unused-ignore]

    out = _Result()
    payload = _payload(size)
    clock = time.perf_counter_ns
    async with RelayClient(WRITER, sock) as w, RelayClient(READER, sock) as r:

        async def transfer(request_id: str) -> tuple[int, int, Any]:
            """One transfer: (put ns, from_bytes + get ns, its DataRef)."""
            # Pauses on the loop, and at least one turn of it per transfer: the
            # loop reads the daemon's frames meanwhile, as between transfers.
            await asyncio.sleep(pause)
            t0 = clock()
            ref = await w.put(payload, to_stage=READER, request_id=request_id)
            t1 = clock()
            wire = ref.to_bytes()
            if pause:
                await asyncio.sleep(pause)
            t2 = clock()
            await r.get(DataRef.from_bytes(wire))
            return t1 - t0, clock() - t2, ref

        for i in range(warmup + measured):
            if i == warmup:
                out.begin()
            put_ns, get_ns, ref = await transfer(f"b{i}")
            if i >= warmup:
                out.sample(put_ns, get_ns, ref)
        out.totals(ref)
        timers = _Timers()
        with _lanes_off(w, r):
            out.general([(await transfer(f"g{i}"))[:2] for i in range(measured)])
            with _instrumented(timers, w, r):
                for i in range(measured):
                    put_ns, get_ns, _ = await transfer(f"s{i}")
                    timers.commit(put_ns, get_ns)
        out.steps = timers.medians()
    return out


def _memcpy_us(size: int, n: int, pause: float, buffers: int = 1) -> float:
    """The median memcpy of ``size`` bytes into ``buffers`` destinations in turn."""
    src = _payload(size)["t"]
    dst = itertools.cycle([torch.ones_like(src) for _ in range(buffers)]).__next__
    return median_us(lambda: dst().copy_(src), n, pause)  # ones: every page faulted in


def run(sizes: tuple[int, ...], scale: float, socket: str | None, pool: str) -> str:
    """Measure both clients at each size and return the table."""
    import relayd_client._local  # type: ignore[import-not-found, unused-ignore]

    torch.set_num_threads(1)
    # Both stages live in this process: without this the registry would hand
    # objects over by reference (local_object) and no bytes would move.
    relayd_client._local.serves = lambda stage: False
    warmup = max(MIN_MEASURED // 2, int(WARMUP * scale))
    measured = max(MIN_MEASURED, int(MEASURED * scale))
    with contextlib.ExitStack() as stack:
        daemon, turns_file = None, None
        if socket is None:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="relayd-bd-")))
            # Through the turn timers: the daemon's side of the table (see _turns).
            turns_file = tmp / "turns.jsonl"
            wrapper = _timeline.wrapper_prefix("relayd_bench._turns", turns_file)
            daemon = _daemon.start(tmp, pool, 30.0, prefix=wrapper)
            stack.callback(daemon.stop)
            socket = daemon.socket
        tables, copies = [], []
        for pause, share in ((0.0, 1.0), (COLD_PAUSE_S, COLD_SHARE)):
            results: dict[tuple[str, int], _Result] = {}
            for size in sizes:
                n = max(MIN_MEASURED, measured * (256 << 10) // max(size, 256 << 10))
                n = max(MIN_MEASURED, int(n * share))
                results["async", size] = asyncio.run(_measure_async(socket, size, warmup, n, pause))
                results["sync", size] = _measure_sync(socket, size, warmup, n, pause)
            tables.append(results)
            copies.append({size: _memcpy_us(size, int(measured * share), pause) for size in sizes})
            for (_, size), r in results.items():
                if r.slots:
                    r.cycled_us = _memcpy_us(size, int(measured * share), pause, r.slots)
        if daemon is not None and turns_file is not None:
            daemon.stop()  # it writes its turns as it exits
            turns = _turns.read(turns_file)
            for results in tables:
                for r in results.values():
                    if r.window is not None:
                        r.daemon = r.window.summary(turns)
    warm, cold = tables
    leased = _lease_steps.leased(sizes)
    return "\n".join(
        [
            render(sizes, warm, copies[0]),
            render(sizes, cold, copies[1], warm=warm),
            *([render_lease_table({s: _lease_steps.run(s) for s in leased})] if leased else []),
        ]
    )


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def render(
    sizes: tuple[int, ...],
    results: dict[tuple[str, int], _Result],
    memcpy: dict[int, float],
    warm: dict[tuple[str, int], _Result] | None = None,
) -> str:
    """One table; with ``warm`` (the warm table's results), the cold one and its ratios."""
    cols = [(c, s) for s in sizes for c in ("async", "sync")]
    title = (
        "step (median us, one process, warm)"
        if warm is None
        else f"cold: each call after {COLD_PAUSE_S * 1e3:g} ms asleep"
    )
    head = [title] + [f"{c} {fmt_size(s)}" for c, s in cols]
    rows: list[list[str]] = []

    def add(label: str, values: list[float | None], digits: int = 1) -> None:
        rows.append([label] + [_fmt(v, digits) for v in values])

    add(PUT_TOTAL, [results[k].put_us for k in cols])
    add(PUT_GENERAL, [results[k].general_put_us for k in cols])
    for label, where in PUT_STEPS:
        add(f"  {label}", [results[k].steps.get(where) for k in cols])
    add("  other", [results[k].steps.get(OTHER_PUT) for k in cols])
    add(GET_TOTAL, [results[k].get_us for k in cols])
    add(GET_GENERAL, [results[k].general_get_us for k in cols])
    for label, where in GET_STEPS:
        add(f"  {label}", [results[k].steps.get(where) for k in cols])
    add("  other", [results[k].steps.get(OTHER_GET) for k in cols])
    if warm is not None:
        rows.append(
            ["put + get, cold / warm"] + [f"x{_ratio(results[k], warm[k]):.2f}" for k in cols]
        )
    add(
        "daemon: turns on session frames per transfer",
        [results[k].daemon.get(_turns.PER_TRANSFER) for k in cols],
        digits=3,
    )
    add("  a turn (median)", [results[k].daemon.get(_turns.TURN) for k in cols])
    for label, where in _turns.STEPS:
        add(f"    {label}", [results[k].daemon.get(where) for k in cols])
    add("  turns' CPU per transfer", [results[k].daemon.get(_turns.CPU_PER_TRANSFER) for k in cols])
    add("memcpy, same size" + (", hot" if warm is None else ""), [memcpy[s] for _, s in cols])
    rows.append(["distinct lease slots in steady state"] + [str(results[k].slots) for k in cols])
    add("memcpy into that many buffers in turn", [results[k].cycled_us for k in cols])
    rows.append(["transport"] + [results[k].transport for k in cols])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "".join(_line(r, widths) for r in [head, *rows])


def render_lease_table(figures: dict[int, dict[str, float]]) -> str:
    """The daemon's lease table alone (:mod:`relayd_bench._lease_steps`), a column a size."""
    sizes = sorted(figures)
    head = [
        f"the daemon's lease table alone (CPU us a transfer, {_lease_steps.BATCH} a frame, warm)"
    ] + [fmt_size(s) for s in sizes]
    rows = [
        [f"  {label}"] + [_fmt(figures[s][key]) for s in sizes] for label, key in _lease_steps.STEPS
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "".join(_line(r, widths) for r in [head, *rows])


def _ratio(cold: _Result, warm: _Result) -> float:
    return (cold.put_us + cold.get_us) / max(warm.put_us + warm.get_us, 1e-9)


def _line(cells: list[str], widths: list[int]) -> str:
    out = [cells[0].ljust(widths[0])]
    out += [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
    return "  ".join(out).rstrip() + "\n"
