"""Keyed delivery and discard across two real daemons with real Mooncake.

The writer stage attaches to node A, its consumer to node B. A keyed put on A
is handed to B's daemon (which holds the index, since B serves the consumer);
B's reader finds it by key and pulls the bytes like any cross-node DataRef.
A discard on B by the reader's stage frees the writer's lease on A; another
stage's is refused there. A keyed put its writer cancels while it waits is
withdrawn: not indexed on B, its lease freed on A (a copy pushed to B stays
there until an abort or its TTL, as for any failed keyed put).
"""

from __future__ import annotations

import pytest

from tests._daemon import wait_until
from tests._keyed_worker import Stage
from tests._mooncake import requires_mooncake
from tests.multinode import test_two_daemons as two
from tests.multinode.test_two_daemons import Node

pair = two.pair  # the same two daemons, real Mooncake between them

pytestmark = [
    pytest.mark.multinode,
    pytest.mark.timeout(120),
    requires_mooncake,
]

INLINE = 100
LEASED = 300_000


def _ok(answer: str) -> list[str]:
    assert answer.startswith("OK"), answer
    return answer.split()[1:]


def _published(n: Node) -> int:
    return int(n.daemon.pool()["used_bytes"])


def _stages(a: Node, b: Node, *stages: str) -> tuple[Stage, Stage]:
    """The writer on A, the reader on B, once A knows B serves the reader's stage."""
    writer, reader = Stage(a.daemon.socket, stages[0]), Stage(b.daemon.socket, stages[1])
    wait_until(
        lambda: stages[1] in a.peer(b.address).get("stages", []),
        10,
        f"node A to learn that node B serves {stages[1]!r}",
    )
    return writer, reader


def test_a_key_put_on_a_is_found_by_its_reader_on_b(pair: tuple[Node, Node]) -> None:
    a, b = pair
    writer, reader = _stages(a, b, "thinker", "talker")
    reader.send("get", "r1_talker_0", "thinker", 30)  # waits in B's daemon
    _r, leased, transport = _ok(writer.ask("put", "r1_talker_0", 1, LEASED, "r1", "talker"))
    assert transport == "shm"
    assert _ok(reader.answer()) == [leased]
    _r, inline, transport = _ok(writer.ask("put", "r1_talker_1", 2, INLINE, "r1", "talker"))
    assert transport == "inline"
    assert _ok(reader.ask("poll", "r1_talker_1", "thinker")) == [inline]
    assert reader.ask("poll", "r1_talker_0", "thinker").startswith("ERR StaleRefError")
    wait_until(lambda: _published(a) == 0 and _published(b) == 0, 10, "both arenas at zero")


def test_cross_node_key_exists_and_abort(pair: tuple[Node, Node]) -> None:
    a, b = pair
    writer, reader = _stages(a, b, "thinker", "talker")
    _ok(writer.ask("put", "k", 1, LEASED, "r1", "talker"))
    # Pushed with its bytes attached, that put's lease on A stays until B's receipt.
    wait_until(lambda: int(a.peer(b.address).get("pushes_unreceived", 0)) == 0, 10, "B's receipt")
    held = _published(a)
    # B's index answers for the key: still unread there.
    assert writer.ask("put", "k", 2, LEASED, "r1", "talker").startswith("ERR KeyExistsError")
    wait_until(lambda: _published(a) == held, 10, "the refused put's lease to go")
    _ok(writer.ask("abort", "r1"))
    assert reader.ask("poll", "k", "thinker").startswith("ERR AbortedError")
    wait_until(lambda: _published(a) == 0 and _published(b) == 0, 10, "both arenas at zero")


def test_discard_on_b_frees_the_lease_on_a(pair: tuple[Node, Node]) -> None:
    a, b = pair
    writer, reader = _stages(a, b, "thinker", "talker")
    holder = Stage(b.daemon.socket, "vocoder")  # holds the ref, neither writes nor reads it
    ref, _digest, transport = _ok(writer.ask("put", "-", 1, LEASED, "r1", "talker"))
    assert transport == "shm"
    # The lease is on A, or already pushed to B (A freed its own on landing).
    wait_until(lambda: _published(a) + _published(b) > 0, 10, "the writer's publish to reach A")
    assert holder.ask("discard", ref).startswith("ERR PermissionDeniedError")
    assert reader.ask("discard", ref) == "OK"  # so the holder's left it
    wait_until(lambda: _published(a) == 0, 10, "the writer's lease on A to be freed")
    wait_until(lambda: _published(b) == 0, 10, "a copy pushed to B to be freed")
    assert reader.ask("discard", ref).startswith("ERR StaleRefError")
    assert reader.ask("read", ref).startswith("ERR StaleRefError")
    assert _published(b) == 0


def test_a_keyed_put_cancelled_by_its_writer_is_not_delivered(pair: tuple[Node, Node]) -> None:
    a, b = pair
    writer, reader = _stages(a, b, "thinker", "talker")
    assert writer.ask("put-cancelled", "k", 1, LEASED, "r1", "talker") == "OK"
    # Not there, and no tombstone: the reader waits for the writer's retry.
    assert reader.ask("poll", "k", "thinker") == "NONE"
    wait_until(lambda: _published(a) == 0, 10, "the cancelled put's lease on A to be freed")
    _r, retried, _transport = _ok(writer.ask("put", "k", 2, LEASED, "r1", "talker"))
    assert _ok(reader.ask("get", "k", "thinker", 10)) == [retried]
    _ok(writer.ask("abort", "r1"))  # and with it a copy of the first put pushed to B
    wait_until(lambda: _published(a) == 0 and _published(b) == 0, 10, "both arenas at zero")
