"""A holder's share is forgotten at zero, so holders that come and go leave nothing."""

from __future__ import annotations

from relayd.shares import Shares


def test_holders_that_came_and_went_leave_no_entries() -> None:
    shares: Shares[int] = Shares()
    for uid in range(1000):
        shares.add(uid, 2)
        shares.take(uid)
        assert shares[uid] == 1
        shares.take(uid)
    assert len(shares) == 0 and 7 not in shares and shares[7] == 0


def test_taking_more_than_held_leaves_none_not_a_debt() -> None:
    shares: Shares[str] = Shares()
    shares.add("talker")
    shares.take("talker", 3)
    shares.add("talker")
    assert shares["talker"] == 1 and len(shares) == 1
