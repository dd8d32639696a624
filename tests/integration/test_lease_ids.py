"""Lease ids over a long life: a grant numbers 2**32 - 1 leases, a daemon 2**32 - 1 grants.

A lease id is ``grant id << 32 | n`` (:data:`relayd_client.wire.shm.LEASE_SEQ_BITS`).
A writer that has put that many leases through one grant must not number the
next one into the grant bits (the daemon refuses such an id and ends the
session), and a daemon that has handed out that many grants must not number
one beyond 64 bits. Counting that far takes days; the tests start near the end.
"""

from __future__ import annotations

import pytest
from relayd_client import DataRef, SyncRelayClient
from relayd_client.wire.shm import LEASE_SEQ_BITS, MAX_LEASE_SEQ

from tests._daemon import drained, metric, running_daemon, wait_until
from tests._fixtures import separate_processes
from tests._workers import digest, make_payload

__all__ = ["separate_processes"]  # the autouse fixture: clients here use the arena

pytestmark = pytest.mark.timeout(120)

KiB = 1 << 10


def _relayed(w: SyncRelayClient, r: SyncRelayClient, seed: int, request_id: str) -> DataRef:
    payload = make_payload(seed, 256 * KiB)
    ref = w.put(payload, to_stage="talker", request_id=request_id, timeout=30)
    assert digest(r.get(ref)) == digest(payload)
    return ref


def test_a_grant_that_numbered_its_last_lease_is_given_back_not_overrun(tmp_path: object) -> None:
    with running_daemon(str(tmp_path), pool="64MiB", metrics=True) as d:
        with (
            SyncRelayClient("thinker", d.socket) as w,
            SyncRelayClient("talker", d.socket) as r,
        ):
            _relayed(w, r, 0, "first")
            conn, grants = w._client._conn, w._client._grants
            session = conn.session
            with grants.table.lock:
                spent = list(grants.table.grants.values())
                for g in spent:
                    g.next_seq = MAX_LEASE_SEQ - 2  # three ids left in each
            ids = [_relayed(w, r, i, f"r{i}").proto.lease.lease_id for i in range(1, 13)]
            assert all(lease_id & MAX_LEASE_SEQ for lease_id in ids)  # never seq 0
            spent_ids = {g.id for g in spent}
            assert {lease_id >> LEASE_SEQ_BITS for lease_id in ids} - spent_ids  # a new grant

            def given_back() -> bool:
                grants.collect()  # what the daemon's ring says is free
                return not spent_ids & set(grants.table.grants)

            wait_until(given_back, 10, "the spent grants given back once idle")
            # Every Reserve accepted: the daemon judged them all (the arena is
            # empty) and refused no session for an id outside its grant.
            wait_until(lambda: d.pool().get("used_bytes", 0) == 0, 10, "every lease freed")
            assert metric(d.scrape(), "relayd_connections_refused_total", reason="violation") == 0
            assert conn.session is session and not session.closed
        wait_until(lambda: drained(d), 10, "arena back to zero")
