"""The library API as a newcomer uses it: their own model, their own ``torch.optim.SGD``
with momentum, ``GossipOptimizer``, eight simulated nodes, non-iid data.

Every registered algorithm either refuses the local momentum at construction, in one
line, because it applies momentum itself, or ends within 2 accuracy points of
``allreduce``. The refusing ones, given the local optimizer without momentum they ask
for, reach that accuracy too (with the momentum compounded, PowerSGD, efblocksgdm,
efmomentum and Sketched-SGD end 3 to 25 points below on this problem). Run with ``-s``
for the table.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import topologies
from gossip import algorithms, comm
from gossip.algorithms import ParamLayout, WireFormat
from gossip.runtime import FlatParams, GossipOptimizer

NODES, CLASSES, FEATURES = 8, 4, 10
STEPS, BATCH, LR = 150, 16, 0.05
#: sign methods move every coordinate by +-lr (majority vote): a smaller step. On
#: non-iid data the vote is biased; with other draws of this data they end up to 2
#: points below allreduce
LR_OF = {"signsgd": 0.01, "signum": 0.01}
#: Sketched-SGD's default k is 1% of the ~400 compressed coordinates, 4 per step: too few
#: for 150 steps of this tiny model, whatever the momentum
OPTIONS_OF = {"sketched": {"p": 0.05}}


class Net(nn.Module):
    """The newcomer's own model: two linear layers (matrices and biases)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(FEATURES, 32)
        self.out = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


def _blobs(n: int, classes: list[int], gen: torch.Generator, centres: torch.Tensor):
    y = torch.tensor(classes)[torch.randint(len(classes), (n,), generator=gen)]
    return centres[y] + torch.randn(n, FEATURES, generator=gen), y


def _data():
    """Gaussian blobs; node i holds classes i mod 4 and (i + 1) mod 4 (node 0..3) or
    only class i mod 4 (nodes 4..7): non-iid, 1-2 classes per node."""
    gen = torch.Generator().manual_seed(0)
    centres = 1.2 * torch.randn(CLASSES, FEATURES, generator=gen)
    shards = []
    for i in range(NODES):
        held = [i % CLASSES, (i + 1) % CLASSES] if i < 4 else [i % CLASSES]
        shards.append(_blobs(STEPS * BATCH, held, gen, centres))
    test = _blobs(2000, list(range(CLASSES)), gen, centres)
    return shards, test


SHARDS, TEST = _data()


def _train(name: str, momentum: float) -> float:
    """Accuracy of the nodes' averaged model after STEPS steps; raises what
    GossipOptimizer raises."""
    c = comm.SimulatedCommunicator(topologies.build("ring", NODES))
    algo = algorithms.build(name, c, **OPTIONS_OF.get(name, {}))
    models, opts = [], []
    for _ in range(NODES):
        torch.manual_seed(0)
        models.append(Net())
        opts.append(torch.optim.SGD(models[-1].parameters(), lr=LR_OF.get(name, LR), momentum=momentum))
    opt = GossipOptimizer(models, opts, algo)
    for s in range(STEPS):
        opt.zero_grad()
        for (x, y), m in zip(SHARDS, models):
            F.cross_entropy(m(x[s * BATCH : (s + 1) * BATCH]), y[s * BATCH : (s + 1) * BATCH]).backward()
        opt.step()
    with torch.no_grad():  # the averaged model, in node 0's
        opt.flat.data[0].copy_(opt.average())
        x, y = TEST
        return float((models[0](x).argmax(1) == y).float().mean())


@pytest.fixture(scope="module")
def baseline() -> float:
    return _train("allreduce", 0.9)


def test_every_algorithm_refuses_a_second_momentum_or_matches_allreduce(baseline):
    rows = [("allreduce", "0.9", f"{baseline:.3f}", "")]
    assert baseline > 0.9
    for name in algorithms.available():
        if name == "allreduce":
            continue
        try:
            acc = _train(name, 0.9)
        except ValueError as e:
            msg = str(e)
            assert "\n" not in msg and name in msg and "momentum=0.9" in msg and "momentum=0" in msg, msg
            acc = _train(name, 0.0)  # what the message asks for
            rows.append((name, "0 (refused 0.9)", f"{acc:.3f}", msg[:60] + "..."))
        else:
            rows.append((name, "0.9", f"{acc:.3f}", ""))
        assert acc >= baseline - 0.02, (name, acc, baseline)
    print()
    print(f"{'algorithm':<12} {'local momentum':<16} {'accuracy':<9} refusal")
    for r in rows:
        print(f"{r[0]:<12} {r[1]:<16} {r[2]:<9} {r[3]}")


def test_owners_of_momentum_are_declared():
    c = comm.SimulatedCommunicator(topologies.build("complete", 2))
    owners = {n for n in algorithms.available() if algorithms.build(n, c).owns_momentum}
    assert {"powersgd", "efblocksgdm", "signum", "efmomentum", "sketched"} <= owners
    assert not owners & {"allreduce", "efsgd", "efblocksgd", "signsgd"}
    assert algorithms.build("efsgd", c, momentum=0.5).owns_momentum


def test_the_refusal_names_both_and_what_to_do():
    c = comm.SimulatedCommunicator(world_size=1)
    m = Net()
    with pytest.raises(ValueError) as e:
        GossipOptimizer(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), algorithms.build("powersgd", c))
    assert str(e.value) == (
        "powersgd applies its own momentum and the local SGD has momentum=0.9: they would compound; "
        "give the local optimizer momentum=0, and set the algorithm's momentum option instead"
    )
    # Adam's beta1 is a momentum as well
    with pytest.raises(ValueError, match=r"the local Adam has betas\[0\]=0.9"):
        GossipOptimizer(m, torch.optim.Adam(m.parameters()), algorithms.build("efblocksgdm", c))
    GossipOptimizer(m, torch.optim.SGD(m.parameters(), lr=0.1), algorithms.build("powersgd", c))


