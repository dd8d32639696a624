"""The wire contract the client and the daemon share.

What both programs must agree on byte for byte or rule for rule lives here,
once: the error tree and its gRPC table (:mod:`.errors`, :mod:`.status`), the
generated protobuf modules (:mod:`.proto`), session-socket framing
(:mod:`.framing`), the arena's segment and slot-header layout (:mod:`.shm`)
and the slot allocator (:mod:`.slots`), transport names and the limits that
choose between them (:mod:`.transport`), what a stage, request id and key may
be (:mod:`.names`), DataRef bytes (:mod:`.dataref`), latency buckets
(:mod:`.latency`), peer credentials (:mod:`.peercred`), the CUDA IPC handles of
GPU pools (:mod:`.cuda_ipc`), default paths (:mod:`.paths`) and the protocol
version (:mod:`.version`).

The daemon imports the client only through this package and the public API
of ``relayd_client`` (``tests/unit/test_import_graph.py`` checks it). This
module imports nothing, so importing a part pulls in only what that part needs:
never torch, and grpc only through :mod:`.status` and the generated service
stubs (``tests/unit/test_wire_imports.py``).
"""
