"""Dependencies point one way: no import circle in gossip/ or topologies/, counting the
imports inside functions, except the compressor registry's loading of its families;
the config schema never imports the fault-tolerant loop."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from tests.conftest import REPO

#: the one accepted circle: the registry imports each family lazily, and each family
#: registers itself with the registry
ACCEPTED = {frozenset({"gossip.compress.registry", "gossip.compress.baseline", "gossip.compress.qsgd",
                       "gossip.compress.quant", "gossip.compress.sign", "gossip.compress.sparse",
                       "gossip.compress.ternary"})}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in ("gossip", "topologies"):
        for p in (REPO / pkg).rglob("*.py"):
            parts = list(p.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = p
    return mods


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its body (functions too)."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rsplit(".", 1)[0] if "." in name else ""
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    head = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(head + ([node.module] if node.module else []))
                # a submodule imported from its package, else a name of the module
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for n in names:
                r = resolve(n)
                if r and r != m:
                    graph[m].add(r)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[frozenset[str]] = []
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_but_the_compressor_registry():
    found = [sorted(c) for c in cycles(import_graph()) if c not in ACCEPTED]
    assert not found, f"import circles (imports inside functions count): {found}"


def test_the_checker_sees_a_circle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [frozenset({"a", "b", "c"})]


def test_the_config_schema_never_imports_fault_tolerance():
    graph = import_graph()
    assert "gossip.fault_tolerance" not in graph["gossip.config"]
    assert "gossip.fault_tolerance" not in graph["gossip.loop"]
