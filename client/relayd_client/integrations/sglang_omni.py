"""relayd as an sglang-omni ``Relay``: ``RelaydRelay`` and its ``RelaydOperation``.

::

    from relayd_client.integrations.sglang_omni import RelaydRelay

    stage = Stage(name="talker", ..., relay=RelaydRelay(stage="talker"))

Every edge of that stage (payloads, stream chunks, their metadata tensors)
then moves through the node's relayd instead of a segment per transfer; the
relay is also registered with sglang-omni's factory under ``"relayd"``
(``create_relay("relayd", stage="talker")``).

Importing this module imports nothing from sglang-omni; looking up
``RelaydRelay`` or ``RelaydOperation`` does (they subclass its ``Relay`` and
``RelayOperation``), and registers the relay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._sglang_relay import RelaydOperation, RelaydRelay

__all__ = ["RelaydOperation", "RelaydRelay"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import _sglang_relay

        return getattr(_sglang_relay, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
