"""What a stage developer sees for a wrong call: exact error classes, messages that say
what to change, and names checked where they are accepted, not a TTL later."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from relayd_client import (
    CorruptRefError,
    InvalidArgumentError,
    RelayClient,
    ResourceExhaustedError,
)

from relayd import _logging
from relayd.status_tables import render_leases
from tests._daemon import drained, running_daemon, wait_until

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
BAD_IDS = ["r\nFAKE 1 PUBLISHED", "r\x1b[2J\x1b[31mred", "tab\there", "del\x7f", ""]
CALL_TIMEOUT = 30


def _run(coro: object) -> object:
    return asyncio.run(asyncio.wait_for(coro, CALL_TIMEOUT))  # type: ignore[arg-type]


def test_put_larger_than_the_arena_names_shm_pool_size(tmp_path: Path) -> None:
    with running_daemon(str(tmp_path), pool="64MiB") as d:

        async def main() -> None:
            async with RelayClient("w", d.socket) as c:
                with pytest.raises(ResourceExhaustedError) as err:
                    await c.put(torch.zeros(80 * MiB, dtype=torch.uint8), to_stage="r",
                                request_id="big")  # fmt: skip
                assert type(err.value) is ResourceExhaustedError
                assert "raise --shm-pool-size" in str(err.value), err.value

        _run(main())


def test_put_over_the_stage_quota_names_max_stage_bytes(tmp_path: Path) -> None:
    with running_daemon(str(tmp_path), "--max-stage-bytes", "8MiB", pool="64MiB") as d:

        async def main() -> None:
            async with RelayClient("w", d.socket) as c:
                with pytest.raises(ResourceExhaustedError) as err:
                    await c.put(torch.zeros(16 * MiB, dtype=torch.uint8), to_stage="r",
                                request_id="big")  # fmt: skip
                assert type(err.value) is ResourceExhaustedError
                assert "per-stage quota of 8388608 bytes" in str(err.value), err.value
                assert "raise --max-stage-bytes" in str(err.value), err.value

        _run(main())


def test_get_of_a_string_is_a_corrupt_ref_error(tmp_path: Path) -> None:
    with running_daemon(str(tmp_path)) as d:

        async def main() -> None:
            async with RelayClient("r", d.socket) as c:
                for wrong in ("a string", 17, None):
                    with pytest.raises(CorruptRefError) as err:
                        await c.get(wrong)  # type: ignore[arg-type]
                    assert type(err.value) is CorruptRefError
                    assert str(err.value).startswith("not a relayd DataRef: "), err.value

        _run(main())


def test_stage_and_request_names_are_checked_at_put(tmp_path: Path) -> None:
    with running_daemon(str(tmp_path)) as d:

        async def main() -> None:
            async with RelayClient("w", d.socket) as c:
                payload = torch.zeros(MiB, dtype=torch.uint8)  # an shm put, not inline
                for stage in ("a b", "", "x" * 129, "talker\n"):
                    with pytest.raises(InvalidArgumentError) as err:
                        await c.put(payload, to_stage=stage, request_id="r1")
                    assert type(err.value) is InvalidArgumentError
                    assert "must be 1-128 characters of letters, digits and _.:/@-" in str(
                        err.value
                    )
                for rid in BAD_IDS:
                    with pytest.raises(InvalidArgumentError) as err:
                        await c.put(payload, to_stage="talker", request_id=rid)
                    assert type(err.value) is InvalidArgumentError
                    with pytest.raises(InvalidArgumentError):
                        c.put_done("talker", rid)
                    with pytest.raises(InvalidArgumentError):
                        await c.abort(rid)
                # Nothing was reserved for any of them.
                assert d.status()["leases"] == []
            with pytest.raises(InvalidArgumentError) as err:
                RelayClient("a b", d.socket)
            assert "stage 'a b' must be 1-128 characters" in str(err.value)

        _run(main())


def test_hostile_request_ids_are_escaped_in_tables_and_logs(tmp_path: Path) -> None:
    """An old or hostile client skips the client's check; the operator still sees one line
    per lease and no escape sequence."""
    with running_daemon(str(tmp_path)) as d:
        rid = "r\x1b[2J\nFAKE"
        code = (
            "import asyncio, torch, relayd_client, relayd_client._writer as w\n"
            "w.check_names = lambda *a: None\n"  # what a client without the check does
            "async def main():\n"
            f"    async with relayd_client.RelayClient('w', {d.socket!r}) as cl:\n"
            f"        await cl.put(torch.zeros(1 << 20, dtype=torch.uint8), to_stage='t', "
            f"request_id={rid!r})\n"
            "asyncio.run(main())\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=CALL_TIMEOUT)
        wait_until(lambda: d.status()["leases"], 10, "the lease")
        table = render_leases(d.status(), None, None)
        assert "\x1b" not in table
        (row,) = [line for line in table.splitlines() if "FAKE" in line]
        assert "r\\x1b[2J\\nFAKE" in row

    record = logging.LogRecord("relayd.x", logging.INFO, "", 0, "lease of %s", (rid,), None)
    record.request_id = rid
    for fmt in ("text", "logfmt"):
        line = _logging.make_formatter(fmt).format(record)
        assert "\n" not in line and "\x1b" not in line, (fmt, line)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), "5", True])
def test_a_timeout_that_is_no_finite_number_is_refused_where_it_is_given(
    tmp_path: Path, bad: object
) -> None:
    """NaN and infinity reached timers and futures: an infinite put timeout
    raised OverflowError from the blocking client, a NaN one a timeout "within
    nan s". Both clients refuse them, and the client's own timeout, up front."""
    from relayd_client import SyncRelayClient

    for make in (RelayClient, SyncRelayClient):
        with pytest.raises(InvalidArgumentError, match="timeout must be"):
            make("w", str(tmp_path / "none.sock"), timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="timeout must be a positive"):
        RelayClient("w", str(tmp_path / "none.sock"), timeout=0)
    with running_daemon(str(tmp_path)) as d:

        async def main() -> None:
            async with RelayClient("w", d.socket) as c:
                with pytest.raises(InvalidArgumentError, match="timeout must be"):
                    await c.put(torch.ones(MiB), to_stage="r", request_id="t", timeout=bad)  # type: ignore[arg-type]
                with pytest.raises(InvalidArgumentError, match="timeout must be"):
                    await c.take_key("k", from_stage="w", to_stage="w", timeout=bad)  # type: ignore[arg-type]
                with pytest.raises(InvalidArgumentError, match="timeout must be"):
                    async for _ in c.stream("s", from_stage="w", timeout=bad):  # type: ignore[arg-type]
                        pass

        _run(main())
        with SyncRelayClient("w", d.socket) as s:
            with pytest.raises(InvalidArgumentError, match="timeout must be"):
                s.put(torch.ones(MiB), to_stage="r", request_id="t", timeout=bad)  # type: ignore[arg-type]
            with pytest.raises(InvalidArgumentError, match="timeout must be"):
                s.take_key("k", from_stage="w", to_stage="w", timeout=bad)  # type: ignore[arg-type]
            with pytest.raises(InvalidArgumentError, match="timeout must be"):
                next(s.stream("s", from_stage="w", timeout=bad))  # type: ignore[arg-type]
        # Nothing was reserved by the refused calls.
        wait_until(lambda: drained(d), 10, "arena back to zero")


