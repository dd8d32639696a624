"""Drop-ins for the serving frameworks relayd's users run.

* :mod:`relayd_client.integrations.sglang_omni` - ``RelaydRelay``, an
  sglang-omni ``Relay`` (``pip install 'relayd-client[sglang-omni]'``).

Importing the module imports nothing from its framework; the framework is
imported when a class is first looked up (``from ... import RelaydRelay``).
"""
