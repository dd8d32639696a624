"""Keyed delivery and discard on one node: a real daemon, each stage its own process.

The writer puts under a key; the reader finds it by key without ever seeing
the DataRef (waiting in the daemon, or polling). Sizes cover both ways a
keyed payload is held: inline (the DataRef bytes live in the daemon's index)
and in an arena lease.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from relayd_client import DataRef, TensorRef

from tests._daemon import running_daemon, wait_until
from tests._keyed_worker import Stage
from tests._workers import digest

pytestmark = pytest.mark.timeout(120)

INLINE = 100
LEASED = 300_000
SIZES = pytest.mark.parametrize("size", [INLINE, LEASED], ids=["inline", "shm"])


def _used(d: object) -> int:
    return int(d.pool()["used_bytes"])  # type: ignore[attr-defined]


def _ok(answer: str) -> list[str]:
    assert answer.startswith("OK"), answer
    return answer.split()[1:]


@SIZES
def test_get_key_waits_for_the_put(tmp_path: pathlib.Path, size: int) -> None:
    with running_daemon(str(tmp_path)) as d:
        writer, reader = Stage(d.socket, "thinker"), Stage(d.socket, "talker")
        reader.send("get", "r1_talker_0", "thinker", 30)  # waits in the daemon
        _ref, sent, transport = _ok(writer.ask("put", "r1_talker_0", 7, size, "r1", "talker"))
        assert transport == ("inline" if size == INLINE else "shm")
        assert _ok(reader.answer()) == [sent]
        wait_until(lambda: _used(d) == 0, 10, "the read lease to be freed")


@SIZES
def test_poll_key_is_none_until_the_put_then_the_value(tmp_path: pathlib.Path, size: int) -> None:
    with running_daemon(str(tmp_path)) as d:
        writer, reader = Stage(d.socket, "thinker"), Stage(d.socket, "talker")
        assert reader.ask("poll", "k", "thinker") == "NONE"
        assert reader.ask("poll", "k", "thinker") == "NONE"
        _ref, sent, _t = _ok(writer.ask("put", "k", 3, size, "r1", "talker"))
        assert _ok(reader.ask("poll", "k", "thinker")) == [sent]


@SIZES
def test_a_key_is_read_once(tmp_path: pathlib.Path, size: int) -> None:
    with running_daemon(str(tmp_path)) as d:
        writer, reader = Stage(d.socket, "thinker"), Stage(d.socket, "talker")
        _ref, sent, _t = _ok(writer.ask("put", "k", 1, size, "r1", "talker"))
        assert _ok(reader.ask("get", "k", "thinker", 10)) == [sent]
        assert reader.ask("get", "k", "thinker", 10).startswith("ERR StaleRefError")
        assert reader.ask("poll", "k", "thinker").startswith("ERR StaleRefError")
        # Read, the key may be put again.
        _ref, again, _t = _ok(writer.ask("put", "k", 2, size, "r1", "talker"))
        assert _ok(reader.ask("poll", "k", "thinker")) == [again]


@SIZES
def test_a_second_put_of_an_unread_key_is_key_exists(tmp_path: pathlib.Path, size: int) -> None:
    with running_daemon(str(tmp_path)) as d:
        writer, reader = Stage(d.socket, "thinker"), Stage(d.socket, "talker")
        _ref, first, _t = _ok(writer.ask("put", "k", 1, size, "r1", "talker"))
        used = _used(d)
        assert writer.ask("put", "k", 2, size, "r1", "talker").startswith("ERR KeyExistsError")
        # The refused put left nothing behind: only the first one's lease is held.
        wait_until(lambda: _used(d) == used, 10, "the refused put's lease to be freed")
        assert _ok(reader.ask("get", "k", "thinker", 10)) == [first]
        wait_until(lambda: _used(d) == 0, 10, "the arena back to zero")


def test_keys_are_per_writer_stage_and_per_consumer(tmp_path: pathlib.Path) -> None:
    with running_daemon(str(tmp_path)) as d:
        a, b = Stage(d.socket, "thinker"), Stage(d.socket, "encoder")
        reader = Stage(d.socket, "talker")
        _r, from_a, _t = _ok(a.ask("put", "k", 1, LEASED, "r1", "talker"))
        _r, from_b, _t = _ok(b.ask("put", "k", 2, LEASED, "r1", "talker"))
        _r, for_other, _t = _ok(a.ask("put", "k", 3, INLINE, "r1", "vocoder"))
        assert _ok(reader.ask("get", "k", "encoder", 10)) == [from_b]
        assert _ok(reader.ask("get", "k", "thinker", 10)) == [from_a]
        assert _ok(Stage(d.socket, "vocoder").ask("get", "k", "thinker", 10)) == [for_other]


@SIZES
def test_abort_frees_keyed_entries(tmp_path: pathlib.Path, size: int) -> None:
    with running_daemon(str(tmp_path)) as d:
        writer, reader = Stage(d.socket, "thinker"), Stage(d.socket, "talker")
        _ok(writer.ask("put", "kept", 9, size, "other", "talker"))
        kept = _used(d)
        for i in range(3):
            _ok(writer.ask("put", f"k{i}", i, size, "doomed", "talker"))
        assert int(_ok(writer.ask("abort", "doomed"))[0]) == (0 if size == INLINE else 3)
        wait_until(lambda: _used(d) == kept, 10, "only the kept lease left")
        for i in range(3):
            assert reader.ask("poll", f"k{i}", "thinker").startswith("ERR AbortedError")
        _ok(reader.ask("get", "kept", "thinker", 10))
        wait_until(lambda: _used(d) == 0, 10, "the arena back to zero")


@SIZES
def test_ttl_frees_keyed_entries(tmp_path: pathlib.Path, size: int) -> None:
    with running_daemon(str(tmp_path), "--lease-ttl", "1") as d:
        writer, reader = Stage(d.socket, "thinker"), Stage(d.socket, "talker")
        _ok(writer.ask("put", "k", 1, size, "r1", "talker"))
        wait_until(lambda: d.status().get("reclaimed_by_reason") or size == INLINE, 15, "the TTL")
        wait_until(
            lambda: reader.ask("poll", "k", "thinker").startswith("ERR StaleRefError"),
            15,
            "the keyed entry to expire",
            interval=0.2,
        )
        assert _used(d) == 0


def test_unread_keys_are_bounded_per_stage(tmp_path: pathlib.Path) -> None:
    with running_daemon(str(tmp_path), "--max-stage-keys", "2") as d:
        writer, reader = Stage(d.socket, "thinker"), Stage(d.socket, "talker")
        _ok(writer.ask("put", "k1", 1, LEASED, "r1", "talker"))
        one_lease = _used(d)
        _ok(writer.ask("put", "k2", 2, INLINE, "r1", "talker"))
        full = writer.ask("put", "k3", 3, LEASED, "r1", "talker")
        assert full.startswith("ERR ResourceExhaustedError"), full
        _ok(writer.ask("put", "k3", 3, INLINE, "r1", "vocoder"))  # another stage's own bound
        _ok(reader.ask("get", "k1", "thinker", 10))
        _ok(writer.ask("put", "k3", 3, LEASED, "r1", "talker"))
        wait_until(lambda: _used(d) == one_lease, 10, "only k3's lease in the arena")


def test_a_stage_reads_only_keys_addressed_to_it(tmp_path: pathlib.Path) -> None:
    with running_daemon(str(tmp_path)) as d:
        writer, reader = Stage(d.socket, "thinker"), Stage(d.socket, "talker")
        intruder = Stage(d.socket, "vocoder")
        _r, sent, _t = _ok(writer.ask("put", "k", 1, LEASED, "r1", "talker"))
        refused = intruder.ask("take", "k", "thinker", 0, "talker")
        assert refused.startswith("ERR PermissionDeniedError"), refused
        assert intruder.ask("take", "k", "thinker", 0) == "NONE"  # its own (empty) namespace
        assert _ok(reader.ask("get", "k", "thinker", 10)) == [sent]


def test_bad_keys_are_refused(tmp_path: pathlib.Path) -> None:
    with running_daemon(str(tmp_path)) as d:
        writer = Stage(d.socket, "thinker")
        for bad in ("x" * 257, "caf\u00e9"):
            assert writer.ask("put", bad, 1, INLINE, "r1", "talker").startswith(
                "ERR InvalidArgumentError"
            )


# -- discard -------------------------------------------------------------------------------


def test_discard_frees_a_lease_for_its_writers_or_readers_stage_once(
    tmp_path: pathlib.Path,
) -> None:
    with running_daemon(str(tmp_path)) as d:
        writer, reader = Stage(d.socket, "thinker"), Stage(d.socket, "talker")
        holder = Stage(d.socket, "vocoder")  # holds the ref, neither writes nor reads it
        for who in (writer, reader):
            ref, _digest, transport = _ok(writer.ask("put", "-", 1, LEASED, "r1", "talker"))
            assert transport == "shm"
            assert holder.ask("discard", ref).startswith("ERR PermissionDeniedError")
            assert who.ask("discard", ref) == "OK"
            wait_until(lambda: _used(d) == 0, 10, "the discarded lease to be freed")
            for anyone in (writer, reader, holder):
                assert anyone.ask("discard", ref).startswith("ERR StaleRefError")
            assert reader.ask("read", ref).startswith("ERR StaleRefError")


def test_discard_after_a_read_is_stale(tmp_path: pathlib.Path) -> None:
    with running_daemon(str(tmp_path)) as d:
        writer, reader = Stage(d.socket, "thinker"), Stage(d.socket, "talker")
        ref, sent, _t = _ok(writer.ask("put", "-", 1, LEASED, "r1", "talker"))
        assert _ok(reader.ask("read", ref)) == [sent]
        assert reader.ask("discard", ref).startswith("ERR StaleRefError")
        wait_until(lambda: _used(d) == 0, 10, "the read lease to be freed")
        assert writer.ask("discard", ref).startswith("ERR StaleRefError")


def test_discard_of_an_inline_ref_only_marks_it(tmp_path: pathlib.Path) -> None:
    with running_daemon(str(tmp_path)) as d:
        writer = Stage(d.socket, "thinker")
        ref, _d, transport = _ok(writer.ask("put", "-", 1, INLINE, "r1", "talker"))
        assert transport == "inline"
        reader, other = Stage(d.socket, "talker"), Stage(d.socket, "talker")
        assert reader.ask("discard", ref) == "OK"
        assert reader.ask("discard", ref).startswith("ERR StaleRefError")
        assert reader.ask("read", ref).startswith("ERR StaleRefError")
        # Nothing left the process: another holder of the bytes reads them, once.
        _ok(other.ask("read", ref))
        assert other.ask("discard", ref).startswith("ERR StaleRefError")


def _forwarded(payload: str) -> str:
    """The hex DataRef of the one TensorRef a ``ref`` command's payload forwards."""
    (inner,) = DataRef.from_bytes(bytes.fromhex(payload)).proto.refs
    return TensorRef(inner).data_ref().to_bytes().hex()