def test_a_call_before_open_says_how_to_open_either_client(tmp_path: Path) -> None:
    from relayd_client import SessionClosedError, SyncRelayClient

    with pytest.raises(SessionClosedError, match=r"with SyncRelayClient\(\.\.\.\)`"):
        SyncRelayClient("w", str(tmp_path / "none.sock")).put(
            torch.ones(4), to_stage="r", request_id="x"
        )
    with pytest.raises(SessionClosedError, match=r"async with RelayClient\(\.\.\.\)`"):
        _run(RelayClient("w", str(tmp_path / "none.sock")).abort("x"))


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3", 1 << 63, 1 << 64])
def test_a_chunk_number_that_is_no_int64_count_is_refused_at_the_call(
    tmp_path: Path, bad: object
) -> None:
    """A float, a bool or a number past int64 reached the DataRef's fields and
    came back as TypeError or ValueError (or, in the compact form, at
    to_bytes() far from the put)."""
    from relayd_client import SyncRelayClient

    with running_daemon(str(tmp_path)) as d:
        with SyncRelayClient("w", d.socket) as w:
            with pytest.raises(InvalidArgumentError, match="chunk_id must be"):
                w.put(torch.ones(MiB), to_stage="r", request_id="c", chunk_id=bad)  # type: ignore[arg-type]
            with pytest.raises(InvalidArgumentError, match="chunks must be"):
                w.put_done("r", "c", chunks=bad)  # type: ignore[arg-type]
            ref = w.put(torch.ones(MiB), to_stage="r", request_id="c", chunk_id=(1 << 63) - 1)
            assert ref.chunk_id == (1 << 63) - 1
            assert w.abort("c") == 1
        wait_until(lambda: drained(d), 10, "arena back to zero")
