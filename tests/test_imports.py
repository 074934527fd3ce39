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
                data._DATASETS):
        assert isinstance(reg, Registry)
    for call, needle in [
        (lambda: algorithms.build("nope", None), "unknown algorithm 'nope'; known: allreduce, dpsgd"),
        (lambda: compress.build("nope"), "unknown compressor 'nope'; available: "),
        (lambda: models.build_model("nope", input_shape=(4,), num_classes=2), "unknown model 'nope'; known: cnn1d"),
        (lambda: data.build_dataset("nope"), "unknown dataset 'nope'; known: mnist1d"),
    ]:
        with pytest.raises(ValueError, match=needle):
            call()


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