def test_discard_of_a_forwarded_tensor_ref(tmp_path: pathlib.Path) -> None:
    with running_daemon(str(tmp_path)) as d:
        a, b = Stage(d.socket, "thinker"), Stage(d.socket, "talker")
        c = Stage(d.socket, "vocoder")
        for who in (a, c):  # its writer, then its consumer
            (payload,) = _ok(a.ask("ref", 5, LEASED, "vocoder", "r1", "talker"))
            # b gets the payload (the TensorRef stays unread): forwarding it, b holds
            # the TensorRef but neither writes nor reads it, so may not free it.
            assert b.ask("discard-refs", payload).startswith("ERR PermissionDeniedError")
            assert who.ask("discard", _forwarded(payload)) == "OK"
            wait_until(lambda: _used(d) == 0, 10, "the forwarded tensor's lease to be freed")


def test_a_discarded_payload_leaves_the_forwarded_refs_its_holder_may_not_free(
    tmp_path: pathlib.Path,
) -> None:
    with running_daemon(str(tmp_path)) as d:
        a, b = Stage(d.socket, "thinker"), Stage(d.socket, "talker")
        (payload,) = _ok(a.ask("ref", 5, LEASED, "vocoder", "r1", "talker"))
        # b frees its payload unread; the TensorRef inside is vocoder's and stays.
        assert b.ask("discard", payload) == "OK"
        g = torch.Generator().manual_seed(5)
        sent = torch.randint(0, 256, (LEASED,), dtype=torch.uint8, generator=g)
        assert _ok(Stage(d.socket, "vocoder").ask("read", _forwarded(payload))) == [digest(sent)]
        wait_until(lambda: _used(d) == 0, 10, "the arena back to zero")


