"""Dependencies point one way: no import circle in gossip/, topologies/ or experiments/, counting the
imports inside functions, except the compressor registry's loading of its families;
the config schema never imports the fault-tolerant loop; the library never imports
the application (gossip.train) or the tools (gossip.tools); no module uses another
module's private names."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from tests.conftest import REPO

#: the one accepted circle: the registry imports each family lazily, and each family
#: registers itself with the registry
ACCEPTED = {frozenset({"gossip.compress.registry", "gossip.compress.baseline", "gossip.compress.qsgd",
                       "gossip.compress.quant", "gossip.compress.sign", "gossip.compress.sparse",
                       "gossip.compress.ternary"})}


def _modules(packages: tuple[str, ...] = ("gossip", "topologies")) -> dict[str, Path]:
    mods = {}
    for pkg in packages:
        for p in (REPO / pkg).rglob("*.py"):
            parts = list(p.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = p
    return mods


def import_graph(packages: tuple[str, ...] = ("gossip", "topologies")) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its body (functions too)."""
    mods = _modules(packages)

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


def test_no_import_circle_in_the_experiments():
    """The studies, the renderer and the benchmark import one way: the tables live in
    experiments/tables.py, which imports nothing of the project."""
    graph = import_graph(("experiments",))
    found = [sorted(c) for c in cycles(graph)]
    assert not found, f"import circles in experiments/ (imports inside functions count): {found}"
    assert graph["experiments.tables"] == set()


def test_the_checker_sees_a_circle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [frozenset({"a", "b", "c"})]


def test_the_config_schema_never_imports_fault_tolerance():
    """The schema (gossip/train/config*) and the loop never import the fault-tolerant
    run, directly or through another module: gossip.train.run hands a
    --fault-tolerance run to it."""
    graph = import_graph()
    ft = {"gossip.train.fault_tolerance", "gossip.train._ftcomm"}
    schema = {m for m in graph if m.startswith("gossip.train.config")}
    assert "gossip.train.config" in schema
    for m in sorted(schema | {"gossip.train.loop"}):
        assert not reachable(graph, m) & ft, m
    assert "gossip.train.fault_tolerance" in graph["gossip.train"]  # the dispatcher, checked to be seen


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for t in graph[todo.pop()] - seen:
            seen.add(t)
            todo.append(t)
    return seen


# ------------------------------------------------------------------ the library, the application, the tools
_MOVED = re.compile(r"^__moved_to__ = ", re.M)


def moved_paths() -> set[str]:
    """The modules kept at an old path that only re-export the module they moved to."""
    return {m for m, p in _modules().items() if _MOVED.search(p.read_text(encoding="utf-8"))}


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def library() -> set[str]:
    """gossip's modules less the tools, the application behind ``python -m gossip.train``
    (gossip/train/) and the old paths kept for one release."""
    return {m for m in _modules() if m.split(".")[0] == "gossip" and not _under(m, "gossip.tools")
            and not _under(m, "gossip.train")} - moved_paths()


def test_the_library_never_imports_the_tools_or_the_application():
    graph = import_graph()
    lib = library()
    assert {"gossip.runtime", "gossip.data", "gossip.compress", "gossip.rundir", "gossip.checkpoint"} <= lib
    assert not lib & {"gossip.tools.crossover", "gossip.crossover", "gossip.loop", "gossip.train",
                      "gossip.train.loop", "gossip.config"}
    found = {m: sorted(t for t in graph[m] if _under(t, "gossip.tools") or _under(t, "gossip.train")
                       or t in moved_paths()) for m in sorted(lib)}
    assert not {m: ts for m, ts in found.items() if ts}, \
        "the library imports the tools or the application (imports inside functions count)"


def test_the_old_paths_only_re_export_what_moved():
    """A module left at an old path imports the one it moved to and the one helper every
    such module uses (gossip._moved), and nothing else of the project."""
    graph = import_graph()
    for m in moved_paths():
        text = _modules()[m].read_text(encoding="utf-8")
        target = re.search(r'^__moved_to__ = "([\w.]+)"', text, re.M).group(1)
        assert target in graph[m], (m, graph[m])
        assert graph[m] <= {target, target.rsplit(".", 1)[0], "gossip._moved"}, (m, graph[m])


