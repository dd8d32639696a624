"""Per-edge metrics with a real daemon: writers and readers in their own processes.

Every transfer is counted once per edge, under the transport its DataRef
carries, and every put and get lands in one histogram bucket of its edge;
clients flush their reports when they close, so once the workers have exited
the numbers are exact.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import pytest
from relayd_client import DataRef, RelayClient

from tests._daemon import (
    Daemon,
    drained,
    isolated_worker,
    lines,
    run_worker,
    running_daemon,
    spawn_worker,
    unshare_available,
    wait_until,
)
from tests._daemon import metric as _metric

pytestmark = pytest.mark.timeout(240)

MiB = 1 << 20
SMALL = 200  # a payload this size rides inline


def _families(text: str) -> dict[tuple[str, str, str, str], float]:
    """(sample name, from_stage, to_stage, transport) -> value, per-edge samples only."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "from_stage" in s.labels and s.name in (
                "relayd_edge_transfers_total",
                "relayd_edge_bytes_total",
                "relayd_put_seconds_count",
                "relayd_get_seconds_count",
            ):
                key = (s.name, s.labels["from_stage"], s.labels["to_stage"], s.labels["transport"])
                out[key] = s.value
    return out


def _counts(text: str, name: str) -> dict[tuple[str, str, str], int]:
    return {k[1:]: int(v) for k, v in _families(text).items() if k[0] == name}


def _lease_bytes(refs: list[str]) -> int:
    """What the daemon counts for leased puts: each lease's packed length."""
    return sum(DataRef.from_bytes(bytes.fromhex(r.split()[0])).proto.lease.length for r in refs)


def _inline_bytes(refs: list[str]) -> int:
    return sum(len(DataRef.from_bytes(bytes.fromhex(r.split()[0])).proto.inline_data) for r in refs)


def _read(d: Daemon, stage: str, refs: list[str]) -> list[str]:
    cp = run_worker(
        ["read", "--socket", d.socket, "--stage", stage],
        input="".join(r + "\n" for r in refs).encode() + b"\n",
    )
    return lines(cp)[1:]


def _write(d: Daemon, stage: str, to: str, sizes: list[int], *extra: str) -> list[str]:
    sizes_arg = ",".join(str(s) for s in sizes)
    cmd = ["write", "--socket", d.socket, "--stage", stage, "--to", to, "--sizes", sizes_arg]
    return lines(run_worker([*cmd, "--split", *extra]))


