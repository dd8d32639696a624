"""relayd: the per-node relay daemon. The client lives in ``relayd_client``."""

__version__ = "0.1.0"
