"""How a client's gRPC channel watches a daemon that stopped answering, on both sides of the socket.

While a call is open, the channel pings the daemon after :data:`KEEPALIVE_MS`
in which it read nothing, and fails the call (DaemonUnavailableError) when the
answer takes over :data:`KEEPALIVE_TIMEOUT_MS`. A daemon that froze (stopped,
its host stalled) keeps its socket open and ends nothing: without pings, a call
waiting in it (a put's Grant call waiting for space) would wait out its whole
timeout. The daemon reads the same numbers for the pace of pings it takes.
"""

KEEPALIVE_MS = 5_000
KEEPALIVE_TIMEOUT_MS = 5_000
