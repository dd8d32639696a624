"""Which transport each edge takes.

``router`` is the pure decision (two placements and payload facts in, a
transport out); ``registry`` holds the placements of every stage here and on
peers; ``topology`` places sessions from facts the daemon established itself
and answers the ``Route`` RPC from the two.
"""
