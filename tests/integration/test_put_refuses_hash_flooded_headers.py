"""A header its reader would refuse is refused at put, where the writer can still act.

The safe decoder refuses a dict in which more than ``MAX_SHARED_HASH`` keys
share one hash (they cost a reader quadratic time; see ``_codec_decode``).
Ints and floats hash the same in every process, so a payload can hold such a
dict by plain bad luck or by design; the writer's put succeeded and only its
reader failed, long after and far from the code that built the payload.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from relayd_client import InvalidArgumentError, RelayClient, SyncRelayClient, UnsafePayloadError
from relayd_client._codec import MAX_SHARED_HASH

from tests._daemon import drained, running_daemon, wait_until
from tests._fixtures import separate_processes

__all__ = ["separate_processes"]  # the autouse fixture: the tensor payloads go through the arena

pytestmark = pytest.mark.timeout(120)

_P = (1 << 61) - 1  # hash(i * _P) == 0 for every int i


def _ints(n: int) -> dict[object, object]:
    keys = [i * _P for i in range(1, n + 1)]
    assert len({hash(k) for k in keys}) == 1
    return {k: i for i, k in enumerate(keys)}


def _floats(n: int) -> dict[object, object]:
    # 2**61 is 1 modulo the hash modulus: every 2.0 ** (61 * k) hashes to 1, as
    # 1 does (k = 0, left out: 1.0 == 1).
    keys = [2.0 ** (61 * k) for k in range(-10, 11) if k][:n]
    assert len(keys) == n
    assert len({hash(k) for k in keys}) == 1
    return {k: str(k) for k in keys}


@pytest.mark.parametrize("keys", [_ints, _floats])
def test_a_payload_with_too_many_keys_of_one_hash_is_refused_at_put(
    tmp_path: object, keys: object
) -> None:
    flooded = keys(MAX_SHARED_HASH + 1)  # type: ignore[operator]

    async def scenario(sock: str) -> None:
        async with RelayClient("thinker", sock) as w:
            for payload in (
                {"x": torch.ones(4096), "meta": flooded},  # leased
                {"tokens": [1, 2], "meta": flooded},  # inline
                [{"deep": (flooded,)}],
            ):
                with pytest.raises(UnsafePayloadError, match="share one hash") as err:
                    await w.put(payload, to_stage="talker", request_id="r")
                assert isinstance(err.value, InvalidArgumentError)
                assert "at path payload" in str(err.value)
            with pytest.raises(UnsafePayloadError, match="share one hash"):
                async with w.buffer(to_stage="talker", request_id="r", like={"m": flooded}):
                    pass

    with running_daemon(str(tmp_path)) as d:
        asyncio.run(asyncio.wait_for(scenario(d.socket), 60))
        with (
            SyncRelayClient("thinker", d.socket) as s,
            pytest.raises(UnsafePayloadError, match="share one hash"),
        ):
            s.put({"x": torch.ones(4096), "meta": flooded}, to_stage="talker", request_id="r")
        # Refused before anything was reserved.
        wait_until(lambda: drained(d), 10, "arena back to zero")


@pytest.mark.parametrize("keys", [_ints, _floats])
def test_up_to_the_limit_of_one_hash_a_payload_reaches_its_reader(
    tmp_path: object, keys: object
) -> None:
    """The limit is the decoder's: what put accepts, get reads. With pickle
    (the opt-in the refusal names) the flooded dict travels too."""
    # 0 and 1 hash as the ints and the floats do, but no writer chose them
    # (an int below the hash modulus hashes to itself): neither side counts them.
    shared = {**keys(MAX_SHARED_HASH), 0: "zero", 1: "one", "note": "x"}  # type: ignore[operator]
    flooded = keys(MAX_SHARED_HASH + 1)  # type: ignore[operator]

    async def scenario(sock: str) -> None:
        async with (
            RelayClient("thinker", sock) as w,
            RelayClient("talker", sock, allow_pickle=True) as r,
        ):
            ref = await w.put({"x": torch.ones(4096), "meta": shared}, to_stage="talker",
                              request_id="r")  # fmt: skip
            got = await r.get(ref)
            assert got["meta"] == shared and torch.equal(got["x"], torch.ones(4096))
            ref = await w.put({"meta": flooded}, to_stage="talker", request_id="r", pickle=True)
            assert (await r.get(ref))["meta"] == flooded

    with running_daemon(str(tmp_path)) as d:
        asyncio.run(asyncio.wait_for(scenario(d.socket), 60))
        wait_until(lambda: drained(d), 10, "arena back to zero")