# ------------------------------------------------------------------ private names
def _owner(module: str, is_package: bool, name: str) -> str:
    """The package that owns the private ``name`` reached as ``module.name``: a package owns
    its private submodules and the private names of its ``__init__``; a module of a
    subpackage shares its private names with that subpackage; a module directly under
    gossip/ or topologies/ keeps them to itself (those top-level modules are components
    that talk through public names)."""
    if is_package:
        return module
    parent = module.rsplit(".", 1)[0]
    return parent if "." in parent else module


def private_uses(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Uses of a private name outside the package that owns it, in ``{module: (source,
    is_package)}``: ``from X import _name``, ``import X._name``, ``from X._m import ...``
    and ``X._name`` where ``X`` is bound to a project module by an import."""
    roots = {m.split(".")[0] for m in sources}
    found: list[str] = []

    def private(part: str) -> bool:
        return part.startswith("_") and not part.startswith("__")

    def check(user: str, module: str, name: str, how: str) -> None:
        if module not in sources:
            return
        owner = _owner(module, sources[module][1], name)
        if user != owner and not user.startswith(owner + "."):
            found.append(f"{user}: {how} (private to {owner})")

    def check_path(user: str, dotted: str, how: str) -> None:
        parts = dotted.split(".")
        for k in range(1, len(parts)):
            if private(parts[k]):
                check(user, ".".join(parts[:k]), parts[k], how)

    for user, (text, is_pkg) in sorted(sources.items()):
        pkg = user if is_pkg else user.rsplit(".", 1)[0]
        bound: dict[str, str] = {}  # a local name -> the project module it is bound to
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] in roots:
                        check_path(user, a.name, f"import {a.name}")
                        bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    head = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(head + ([node.module] if node.module else []))
                if base.split(".")[0] not in roots:
                    continue
                check_path(user, base, f"from {base} import ...")
                for a in node.names:
                    if private(a.name):
                        check(user, base, a.name, f"from {base} import {a.name}")
                    if f"{base}.{a.name}" in sources:
                        bound[a.asname or a.name] = f"{base}.{a.name}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and private(node.attr):
                chain, inner = [], node.value
                while isinstance(inner, ast.Attribute):
                    chain.append(inner.attr)
                    inner = inner.value
                if isinstance(inner, ast.Name) and inner.id in bound:
                    target = ".".join([bound[inner.id], *reversed(chain)])
                    check(user, target, node.attr, f"{target}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    """A private name (``_name``: a function, class, constant or module) may be used only
    inside the package that defines it, in gossip/ and topologies/ (tests aside):
    gossip/compress/ may use its own ``_kernels`` and ``_random._H1``, every gossip module
    ``gossip._checks``, but no module the private names of ``gossip.compress._kernels``
    from outside gossip/compress/, and no module those of a top-level module such as
    ``gossip.runtime`` (each module directly under gossip/ or topologies/ keeps its private
    names to itself)."""
    sources = {m: (p.read_text(encoding="utf-8"), p.name == "__init__.py") for m, p in _modules().items()}
    assert private_uses(sources) == []


def test_the_private_name_checker_sees_each_form():
    lib = {"p": ("", True), "p.a": ("_x = 1\n", False), "p._h": ("", False), "p.sub": ("", True),
           "p.sub._k": ("_y = 1\n", False), "p.sub.m": ("", False), "q": ("", True)}
    uses = {
        "p.b": "from p.a import _x",  # a top-level module's private name
        "p.c": "from p import a\ndef f():\n    return a._x",  # the same, as an attribute
        "p.d": "import p.sub._k",  # a subpackage's private module, from outside it
        "p.e": "from p.sub._k import y",
        "p.f": "import p.sub._k as k\nk._y",
        "q.g": "from p import _h",  # a package's private module, from another package
    }
    fine = {
        "p.sub.m": "from p.sub._k import _y\nfrom . import _k\n_k._y",  # inside the subpackage
        "p.h": "from p import _h\nimport p._h",  # the package's own private module
        "p.i": "from p.a import x\nimport os\nos._exit",  # public names; not the project's
    }
    found = private_uses({**lib, **{m: (code, False) for m, code in {**uses, **fine}.items()}})
    assert sorted({f.split(":")[0] for f in found}) == sorted(uses), found
