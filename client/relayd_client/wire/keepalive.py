"""How a client watches a daemon that stopped answering, on both of its sockets.

While a call is open, the gRPC channel pings the daemon after
:data:`KEEPALIVE_MS` in which it read nothing, and fails the call
(DaemonUnavailableError) when the answer takes over
:data:`KEEPALIVE_TIMEOUT_MS`. A daemon that froze (stopped, its host stalled)
keeps its socket open and ends nothing: without pings, a call waiting in it (a
put's Grant call waiting for space) would wait out its whole timeout. The
daemon reads the same numbers for the pace of pings it takes.

The session socket keeps the same rule with the same numbers for the calls
answered on it (keyed puts and takes, discards, cross-node fetches): while one
waits and the daemon has sent no frame for :data:`KEEPALIVE_MS`, the client
sends a frame with ``probe`` set, which the daemon answers at once
(``probe_answer``). When no frame at all comes within
:data:`KEEPALIVE_TIMEOUT_MS`, the waiting calls fail with
DaemonUnavailableError and the connection is ended, as if the daemon had hung
up. A client probes only a daemon whose BOUND event sets ``answers_probes``,
and never while no call waits.
"""

KEEPALIVE_MS = 5_000
KEEPALIVE_TIMEOUT_MS = 5_000
