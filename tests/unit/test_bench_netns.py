"""The bench's network namespaces: refused clearly without root, always removed after."""

from __future__ import annotations

import subprocess

import pytest

from relayd_bench import _cli, _netns


def test_netns_without_root_is_a_clear_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(_netns.os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit) as exc:
        _cli.main(["--netns", "--quick", "--methods", "mooncake-raw"])
    assert exc.value.code == 2
    assert "--netns: network namespaces need root" in capsys.readouterr().err


def test_netns_rate_must_be_a_tc_rate(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _cli.main(["--netns-rate", "fast", "--methods", "memcpy"])
    assert "--netns-rate: not a tc rate" in capsys.readouterr().err


def _listed() -> str:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return done.stdout


def test_namespaces_are_unique_and_removed_even_on_interrupt() -> None:
    try:
        _netns.check_available()
    except _netns.NetnsUnavailable as exc:
        pytest.skip(str(exc))
    names: list[str] = []
    with (
        pytest.raises(KeyboardInterrupt),
        _netns.netns_pair(rate="10gbit") as a,
        _netns.netns_pair(rate="10gbit") as b,
    ):
        names += [*a.names, *b.names]
        assert len(set(names)) == 4 and len({*a.devs, *b.devs}) == 4
        assert all(n in _listed() for n in names)
        writer_end, reader_end = _netns.tcp_pair(a.names, a.addrs[0])
        with writer_end, reader_end:
            writer_end.sendall(b"ref")
            assert reader_end.recv(3) == b"ref"
            assert reader_end.getpeername()[0] == a.addrs[0]  # across the veth
        raise KeyboardInterrupt
    assert not any(n in _listed() for n in names)
