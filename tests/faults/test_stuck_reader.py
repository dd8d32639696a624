"""A reader that never reads: its writer's stage fills its quota, others keep flowing, TTL reclaims."""

from __future__ import annotations

import asyncio
import time

import pytest
from relayd_client import RelayClient, ResourceExhaustedError

from tests._daemon import metric as _metric
from tests._daemon import wait_until
from tests._figures import record
from tests._workers import digest, make_payload
from tests.faults._support import apoll, leases, quiet, start_daemon, unique_node

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
TTL = 4.0


def test_stuck_reader_fills_only_its_stage_and_ttl_reclaims(tmp_path: object) -> None:
    d = start_daemon(
        str(tmp_path),
        unique_node(),
        "--lease-ttl",
        str(TTL),
        "--grant-size",
        "1MiB",
        pool="32MiB",  # per-stage quota: half, 16 MiB
        metrics=True,
    )
    figures: dict[str, object] = {}

    async def scenario() -> None:
        async with (
            RelayClient("thinker", d.socket) as w1,
            RelayClient("thinker", d.socket) as w2,  # a second session of the same stage
            RelayClient("encoder", d.socket) as ew,
            RelayClient("vocoder", d.socket) as er,
        ):
            # The talker never reads: thinker's leases stay PUBLISHED.
            stuck = 0
            t0 = time.monotonic()
            with pytest.raises(ResourceExhaustedError):
                for i in range(64):
                    w = (w1, w2)[i % 2]
                    await w.put(
                        make_payload(i, MiB), to_stage="talker", request_id=f"s{i}", timeout=0.5
                    )
                    stuck += 1
            figures["stuck_leases"] = stuck
            figures["writer_error_after_s"] = round(time.monotonic() - t0, 2)
            # Two sessions of one stage share one quota: together they hold <= 16 MiB.
            assert 8 <= stuck <= 16, stuck
            # The full stage's next put waits its whole deadline, then fails clearly.
            t = time.monotonic()
            with pytest.raises(ResourceExhaustedError):
                await w2.put(make_payload(99, MiB), to_stage="talker", request_id="x", timeout=0.7)
            assert time.monotonic() - t >= 0.6
            # Meanwhile another stage's transfers keep flowing, even while a thinker waits.
            waiting = asyncio.ensure_future(
                w1.put(make_payload(98, MiB), to_stage="talker", request_id="y", timeout=0.8)
            )
            flowed = 0
            for i in range(20):
                payload = make_payload(500 + i, 2 * MiB)
                ref = await ew.put(payload, to_stage="vocoder", request_id=f"e{i}", timeout=2)
                assert digest(await er.get(ref)) == digest(payload)
                flowed += 1
            figures["other_stage_transfers"] = flowed
            # It fails at its deadline, unless the TTL freed the stage first.
            try:
                await waiting
                figures["waiting_put"] = "served after TTL"
            except ResourceExhaustedError:
                figures["waiting_put"] = "ResourceExhaustedError"
            # The TTL reclaims the stuck leases, and the thinker can write again.
            await apoll(lambda: not leases(d), TTL + 10, "TTL to reclaim the stuck leases")
            payload = make_payload(7, MiB)
            ref = await w1.put(payload, to_stage="encoder", request_id="after", timeout=5)
            assert digest(await ew.get(ref)) == digest(payload)

    try:
        asyncio.run(asyncio.wait_for(scenario(), 90))
        wait_until(lambda: quiet(d), 10, "arena back to zero")
        ttl = _metric(d.scrape(), "relayd_leases_reclaimed_total", reason="ttl")
        figures["reclaimed_ttl"] = ttl
        record("stuck-reader", str(figures))
        assert isinstance(figures["stuck_leases"], int)
        assert ttl >= figures["stuck_leases"]
    finally:
        d.stop()