def test_discard_of_a_keyed_ref_ends_the_key(tmp_path: pathlib.Path) -> None:
    with running_daemon(str(tmp_path)) as d:
        writer, reader = Stage(d.socket, "thinker"), Stage(d.socket, "talker")
        _ok(writer.ask("put", "k", 1, LEASED, "r1", "talker"))
        (ref,) = _ok(reader.ask("take", "k", "thinker", 10))
        assert reader.ask("discard", ref) == "OK"
        wait_until(lambda: _used(d) == 0, 10, "the arena back to zero")
        assert reader.ask("poll", "k", "thinker").startswith("ERR StaleRefError")


# -- the blocking client -------------------------------------------------------------------


@SIZES
def test_blocking_client_keyed_delivery_and_discard(tmp_path: pathlib.Path, size: int) -> None:
    with running_daemon(str(tmp_path)) as d:
        writer = Stage(d.socket, "thinker", blocking=True)
        reader = Stage(d.socket, "talker", blocking=True)
        assert reader.ask("poll", "k", "thinker") == "NONE"
        reader.send("get", "k", "thinker", 30)  # waits in the daemon
        _ref, sent, _t = _ok(writer.ask("put", "k", 1, size, "r1", "talker"))
        assert _ok(reader.answer()) == [sent]
        assert reader.ask("get", "k", "thinker", 10).startswith("ERR StaleRefError")
        _ref, second, _t = _ok(writer.ask("put", "k2", 2, size, "r1", "talker"))
        assert writer.ask("put", "k2", 3, size, "r1", "talker").startswith("ERR KeyExistsError")
        assert _ok(reader.ask("poll", "k2", "thinker")) == [second]
        ref, _d, _t = _ok(writer.ask("put", "-", 4, size, "r1", "talker"))
        assert reader.ask("discard", ref) == "OK"
        assert reader.ask("discard", ref).startswith("ERR StaleRefError")
        _ok(writer.ask("put", "k3", 5, size, "r2", "talker"))
        _ok(writer.ask("abort", "r2"))
        assert reader.ask("poll", "k3", "thinker").startswith("ERR AbortedError")
        wait_until(lambda: _used(d) == 0, 10, "the arena back to zero")