def _ready(proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"READY", proc
    return proc


def _finish(proc: subprocess.Popen[bytes], refs: list[str]) -> list[str]:
    """Feed a started reader ``refs``, end its input, return the digests it printed."""
    out, err = proc.communicate("".join(r + "\n" for r in refs).encode() + b"\n", timeout=60)
    assert proc.returncode == 0, err.decode()[-2000:]
    return out.decode().splitlines()


@pytest.mark.skipif(not unshare_available(), reason="needs root and unshare --mount")
def test_every_transport_is_counted_per_edge_with_its_latencies(tmp_path: object) -> None:
    with running_daemon(str(tmp_path), metrics=True) as d:
        # Readers attach first, as a pipeline's stages do: only stages that
        # attached become label values. One of them cannot map the arena: the
        # writer's puts to it are routed (and counted) as socket transfers.
        near = _ready(spawn_worker(["read", "--socket", d.socket, "--stage", "r"]))
        far = _ready(isolated_worker(["read", "--socket", d.socket, "--stage", "far"]))

        shm = _write(d, "w", "r", [MiB, 2 * MiB])
        inline = _write(d, "w", "r", [SMALL, SMALL, SMALL])
        sock = _write(d, "w", "far", [MiB, MiB, MiB])
        transports = [x.split()[2] for x in shm + inline + sock]
        assert transports == ["shm"] * 2 + ["inline"] * 3 + ["socket"] * 3
        assert _finish(far, sock) == [x.split()[1] for x in sock]

        # A writer that cannot map the arena hands its bytes to the daemon.
        up = isolated_worker(
            ["write", "--socket", d.socket, "--stage", "far-w", "--to", "r", "--sizes", str(MiB)]
        )
        out, err = up.communicate(timeout=60)
        assert up.returncode == 0, err.decode()[-2000:]
        up_refs = out.decode().splitlines()
        assert [x.split()[2] for x in up_refs] == ["socket"]
        assert _finish(near, shm + inline + up_refs) == [
            x.split()[1] for x in shm + inline + up_refs
        ]

        # Two stages in one process exchange the object itself.
        local = lines(
            run_worker(["local", "--socket", d.socket, "--stage", "lw", "--to", "lr",
                        "--sizes", f"{MiB},{MiB}"])
        )  # fmt: skip
        assert local == ["local_object True"] * 2

        wait_until(lambda: drained(d), 10, "arena back to zero")
        text = d.scrape()
        transfers = {
            ("w", "r", "shm"): 2,
            ("w", "r", "inline"): 3,
            ("w", "far", "socket"): 3,
            ("far-w", "r", "socket"): 1,
            ("lw", "lr", "local_object"): 2,
        }
        # Exactly these series, each transfer once (the workers have exited and
        # flushed their reports; the daemon counted the leased ones itself).
        assert _counts(text, "relayd_edge_transfers_total") == transfers
        assert _counts(text, "relayd_put_seconds_count") == transfers
        assert _counts(text, "relayd_get_seconds_count") == transfers
        nbytes = _counts(text, "relayd_edge_bytes_total")
        assert nbytes[("w", "r", "shm")] == _lease_bytes(shm)
        assert nbytes[("w", "r", "inline")] == _inline_bytes(inline)
        assert nbytes[("w", "far", "socket")] == _lease_bytes(sock)
        assert nbytes[("far-w", "r", "socket")] == _lease_bytes(up_refs)
        assert nbytes[("lw", "lr", "local_object")] >= 2 * MiB

        # Node-wide counters agree with the per-edge ones: no transfer twice.
        for transport, n in (("shm", 2), ("inline", 3), ("socket", 4), ("local_object", 2)):
            assert _metric(text, "relayd_transfers_total", transport=transport) == n, transport
        # Buckets are cumulative, 10 us to 10 s, and end at +Inf with the count.
        bucket = re.findall(
            r'relayd_put_seconds_bucket\{from_stage="w",le="([^"]+)",to_stage="r",'
            r'transport="shm"\} (\S+)',
            text,
        )
        assert bucket, text[-2000:]
        values = [float(v) for _, v in bucket]
        assert values == sorted(values) and bucket[-1] == ("+Inf", "2.0")
        assert bucket[0][0] == "1e-05" and bucket[-2][0] == "10.0"

        # status --json carries the same per-edge numbers.
        st = d.status()
        rows = {(e["from_stage"], e["to_stage"], e["transport"]): e for e in st["edge_traffic"]}
        assert {k: int(v["transfers"]) for k, v in rows.items()} == {
            (src, dst, f"TRANSPORT_{t.upper()}"): n for (src, dst, t), n in transfers.items()
        }
        row = rows[("w", "r", "TRANSPORT_SHM")]
        assert sum(int(x) for x in row["put_buckets"]) == 2
        assert sum(int(x) for x in row["get_buckets"]) == 2
        assert 0 < row["put_p50_seconds"] <= row["put_p99_seconds"] <= 10
        assert len(st["latency_bucket_bounds"]) + 1 == len(row["put_buckets"])


def test_shm_reader_of_a_socket_edge_is_counted_once(tmp_path: object) -> None:
    """Regression: three puts to a socket-fallback reader were counted shm 3, socket 3."""
    if not unshare_available():
        pytest.skip("needs root and unshare --mount")
    with running_daemon(str(tmp_path), metrics=True) as d:
        reader = isolated_worker(["read", "--socket", d.socket])
        assert reader.stdout is not None
        assert reader.stdout.readline().strip() == b"READY"
        refs = lines(run_worker(["write", "--socket", d.socket, "--split", "--count", "3"]))
        out, err = reader.communicate("".join(r + "\n" for r in refs).encode() + b"\n", timeout=60)
        assert reader.returncode == 0, err.decode()[-2000:]
        assert out.decode().splitlines() == [r.split()[1] for r in refs]
        wait_until(lambda: drained(d), 10, "arena back to zero")
        text = d.scrape()
        counted = {
            t: _metric(text, "relayd_transfers_total", transport=t) for t in ("shm", "socket")
        }
        assert counted == {"shm": 0, "socket": 3}


def test_a_flood_of_stage_names_keeps_the_series_bounded(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,000 attached stage names (63 sessions of 16) and 1,000 more never attached."""
    import relayd_client._local

    # All sessions share this process: hide the local stage table, so that
    # their small puts travel inline as between processes.
    monkeypatch.setattr(relayd_client._local, "serves", lambda stage: False)
    names = [f"s{i:04d}" for i in range(1008)]

    async def flood(sock: str) -> None:
        clients = [RelayClient(names[i : i + 16], sock) for i in range(0, len(names), 16)]
        for c in clients:
            await c.open()
        try:
            for i, c in enumerate(clients):
                for j in range(16):
                    await c.put({"x": j}, to_stage=names[(i * 16 + j + 16) % len(names)],
                                request_id="f")  # fmt: skip
                    await c.put({"x": j}, to_stage=f"nobody-{i}-{j}", request_id="f")
        finally:
            for c in clients:
                await c.close()

    with running_daemon(str(tmp_path), "--max-edge-labels", "64", metrics=True) as d:
        asyncio.run(asyncio.wait_for(flood(d.socket), 120))

        def counted() -> dict[tuple[str, str, str], int]:
            got = _counts(d.scrape(), "relayd_edge_transfers_total")
            return got if sum(got.values()) == 2 * len(names) else {}

        series = wait_until(counted, 30, "every inline put counted")
        edges = {(src, dst) for src, dst, _ in series}
        assert len(edges) == 64 + 1
        assert series[("other", "other", "inline")] == 2 * len(names) - 64
        text = d.scrape()
        assert len(_counts(text, "relayd_put_seconds_count")) == 64 + 1
        assert all(re.fullmatch(r"s\d{4}|other", s) for e in edges for s in e)


def test_a_trace_id_reaches_the_daemons_debug_log(tmp_path: object) -> None:
    with running_daemon(str(tmp_path), "--log-level", "debug") as d:
        refs = lines(
            run_worker(["write", "--socket", d.socket, "--request", "req-t", "--trace-id",
                        "4bf92f3577b34da6a3ce929d0e0e4736"])
        )  # fmt: skip
        lease_id = DataRef.from_bytes(bytes.fromhex(refs[0].split()[0])).proto.lease.lease_id
        _read(d, "talker", refs)
        log = wait_until(
            lambda: next(
                (x for x in d.log().splitlines() if "4bf92f3577b34da6a3ce929d0e0e4736" in x), ""
            ),
            10,
            "the trace id in the log",
        )
        assert "put traced" in log and str(lease_id) in log and "req-t" in log, log


def test_live_edges_report_gets_and_status_shows_their_transfers(tmp_path: object) -> None:
    """Processes that stay up report within their linger; status counts transfers per edge."""
    with running_daemon(str(tmp_path), metrics=True) as d:
        reader = _ready(spawn_worker(["read", "--socket", d.socket]))
        writer = spawn_worker(["write", "--socket", d.socket, "--split", "--count", "2", "--hold"])
        assert writer.stdout is not None and reader.stdout is not None and reader.stdin is not None
        refs = [writer.stdout.readline().decode().strip() for _ in range(2)]
        assert writer.stdout.readline().strip() == b"HOLDING"
        reader.stdin.write("".join(r + "\n" for r in refs).encode())
        reader.stdin.flush()
        assert [reader.stdout.readline().decode().strip() for _ in refs] == [
            r.split()[1] for r in refs
        ]
        want = {("thinker", "talker", "shm"): 2}
        wait_until(
            lambda: (
                _counts(d.scrape(), "relayd_get_seconds_count") == want
                and _counts(d.scrape(), "relayd_put_seconds_count") == want
            ),
            10,
            "both ends' latencies reported while they run",
        )
        text = subprocess.run(
            [sys.executable, "-m", "relayd", "status", "--socket", d.socket],
            capture_output=True,
            timeout=60,
            check=True,
        ).stdout.decode()
        header = next(x for x in text.splitlines() if x.strip().startswith("EDGE "))
        assert header.split()[:3] == ["EDGE", "TRANSPORT", "TRANSFERS"], text
        row = next(x for x in text.splitlines() if x.strip().startswith("thinker -> talker"))
        assert row.split()[3:5] == ["shm", "2"], text
        as_json = json.loads(
            subprocess.run(
                [sys.executable, "-m", "relayd", "status", "--json", "--socket", d.socket],
                capture_output=True,
                timeout=60,
                check=True,
            ).stdout
        )
        (edge,) = as_json["edge_traffic"]
        assert (edge["from_stage"], edge["to_stage"], edge["transport"]) == (
            "thinker",
            "talker",
            "shm",
        )
        assert edge["transfers"] == 2 and sum(edge["put_buckets"]) == 2
        assert sum(edge["get_buckets"]) == 2
        assert 0 < edge["get_p50_seconds"] <= edge["get_p99_seconds"]
        assert as_json["latency_bucket_bounds"][0] == 1e-05
        writer.kill()
        reader.stdin.close()
        reader.wait(timeout=30)


def test_sync_client_threads_time_every_call_once(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    import concurrent.futures

    import relayd_client._local
    from relayd_client import SyncRelayClient

    from tests._workers import make_payload

    # Writer and reader share this process: hide the local stage table, so
    # large puts take the arena as they would between processes.
    monkeypatch.setattr(relayd_client._local, "serves", lambda stage: False)
    with running_daemon(str(tmp_path), metrics=True) as d:
        with SyncRelayClient("sw", d.socket) as w, SyncRelayClient("sr", d.socket) as r:

            def one(k: int) -> None:
                for i in range(10):
                    size = SMALL if i % 2 else MiB
                    ref = w.put(make_payload(k, size), to_stage="sr", request_id=f"s{k}-{i}",
                                trace_id=f"t{k}-{i}")  # fmt: skip
                    r.get(ref)

            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                list(pool.map(one, range(4)))
        want = {("sw", "sr", "shm"): 20, ("sw", "sr", "inline"): 20}
        wait_until(lambda: drained(d), 10, "arena back to zero")
        text = d.scrape()
        assert _counts(text, "relayd_edge_transfers_total") == want
        assert _counts(text, "relayd_put_seconds_count") == want
        assert _counts(text, "relayd_get_seconds_count") == want


def test_a_keyed_get_counts_its_wait_for_the_key(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """get_key's latency runs from the call, so the wait for the put is in it.

    The clients read time through ``time.perf_counter_ns``; a clock the test
    moves by 3 s while the reader waits in the daemon makes that wait exact.
    """
    import time

    import relayd_client._local

    clock = [10**12]
    monkeypatch.setattr(time, "perf_counter_ns", lambda: clock[0])
    # Writer and reader share this process: the small puts travel inline.
    monkeypatch.setattr(relayd_client._local, "serves", lambda stage: False)

    async def scenario(sock: str) -> None:
        async with RelayClient("kw", sock) as w, RelayClient("kr", sock) as r:
            waiting = asyncio.ensure_future(r.get_key("k1", from_stage="kw", timeout=30))
            await asyncio.sleep(0)  # the call has started (and read the clock)
            clock[0] += 3 * 10**9
            await w.put({"x": 1}, to_stage="kr", request_id="rk", key="k1")
            assert await waiting == {"x": 1}
            # A key that is there already: no wait in it.
            await w.put({"x": 2}, to_stage="kr", request_id="rk2", key="k2")
            assert await r.poll_key("k2", from_stage="kw") == {"x": 2}

    with running_daemon(str(tmp_path), metrics=True) as d:
        asyncio.run(asyncio.wait_for(scenario(d.socket), 60))
        text = d.scrape()
        labels = {"from_stage": "kw", "to_stage": "kr", "transport": "inline"}
        assert _metric(text, "relayd_get_seconds_count", **labels) == 2
        assert _metric(text, "relayd_get_seconds_sum", **labels) == 3.0
        # 3 s lands in the <= 5 s bucket, not in the 2 s one.
        assert _metric(text, "relayd_get_seconds_bucket", le="2.0", **labels) == 1
        assert _metric(text, "relayd_get_seconds_bucket", le="5.0", **labels) == 2
