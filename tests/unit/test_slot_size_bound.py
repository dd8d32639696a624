"""A daemon's slot size and its readers' check of a lease agree: the daemon
refuses a slot larger than a reader accepts a lease per slot."""

from __future__ import annotations

import pytest
from relayd_client.wire.dataref import _check_lease
from relayd_client.wire.errors import CorruptRefError
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.shm import MAX_SLOT_SIZE

from relayd.config import ConfigError, Settings


def _settings(slot: int) -> Settings:
    return Settings(
        slot_size=slot, shm_segment_size=2 * slot, shm_pool_size=2 * slot, grant_size=slot
    )


def test_the_largest_slot_a_reader_accepts_is_the_largest_a_daemon_takes() -> None:
    assert _settings(MAX_SLOT_SIZE).slot_size == MAX_SLOT_SIZE
    # A lease filling one such slot reads as a lease, one byte more as corrupt.
    _check_lease(pb.LeaseRef(nslots=1, generation=1, length=MAX_SLOT_SIZE))
    with pytest.raises(CorruptRefError):
        _check_lease(pb.LeaseRef(nslots=1, generation=1, length=MAX_SLOT_SIZE + 1))
    # So a daemon whose leases would all read as corrupt does not start.
    with pytest.raises(ConfigError, match="slot_size must be a power of two from 4096"):
        _settings(2 * MAX_SLOT_SIZE)
