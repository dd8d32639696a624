"""Transport names: one enum, one parser, every spelling, and nothing guessed."""

from __future__ import annotations

import pytest
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.transport import Transport


@pytest.mark.parametrize("t", list(Transport), ids=lambda t: t.value)
def test_every_spelling_names_one_member(t: Transport) -> None:
    number = pb.Transport.Value(f"TRANSPORT_{t.name}")
    assert t.to_proto() == number
    assert Transport.from_proto(number) is t
    for spelling in (t.value, f"TRANSPORT_{t.name}", number):
        assert Transport.parse(spelling) is t


def test_the_enum_covers_the_proto() -> None:
    known = {n for n in pb.Transport.values() if n != pb.TRANSPORT_UNSPECIFIED}
    assert {t.to_proto() for t in Transport} == known


@pytest.mark.parametrize(
    "spelling",
    ["", "SHM", "Shm", "shmem", "unspecified", "TRANSPORT_UNSPECIFIED", "TRANSPORT_", 0, 99, -1],
)
def test_an_unknown_spelling_raises_instead_of_becoming_shm(spelling: str | int) -> None:
    with pytest.raises(ValueError):
        Transport.parse(spelling)


def test_a_bool_is_not_a_transport_number() -> None:
    with pytest.raises(ValueError):
        Transport.parse(True)