def test_schedulers_reach_the_algorithm_through_the_optimizer():
    """The algorithm reads eta_t from the local optimizer every step (error memories
    are rescaled by eta_{t-1} / eta_t), so a library user's scheduler is seen."""
    c = comm.SimulatedCommunicator(world_size=1)
    m = Net()
    sgd = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)
    algo = algorithms.build("efsgd", c)
    opt = GossipOptimizer(m, sgd, algo)
    for want in (0.1, 0.05, 0.025):
        opt.zero_grad()
        m(torch.randn(4, FEATURES)).sum().backward()
        opt.step()
        assert algo.state.prev_lr == pytest.approx(want)
        sched.step()


def test_no_config_carries_shapes_or_offsets():
    for name in algorithms.available():
        fields = {f.name for f in dataclasses.fields(algorithms.config_class(name))}
        assert not fields & {"shapes", "offsets"}, name


def test_the_layout_comes_from_the_model():
    models = [Net(), Net()]
    flat = FlatParams(models)
    lay = flat.layout
    assert lay == ParamLayout.from_models(models)
    assert lay.names == ("hidden.weight", "hidden.bias", "out.weight", "out.bias")
    assert lay.shapes == ((32, FEATURES), (32,), (CLASSES, 32), (CLASSES,))
    assert lay.offsets == (0, 320, 352, 480) and lay.dim == 484 == flat.dim
    assert lay.blocks == ((0, 320), (320, 32), (352, 128), (480, 4))
    assert lay.to_dict()["shapes"][0] == [32, FEATURES]
    assert ParamLayout.from_shapes(lay.shapes).names == ("p0", "p1", "p2", "p3")
    assert ParamLayout.whole(7).blocks == ((0, 7),)
    with pytest.raises(ValueError, match=r"ParamLayout: tensor names must be unique"):
        ParamLayout(("a", "a"), ((2,), (3,)))
    with pytest.raises(ValueError, match=r"ParamLayout: `names` must be 2 non-empty strings"):
        ParamLayout(("a",), ((2,), (3,)))
    with pytest.raises(TypeError, match=r"ParamLayout: `shapes` must be a sequence of shapes"):
        ParamLayout.from_shapes([(2, "x")])
    with pytest.raises(ValueError, match=r"ParamLayout: sizes must be non-negative"):
        ParamLayout.from_shapes([(2, -1)])
    other = nn.Linear(3, 3)
    with pytest.raises(ValueError, match=r"model 1 has parameter shapes"):
        ParamLayout.from_models([Net(), other])


def _wire(name: str, **opts) -> WireFormat:
    topo = topologies.build("complete", 2) if algorithms.is_decentralized(name) else None
    c = comm.SimulatedCommunicator(topo, world_size=2)
    models = []
    for _ in range(2):
        models.append(Net())
    algo = algorithms.build(name, c, **opts)
    GossipOptimizer(models, [torch.optim.SGD(m.parameters(), lr=0.1) for m in models], algo)
    return algo.wire_format()


def test_algorithms_describe_their_wire_format():
    assert _wire("efblocksgd") == _wire("efblocksgdm")
    w = _wire("efblocksgd")
    assert w.label == "blocksign" and w.bits_per_coord == 1.0
    assert _wire("signsgd").label == _wire("signum").label == "sign"
    assert _wire("signsgd").bits_per_coord == 1.0
    assert _wire("ecd", compressor="quant:bits=8").to_dict()["label"] == "quant:bits=8"
    assert _wire("ecd", compressor="quant:bits=8").bits_per_coord == 8.0
    assert _wire("dcd", compressor="quant:bits=4").bits_per_coord == 4.0
    assert _wire("dpsgd").label == _wire("allreduce").label == "fp32"
    assert _wire("efsgd", compressor="topk:p=0.25").bits_per_coord == pytest.approx(0.25 * 64, rel=0.05)
    # PowerSGD: its rank; 32 bits of every P, Q and uncompressed value over the coordinates
    # (hidden 32 x 10: (32 + 10) r; out 4 x 32: (4 + 32) r, compressed while 2 (4 + 32) r
    # < 128; biases 36 values), best: P and Q once per iteration (4)
    p1, p2 = _wire("powersgd", rank=1), _wire("powersgd", rank=2, approximator="best")
    assert p1.label == "powersgd:rank=1" and p2.label == "powersgd:rank=2,approximator=best"
    assert p1.bits_per_coord == pytest.approx(32 * (42 + 36 + 36) / 484)
    assert p2.bits_per_coord == pytest.approx(32 * (4 * 2 * 42 + 128 + 36) / 484)
    assert _wire("sketched").label.startswith("sketched:k=")
    assert _wire("efmomentum", compressor="sign").bits_per_coord == 1.0


def test_the_loop_uses_the_contract_only():
    """The training loop calls the hooks the base class declares: no probing of
    algorithms, no guessing of Config fields, no reading of an algorithm's State."""
    import inspect

    from gossip import loop

    src = inspect.getsource(loop)
    assert "hasattr(" not in src and "isinstance(self.algo" not in src
    assert "dataclasses.fields" not in src and "state.phase" not in src
    assert "shapes" not in src and "offsets" not in src
    for hook in ("set_event_sink", "on_epoch_end", "report", "wire_format"):
        assert callable(getattr(algorithms.Algorithm, hook))
