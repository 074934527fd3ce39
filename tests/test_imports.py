"""How the packages hang together: no import cycle, one registry mechanism, shared
errors and checks, torch-free topologies, a cheap ``import gossip``."""

from __future__ import annotations

import ast
import sys

import pytest
import torch

from gossip import _checks, algorithms, compress, data, models
from gossip._registry import Registry
from gossip.errors import NonFiniteError, PayloadError
from tests.conftest import REPO, child_env, run_process

PACKAGES = ("gossip", "topologies")


def _module_name(path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """Module-level imports between the project's modules (imports inside functions are
    the deliberate, deferred ones and are left out)."""
    files = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    mods = {_module_name(p): p for p in files}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_pkg = path.name == "__init__.py"
        for node in tree.body:  # module level only
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node)
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                while t and t not in mods:  # `from pkg import name`: the module or the package
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert "gossip.compress.base" in graph and "gossip.algorithms.mergecomp" in graph
    # a package importing its own submodules is not a cycle; only module -> module edges count
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges))


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_compress_base_does_not_import_the_registry_and_quantizers_share_no_private_helpers():
    graph = import_graph()
    assert "gossip.compress.registry" not in graph["gossip.compress.base"]
    for m in ("gossip.compress.qsgd", "gossip.compress.ternary"):
        assert "gossip.compress.quant" not in graph[m]
    assert not any(t.startswith("gossip.compress") for t in graph["gossip.comm.base"] | graph["gossip.errors"])


def test_topologies_and_gossip_import_without_torch():
    code = ("import sys, topologies, gossip, gossip.errors, gossip._registry, gossip._checks; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]")
    r = run_process([sys.executable, "-c", code], timeout=120, cwd=REPO, env=child_env())
    assert r.returncode == 0, r.stderr[-2000:]


def test_one_registry_mechanism_for_every_family():
    from topologies import registry as topo_registry
    from gossip.compress import registry as comp_registry

    for reg in (algorithms._REGISTRY, comp_registry._REGISTRY, topo_registry._REGISTRY, models._MODELS,
                data.datasets._DATASETS):
        assert isinstance(reg, Registry)
    for call, needle in [
        (lambda: algorithms.build("nope", None), "unknown algorithm 'nope'; known: allreduce, dpsgd"),
        (lambda: compress.build("nope"), "unknown compressor 'nope'; available: "),
        (lambda: models.build_model("nope", input_shape=(4,), num_classes=2), "unknown model 'nope'; known: cnn1d"),
        (lambda: data.build_dataset("nope"), "unknown dataset 'nope'; known: mnist1d"),
    ]:
        with pytest.raises(ValueError, match=needle):
            call()


def test_topologies_imports_nothing_from_gossip():
    """topologies is the package below gossip: its registry mechanism is gossip's, not
    the other way round. Checked on the import graph (deferred imports included) and in
    a fresh interpreter that builds a topology."""
    for path in (REPO / "topologies").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            assert not [n for n in names if n.split(".")[0] == "gossip"], f"{path.name}:{node.lineno}"
    code = ("import sys, topologies, topologies.registry, topologies.__main__; topologies.build('expander', 8); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'gossip'))")
    r = run_process([sys.executable, "-c", code], timeout=120, cwd=REPO, env=child_env())
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-2000:])
    import topologies.registry

    assert Registry is topologies.registry.Registry  # one mechanism, topologies' side


