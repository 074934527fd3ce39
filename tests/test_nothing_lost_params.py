"""Only trainable parameters take part, and a model moved after the optimizer was built
is refused: the library API as a newcomer calls it (their own model with a frozen
layer, ``torch.optim.SGD(momentum=0.9)``, ``GossipOptimizer``), for every registered
algorithm, and the CLI with a ``--model module:function`` that freezes a layer."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import topologies
from gossip import algorithms, comm, rundir
from gossip import train as gossip_train
from gossip.runtime import GossipOptimizer, ModelMoved, MomentumConflict

NODES, FEATURES, CLASSES = 4, 6, 3


class Frozen(nn.Module):
    """A fine-tune: a frozen 'backbone' between two trainable layers."""

    def __init__(self, features: int = FEATURES, classes: int = CLASSES) -> None:
        super().__init__()
        self.inp = nn.Linear(features, 8)
        self.backbone = nn.Linear(8, 8)
        self.head = nn.Linear(8, classes)
        self.backbone.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.relu(self.backbone(torch.relu(self.inp(x)))))


def frozen_net(input_shape, num_classes):
    """``--model tests.test_nothing_lost_params:frozen_net``."""
    return Frozen(int(input_shape[-1]), num_classes)


def _build(name: str, momentum: float = 0.9):
    c = comm.SimulatedCommunicator(topologies.build("ring", NODES))
    models = []
    for _ in range(NODES):
        torch.manual_seed(1)
        models.append(Frozen())
    algo = algorithms.build(name, c, **({"p": 0.2} if name == "sketched" else {}))
    try:
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=momentum, weight_decay=1e-3) for m in models]
        return models, GossipOptimizer(models, opts, algo)
    except MomentumConflict:  # the algorithm owns momentum: what its message says to do
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.0, weight_decay=1e-3) for m in models]
        return models, GossipOptimizer(models, opts, algorithms.build(name, c))


def _train(models, opt, steps: int = 6) -> None:
    gens = [torch.Generator().manual_seed(10 + i) for i in range(NODES)]
    for _ in range(steps):
        opt.zero_grad()
        for m, g in zip(models, gens):
            x = torch.randn(8, FEATURES, generator=g)
            y = torch.randint(0, CLASSES, (8,), generator=g)
            F.cross_entropy(m(x), y).backward()
        opt.step()


@pytest.mark.parametrize("name", list(algorithms.available()))
def test_frozen_parameters_never_move_for_any_algorithm(name):
    models, opt = _build(name)
    frozen0 = {k: v.clone() for k, v in models[0].backbone.state_dict().items()}
    trained0 = models[0].head.weight.detach().clone()
    assert opt.layout.names == ("inp.weight", "inp.bias", "head.weight", "head.bias")
    assert opt.flat.dim == sum(p.numel() for p in models[0].parameters() if p.requires_grad)
    _train(models, opt)
    for m in models:  # bit-identical, on every node
        for k, v in m.backbone.state_dict().items():
            assert torch.equal(v, frozen0[k]), (name, k)
        assert m.backbone.weight.grad is None
    assert not torch.equal(models[0].head.weight, trained0), f"{name}: the trainable layer did not train"


@pytest.mark.parametrize("change, needle", [
    (lambda m: m.double(), "is now float64 on cpu, it was float32 on cpu"),
    (lambda m: m.to(torch.bfloat16), "is now bfloat16"),
    (lambda m: setattr(m.inp.weight, "data", m.inp.weight.data.clone()), "was replaced"),
    (lambda m: m.backbone.requires_grad_(True), "'backbone.weight' was unfrozen"),
    (lambda m: m.head.requires_grad_(False), "'head.weight' of model 2 was frozen"),
])
def test_a_model_changed_after_construction_is_refused_at_step(change, needle):
    models, opt = _build("ecd")
    _train(models, opt, steps=1)
    change(models[2])
    for call in (opt.step, opt.state_dict, opt.consensus_distance):
        with pytest.raises(ModelMoved, match=needle) as e:
            call()
        assert "\n" not in str(e.value) and "build the GossipOptimizer" in str(e.value)


@pytest.mark.parametrize("algo", ["ecd", "dcd", "naive"])  # the three that moved frozen weights
def test_the_cli_leaves_a_frozen_layer_out(tmp_path, algo):
    out = tmp_path / "run"
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = gossip_train.main(["--simulate", "4", "--algo", algo, "--bits", "2", "--data", "synthetic",
                                "--model", "tests.test_nothing_lost_params:frozen_net", "--max-steps", "3",
                                "--no-progress", "--out", str(out)])
    assert rc == 0, err.getvalue()
    config = json.loads(rundir.config_path(out).read_text())
    assert config["layout"]["names"] == ["inp.weight", "inp.bias", "head.weight", "head.bias"]
    trainable = sum(p.numel() for p in Frozen(32, 10).parameters() if p.requires_grad)
    assert config["params"] == config["layout"]["dim"] == trainable
