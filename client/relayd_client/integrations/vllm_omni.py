"""relayd as a vllm-omni connector: ``RelaydConnector``.

The client distribution registers it through the ``vllm_omni.general_plugins``
entry point (:func:`register`), so a deployment YAML names it like a built-in::

    connectors:
      relayd:
        name: RelaydConnector
        extra:
          socket: /run/relayd/relayd.sock   # optional: RELAYD_SOCKET, then the default
          stage: qwen3-omni                 # optional: relayd stages are "<stage>.<id>"

Importing this module imports nothing from vllm-omni or vLLM; :func:`register`
and a lookup of ``RelaydConnector`` do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._vllm_connector import RelaydConnector

__all__ = ["CONNECTOR_NAME", "RelaydConnector", "register"]

CONNECTOR_NAME = "RelaydConnector"


def register() -> None:
    """The ``vllm_omni.general_plugins`` entry point: make ``RelaydConnector`` known.

    vllm-omni may load its plugins more than once in a process (and once in
    every worker process); a second call changes nothing.
    """
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory

    if CONNECTOR_NAME in OmniConnectorFactory.list_registered_connectors():
        return
    try:
        OmniConnectorFactory.register_connector(CONNECTOR_NAME, _create)
    except ValueError:  # another thread registered it in between
        if CONNECTOR_NAME not in OmniConnectorFactory.list_registered_connectors():
            raise


def _create(config: dict[str, Any]) -> RelaydConnector:
    from ._vllm_connector import RelaydConnector

    return RelaydConnector(config)


def __getattr__(name: str) -> Any:
    if name == "RelaydConnector":
        from . import _vllm_connector

        return _vllm_connector.RelaydConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