def test_no_private_name_crosses_a_package():
    """``from m import _name`` (a private function, class or constant; private modules
    such as ``gossip._checks`` are a package's shared internals) stays inside the
    subpackage that owns it (``gossip.algorithms``, ``gossip.comm``, ...); the top-level
    modules of gossip and topologies are components that talk through public names."""
    mods = {_module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    leaks = []
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        home = mod if is_pkg else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.module == "__future__":
                continue
            base = _resolve(mod, is_pkg, node)
            if base.split(".")[0] not in PACKAGES:
                continue
            parts = base.split(".")
            first = next((k for k, c in enumerate(parts) if c.startswith("_")), None)
            if first is not None:  # a private module: its parent package's alone
                parent = ".".join(parts[:first])
                if home != parent and not home.startswith(parent + "."):
                    leaks.append(f"{mod}: from {base} import ...")
            owner = base if base in mods and mods[base].name == "__init__.py" else base.rpartition(".")[0]
            for a in node.names:
                private = a.name.startswith("_") and f"{base}.{a.name}" not in mods
                if private and (owner != home or owner in PACKAGES):
                    leaks.append(f"{mod}: from {base} import {a.name}")
    assert leaks == [], leaks


def test_every_family_lists_names_with_summaries_the_same_way():
    import topologies

    for listing in (algorithms.available(), compress.available(), topologies.available(),
                    models.available_models(), data.available_datasets()):
        assert isinstance(listing, dict) and listing
        assert all(isinstance(k, str) and isinstance(v, str) and v for k, v in listing.items()), listing
    assert list(models.available_models())[0] == "cnn1d" and list(data.available_datasets())[0] == "mnist1d"


def test_registered_builders_refuse_options_they_do_not_take():
    r: Registry = Registry("widget")
    r.register("w", lambda n, *, size=1, seed=0: (n, size, seed), "a widget")
    assert r.parameters("w") == ["size", "seed"]
    assert r.builder("w", {"size": 2}, fixed=("seed",))(3, size=2) == (3, 2, 0)
    with pytest.raises(ValueError, match=r"^widget 'w' does not take option\(s\) seed; accepted: size$"):
        r.builder("w", {"seed": 1}, fixed=("seed",))


def test_registry_basics():
    r: Registry[int] = Registry("widget", known="widgets")
    r.register("b", 2, "the second")
    r.register("a", 1)
    assert r.names() == ["b", "a"] and list(r) == ["b", "a"] and "a" in r and len(r) == 2
    assert r.available() == {"b": "the second", "a": ""}
    with pytest.raises(ValueError, match="already registered"):
        r.register("a", 3)
    with pytest.raises(ValueError, match=r"^unknown widget 'c'; widgets: b, a$"):
        r.get("c")
    r.unregister("a")
    assert r.names() == ["b"]
    assert Registry("x", sort=True).register("z", 0) == 0


@pytest.mark.parametrize("spec, X", [
    ("quant:bits=8", torch.tensor([[1.0, float("nan")]])),
    ("qsgd:levels=4", torch.tensor([[float("inf"), 1.0]])),
    ("fp16", torch.tensor([[1e6, 1.0]])),
    ("quant:bits=4", torch.tensor([[3e38, -3e38]])),
])
def test_non_finite_input_is_a_non_finite_error(spec, X):
    with pytest.raises(NonFiniteError) as e:
        compress.build(spec).encode(X, torch.zeros(1, dtype=torch.int64))
    assert isinstance(e.value, ValueError)  # callers that catch ValueError keep working


def test_shared_errors_keep_their_old_paths():
    from gossip.comm import errors as comm_errors
    from gossip.compress import wire

    assert compress.PayloadError is PayloadError is wire.PayloadError
    assert comm_errors.PeerError is __import__("gossip.errors").errors.PeerError
    e = PayloadError(3, "checksum", "damaged")
    import pickle

    back = pickle.loads(pickle.dumps(e))
    assert (back.row, back.what, str(back)) == (3, "checksum", str(e))


def test_shared_checks():
    assert _checks.check_int("n", 3, minimum=1) == 3
    with pytest.raises(TypeError, match=r"^n must be an integer, got float 2.5$"):
        _checks.check_int("n", 2.5)
    with pytest.raises(TypeError, match="got bool True"):
        _checks.check_int("n", True)
    with pytest.raises(ValueError, match=r"^n must be >= 1, got 0$"):
        _checks.check_int("n", 0, minimum=1)
    with pytest.raises(ValueError, match=r"^n must be <= 4, got 5$"):
        _checks.check_int("n", 5, maximum=4)
    assert _checks.check_float("p", 0.5, lo=0, hi=1, lo_open=True) == 0.5
    with pytest.raises(ValueError, match=r"^p must satisfy 0 < x <= 1, got 0$"):
        _checks.check_float("p", 0, lo=0, hi=1, lo_open=True)
    with pytest.raises(ValueError, match=r"must satisfy finite, got nan"):
        _checks.check_float("p", float("nan"))
    with pytest.raises(TypeError, match="must be a number"):
        _checks.check_float("p", "0.5")
