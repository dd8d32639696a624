"""The wire package stays light: the daemon and tools import it without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

LOADED = """
import importlib, sys
for name in {modules!r}:
    importlib.import_module(name)
print(",".join(sorted(m for m in {watch!r} if m in sys.modules)))
"""


def _loaded_after(modules: list[str], watch: tuple[str, ...]) -> set[str]:
    code = LOADED.format(modules=modules, watch=watch)
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
    return {m for m in cp.stdout.strip().split(",") if m}


def _wire_modules() -> list[str]:
    import pkgutil

    import relayd_client.wire

    return [
        f"relayd_client.wire.{m.name}"
        for m in pkgutil.iter_modules(relayd_client.wire.__path__)
        if m.name != "proto"
    ]


def test_no_wire_module_imports_torch() -> None:
    modules = _wire_modules()
    assert "relayd_client.wire.cuda_ipc" in modules and "relayd_client.wire.framing" in modules
    assert _loaded_after(modules, ("torch",)) == set()


@pytest.mark.parametrize(
    ("module", "absent"),
    [
        ("relayd_client.wire.transport", ("torch", "grpc")),
        ("relayd_client.wire.framing", ("torch", "grpc")),
        ("relayd_client.wire.cuda_ipc", ("torch", "grpc")),
        ("relayd_client.wire.paths", ("torch", "grpc")),
    ],
)
def test_a_wire_module_pulls_in_only_what_it_needs(module: str, absent: tuple[str, ...]) -> None:
    assert _loaded_after([module], absent) == set()


def test_the_check_sees_torch_when_it_is_imported() -> None:
    assert _loaded_after(["torch"], ("torch",)) == {"torch"}
