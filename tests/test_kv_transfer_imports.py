"""No import circles among the connector modules (minivllm/distributed/kv_transfer/*.py): every
import counts, at top level, under ``TYPE_CHECKING`` and inside functions. The debugging connector
is one module over ``storage``, and the Redis connector does not import it."""
from __future__ import annotations

import ast
import os

import minivllm.distributed.kv_transfer as kv_transfer

PKG = kv_transfer.__name__
DIR = os.path.dirname(kv_transfer.__file__)


def import_graph() -> dict[str, set[str]]:
    mods = {(PKG if f == "__init__.py" else f"{PKG}.{f[:-3]}"): os.path.join(DIR, f)
            for f in os.listdir(DIR) if f.endswith(".py")}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        with open(path) as fh:
            tree = ast.parse(fh.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # ``from pkg import mod`` imports the submodule, ``from mod import name`` the module
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                         for a in node.names]
            else:
                continue
            graph[mod].update(n for n in names if n in mods and n != mod)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each cycle found by a depth-first walk, as the modules on it."""
    found, state, path = [], {}, []

    def visit(m: str) -> None:
        state[m] = "open"
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                found.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n)
        state[m] = "done"
        path.pop()
    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_connector_modules_import_no_circle():
    graph = import_graph()
    assert f"{PKG}.shared_storage_connector" in graph and f"{PKG}.storage" in graph
    assert cycles(graph) == []


def test_redis_connector_does_not_import_the_debugging_connector():
    graph = import_graph()
    for mod in ("redis_store_connector", "redis_store_worker", "zmq_pull_connector", "zmq_pull_worker"):
        assert f"{PKG}.shared_storage_connector" not in graph[f"{PKG}.{mod}"], mod


def test_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b", "a"]]
