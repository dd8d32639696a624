"""Every gRPC request message, fuzzed against a live daemon: typed statuses, never an outage."""

from __future__ import annotations

import math
import threading
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from relayd_client.wire.proto import relay_pb2 as pb
from relayd_client.wire.status import ERROR_CODE_KEY

from tests._daemon import Daemon
from tests._figures import count, record
from tests.adversarial._raw import RawSession, stub
from tests.faults._support import rss_bytes, start_daemon, unique_node

pytestmark = pytest.mark.timeout(300)

MiB = 1 << 20
SETTINGS = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# What gRPC itself may answer for a malformed call, besides relayd's own typed errors.
NEVER = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL}


@pytest.fixture
def daemon_options() -> dict[str, Any]:
    return {"args": ("--max-sessions", "64", "--reserve-timeout", "0.3"), "pool": "32MiB"}


text = st.one_of(st.text(max_size=50), st.text(min_size=200, max_size=3000), st.just("x" * 70_000))
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -1.0, 1e-9, 0.05, math.inf, -math.inf, math.nan, 1e300]),
)
u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)
# Grant timeouts are bounded by the fuzzer's patience; the daemon caps them anyway.
short = st.one_of(st.floats(-1, 0.2), st.sampled_from([math.nan, -math.inf, 0.0]))


def call(fn: Any, req: Any) -> str:
    """Make one call; fail on an untyped status. Returns the outcome's name."""
    count("gRPC requests fuzzed")
    try:
        fn(req, timeout=5)
    except grpc.RpcError as err:
        code = err.code()
        assert code not in NEVER, (code, err.details())
        keys = dict(err.trailing_metadata() or ())
        assert ERROR_CODE_KEY in keys or code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, keys)
        return str(code.name)
    return "OK"


def serving(d: Daemon) -> bool:
    with grpc.insecure_channel(f"unix:{d.socket}") as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


def test_fuzzed_requests_get_typed_statuses_and_the_daemon_survives(daemon: Daemon) -> None:
    rss_before = rss_bytes(daemon.pid)
    outcomes: dict[str, int] = {}
    session = RawSession(daemon.socket, "fuzzer")
    a = session.attach

    def tally(name: str) -> None:
        outcomes[name] = outcomes.get(name, 0) + 1

    with stub(daemon.socket) as s:

        @SETTINGS
        @given(
            st.builds(
                pb.AttachRequest,
                protocol_version=st.one_of(st.just(1), u32),
                stages=st.lists(text, max_size=20),
                pid=u32,
                node_hint=text,
                namespaces=st.dictionaries(text, text, max_size=10),
                gpu_uuids=st.lists(text, max_size=70),
            )
        )
        def attach(req: pb.AttachRequest) -> None:
            tally("Attach:" + call(s.Attach, req))

        @SETTINGS
        @given(
            st.booleans(),
            st.one_of(text, st.just(a.session_id)),
            st.one_of(st.binary(max_size=64), st.just(a.session_token)),
            st.one_of(u64, st.integers(0, 8 * MiB)),
            short,
        )
        def grant(real: bool, sid: str, token: bytes, min_bytes: int, timeout: float) -> None:
            req = pb.GrantRequest(
                session_id=a.session_id if real else sid,
                session_token=a.session_token if real else token,
                min_bytes=min_bytes,
                timeout_seconds=timeout,
            )
            tally("Grant:" + call(s.Grant, req))

        @SETTINGS
        @given(st.one_of(text, st.just(a.session_id)), st.binary(max_size=64), text)
        def abort(sid: str, token: bytes, rid: str) -> None:
            req = pb.AbortRequest(session_id=sid, session_token=token, request_id=rid)
            tally("Abort:" + call(s.Abort, req))
            req = pb.AbortRequest(
                session_id=a.session_id, session_token=a.session_token, request_id=rid
            )
            tally("Abort(own session):" + call(s.Abort, req))

        attach()
        grant()
        abort()
        tally("Status:" + call(s.Status, pb.StatusRequest()))
        # Raw bytes that are not the request message at all, and one over gRPC's size limit.
        with grpc.insecure_channel(f"unix:{daemon.socket}") as ch:
            for method in ("Attach", "Grant", "Abort", "Status"):
                fn = ch.unary_unary(
                    f"/relayd.v1.Relay/{method}",
                    request_serializer=lambda b: b,
                    response_deserializer=lambda b: b,
                )
                for junk in (b"\xff" * 64, bytes(range(256)), b"\x0a\xff\xff\xff\xff\x0f"):
                    count("gRPC requests fuzzed")
                    try:
                        fn(junk, timeout=10)
                        tally(f"{method}(junk):OK")
                    except grpc.RpcError as err:
                        # gRPC's own deserializer refuses it before relayd sees it.
                        assert err.code() != grpc.StatusCode.UNAVAILABLE
                        tally(f"{method}(junk):{err.code().name}")
            big = pb.AttachRequest(protocol_version=1, stages=["s"], node_hint="x" * (5 * MiB))
            tally("Attach(5 MiB):" + call(s.Attach, big))

    session.close()
    assert serving(daemon)
    growth = rss_bytes(daemon.pid) - rss_before
    record("gRPC fuzz", f"outcomes={outcomes} daemon RSS growth={growth >> 10} KiB")
    assert growth < 96 * MiB
    assert daemon.status()["state"] == "DAEMON_STATE_SERVING"


def test_drain_with_bad_grace_is_refused_and_a_good_one_drains(daemon: Daemon) -> None:
    from relayd.operator import operator_session

    with operator_session(daemon.socket) as op:
        s, sid, token = op.stub, op.session_id, op.token
        for grace in (math.inf, 1e9, 3601.0):
            req = pb.DrainRequest(grace_seconds=grace, session_id=sid, session_token=token)
            assert call(s.Drain, req) == "INVALID_ARGUMENT"
        assert serving(daemon)
        req = pb.DrainRequest(grace_seconds=0.5, session_id=sid, session_token=token)
        assert call(s.Drain, req) == "OK"
    assert daemon.proc is not None and daemon.proc.wait(timeout=30) == 0


def test_grant_waits_are_capped_by_reserve_timeout(tmp_path: object) -> None:
    d = start_daemon(str(tmp_path), unique_node(), "--reserve-timeout", "0.5", pool="16MiB")
    try:
        sess = RawSession(d.socket, "hog")
        sess.grant(8 * MiB)  # the stage's whole quota
        result: dict[str, str] = {}

        def ask() -> None:
            with stub(d.socket) as s:
                result["code"] = call(
                    s.Grant,
                    pb.GrantRequest(
                        session_id=sess.attach.session_id,
                        session_token=sess.attach.session_token,
                        min_bytes=MiB,
                        timeout_seconds=math.inf,
                    ),
                )

        t = threading.Thread(target=ask)
        t.start()
        t.join(10)
        assert not t.is_alive(), "an infinite grant timeout was not capped"
        assert result["code"] == "RESOURCE_EXHAUSTED"
        sess.close()
    finally:
        d.stop()
