"""Drop-ins for the serving frameworks relayd's users run.

* :mod:`relayd_client.integrations.sglang_omni` - ``RelaydRelay``, an
  sglang-omni ``Relay`` (``pip install 'relayd-client[sglang-omni]'``).
* :mod:`relayd_client.integrations.vllm_omni` - ``RelaydConnector``, a
  vllm-omni ``OmniConnectorBase``, registered through the
  ``vllm_omni.general_plugins`` entry point (``pip install
  'relayd-client[vllm-omni]'``).

Importing either module imports nothing from its framework; the framework is
imported when a class is first looked up (``from ... import RelaydRelay``).
"""
