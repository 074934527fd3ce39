"""Per-algorithm facts live on the algorithm classes; the tables that once kept them
beside the registry are derived from those attributes and equal what they were."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from torch import nn

import gossip
from gossip import algorithms, compress, ddp
from gossip.train.config import ConfigError, parse_args
from gossip.runtime import MomentumConflict

ROOT = pathlib.Path(gossip.__file__).resolve().parent


def test_ddp_hook_list_is_the_gradient_algorithms_and_equals_the_old_table():
    assert ddp.HOOK_ALGORITHMS == (
        "allreduce", "efsgd", "efblocksgd", "efblocksgdm", "signsgd", "signum", "powersgd",
        "efmomentum", "sketched", "truetopk", "localtopk", "demo",
    )
    for name in algorithms.available():
        assert (name in ddp.HOOK_ALGORITHMS) == (algorithms.algorithm_class(name).acts_on == "gradient")


def test_state_copies_are_declared_on_the_classes_as_the_loop_table_had_them():
    old = {"dcd": 8, "ecd": 9, "choco": 9, "naive": 5, "dpsgd": 5, "allreduce": 5, "powersgd": 7,
           "efmomentum": 7, "localsgd": 5, "slowmo": 7, "diloco": 9,
           "muloco": 9}  # muloco is diloco with Muon inside: its copies, inherited (the table had none)
    for name in algorithms.available():
        assert algorithms.algorithm_class(name).state_copies == old.get(name, 7), name


def test_mergeable_is_declared_and_the_config_refuses_merge_elsewhere():
    assert algorithms.mergeable() == ("efsgd", "efblocksgd", "efblocksgdm")
    with pytest.raises(ConfigError, match=r"^--merge schedules the error-feedback algorithms efsgd, efblocksgd, "
                                          r"efblocksgdm; got --algo powersgd$"):
        parse_args(["--algo", "powersgd", "--merge", "layer"])
    with pytest.raises(ValueError, match=r"merge applies to efsgd, efblocksgd, efblocksgdm .*not signum"):
        algorithms.build("signum", None, merge="layer")


def test_a_new_algorithm_registers_with_its_facts(monkeypatch):
    """One registration: the class, its Config and its attributes; the derived lists follow."""

    class Mine(algorithms.DistEFSGD):
        name = "mine-test"
        summary = "a test algorithm"
        state_copies = 3

    algorithms.register(Mine)
    try:
        assert algorithms.available()["mine-test"] == "a test algorithm"
        assert algorithms.config_class("mine-test") is algorithms.EFSGDConfig
        assert "mine-test" in algorithms.mergeable()
        with pytest.raises(ValueError, match="algorithm named 'mine-test' is already registered"):
            algorithms.register(Mine)
    finally:
        algorithms._REGISTRY.unregister("mine-test")
    with pytest.raises(TypeError, match="must be an Algorithm subclass"):
        algorithms.register(int)

    class NoConfig(algorithms.Algorithm):
        name = "noconfig-test"

    with pytest.raises(TypeError, match=r"NoConfig.Config must be a dataclass, got None"):
        algorithms.register(NoConfig)


def test_ddp_checks_options_on_the_config_alone(monkeypatch):
    """hook_state builds no algorithm before its groups (no communicator-less probe)."""

    def refuse(*a, **k):
        raise AssertionError("hook_state built an algorithm to check its options")

    monkeypatch.setattr(algorithms, "build", refuse)
    model = nn.Linear(3, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(MomentumConflict, match=r"^powersgd applies its own momentum \(0.9\) and the local SGD"):
        ddp.hook_state(model, "powersgd", optimizer=sgd)
    with pytest.raises(ValueError, match=r"powersgd: .*unexpected keyword.*rnak.*accepted options: rank"):
        ddp.hook_state(model, "powersgd", rnak=2)
    with pytest.raises(RuntimeError, match="no process group"):  # every check passed
        ddp.hook_state(model, "efsgd", momentum=0.5, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("spec,bits", [
    ("identity", 32.0), ("fp16", 16.0), ("sign", 1.0), ("blocksign", 1.0), ("quant:bits=4", 4.0),
    ("quant:bits=12", 12.0), ("topk:k=10", None),
])
def test_code_bits_is_the_compressors_own(spec, bits):
    c = compress.build(spec)
    want = bits if bits is not None else round(8.0 * c.ideal_nbytes(1000) / 1000, 4)
    assert c.code_bits(1000) == want


def test_only_mergecomp_fills_the_merge_summary_key():
    from gossip.comm import SimulatedCommunicator

    c = SimulatedCommunicator(world_size=2)
    assert algorithms.build("efsgd", c).summary_fields() == {"merge": None}
    mc = algorithms.build("efsgd", c, merge="whole")
    mc.setup(torch.zeros(2, 6))
    assert mc.summary_fields() == {"merge": mc.report()} and mc.report()["groups"] == 1


def _name_tables(path: pathlib.Path, names: set[str]) -> list[str]:
    """Literal tuples, lists, sets and dict keys naming three or more algorithms."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
        if not isinstance(node, (ast.Dict, ast.Tuple, ast.List, ast.Set)) or items is None:
            continue
        hits = {i.value for i in items if isinstance(i, ast.Constant) and i.value in names}
        if len(hits) >= 3:
            found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {sorted(hits)}")
    return found


def test_no_table_keyed_by_algorithm_name_outside_the_algorithms():
    names = set(algorithms.available())
    outside = [p for p in ROOT.rglob("*.py") if "algorithms" not in p.relative_to(ROOT).parts]
    assert [t for p in outside for t in _name_tables(p, names)] == []
    # and no algorithm reaches for a communicator's topology as if it might be missing
    for p in (ROOT / "algorithms").glob("*.py"):
        assert 'getattr(comm, "topology"' not in p.read_text(), p.name
