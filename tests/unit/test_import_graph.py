"""The daemon's modules import each other without cycles.

Read from the source, not by importing it: an import inside a function counts
as much as one at the top of a module (it runs the first time the function
does, and a cycle through it still ties the two modules together). Imports
under ``if TYPE_CHECKING:`` do not run, but they tie modules together for the
type checker and for a reader just the same: the type-level graph counts them
too, and must be free of cycles as well.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = "relayd"


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run, at any depth, skipping TYPE_CHECKING blocks."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            yield from (n for s in child.orelse for n in _runtime_imports_of(s))
            continue
        yield from _runtime_imports_of(child)


def _runtime_imports_of(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    else:
        yield from _runtime_imports(node)


def _all_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, TYPE_CHECKING blocks included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def _graph(*, type_level: bool = False) -> dict[str, set[str]]:
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        for node in _all_imports(tree) if type_level else _runtime_imports(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, *([base] if base else [])])
                # ``from . import x`` names a submodule when there is one.
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            for target in targets:
                dep = owner(target) if target.startswith(PACKAGE) else None
                if dep is not None and dep != name:
                    graph[name].add(dep)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_function_level_imports() -> None:
    graph = _graph()
    assert "relayd.demo" in graph["relayd.cli"]  # imported inside cmd_demo
    assert "relayd.rpc.peer_service" in graph["relayd.peers"]  # inside PeerManager.start
    assert "relayd.rpc.keyed" not in graph["relayd.rpc.session"]  # only under TYPE_CHECKING


def test_the_type_level_graph_sees_type_checking_imports() -> None:
    assert "relayd.rpc.keyed" in _graph(type_level=True)["relayd.rpc.session"]


def test_a_cycle_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_the_daemon_has_no_import_cycles() -> None:
    cycles = _cycles(_graph())
    assert cycles == [], "import cycles among relayd's modules: " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_daemon_has_no_type_level_import_cycles() -> None:
    cycles = _cycles(_graph(type_level=True))
    assert cycles == [], "import cycles among relayd's modules, TYPE_CHECKING counted: " + (
        "; ".join(" <-> ".join(c) for c in cycles)
    )


# The daemon reaches the client only through the shared wire package and the
# public API; everything else in relayd_client is the client's own business.
CLIENT = "relayd_client"
CLIENT_OPEN = (f"{CLIENT}.wire", f"{CLIENT}.integrations")


def _public_names() -> set[str]:
    tree = ast.parse((ROOT / "client" / CLIENT / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return {ast.literal_eval(e) for e in node.value.elts}  # type: ignore[attr-defined]
    raise AssertionError("relayd_client/__init__.py has no __all__")


def _client_imports_outside_the_wire() -> list[str]:
    public = _public_names()

    def open_module(name: str) -> bool:
        return name == CLIENT or any(name == m or name.startswith(m + ".") for m in CLIENT_OPEN)

    found = []
    for name, path in _modules().items():
        # Every import counts here, TYPE_CHECKING ones too: a type is part of the contract.
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                bad = [
                    a.name
                    for a in node.names
                    if a.name.split(".")[0] == CLIENT and not open_module(a.name)
                ]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                module = node.module or ""
                if module.split(".")[0] != CLIENT or (module != CLIENT and open_module(module)):
                    continue
                if module == CLIENT:
                    bad = [
                        f"{CLIENT}.{a.name}"
                        for a in node.names
                        if a.name not in public and not open_module(f"{CLIENT}.{a.name}")
                    ]
                else:
                    bad = [module]
            else:
                continue
            found += [f"{name}:{node.lineno} imports {b}" for b in bad]
    return found


def test_the_boundary_check_sees_private_imports() -> None:
    public = _public_names()
    assert "RelayClient" in public and "DataRef" in public
    assert "_client" not in public


def test_the_daemon_imports_the_client_only_through_wire_and_the_public_api() -> None:
    found = _client_imports_outside_the_wire()
    assert found == [], "relayd imports private client modules:\n" + "\n".join(found)
