"""``relayd bench --breakdown``'s lease-table timing runs at every size the bench takes.

It builds an arena just big enough for one grant of 16 leases; sized by slots
alone it left no room for the slot headers, and at 16 MiB the grant was one
run too long for it (the breakdown ended in ``ResourceExhaustedError``).
"""

from __future__ import annotations

import pytest

from relayd_bench import _lease_steps


@pytest.mark.parametrize("size", [256 << 10, 16 << 20])
def test_the_lease_table_alone_is_timed_at_every_size(size: int) -> None:
    steps = _lease_steps.run(size)
    assert [key for _, key in _lease_steps.STEPS] == list(steps)
    assert all(v > 0 for v in steps.values()), steps
