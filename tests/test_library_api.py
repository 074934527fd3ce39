"""The library API as a newcomer calls it: their own model, ``torch.optim.SGD`` with
momentum 0.9, ``GossipOptimizer``, every registered algorithm.

Each algorithm either refuses the local momentum at construction, in one line naming
both momenta and what to do, or trains a small non-iid classifier on 8 nodes to
within 2 accuracy points of ``allreduce``. An algorithm that refuses also trains to
that accuracy once given a local optimizer without momentum. The problem is hard enough
for the refusal to matter: with the check switched off, the compounded momentum costs
PowerSGD, efblocksgdm, efmomentum and truetopk 5 to 45 points. ``-s`` prints the table.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import topologies
from gossip import algorithms, comm
from gossip.runtime import GossipOptimizer, MomentumConflict

NODES, CLASSES, FEATURES, STEPS, BATCH = 8, 4, 10, 150, 16
#: majority-vote signs move every coordinate by the full lr
LR = {"signsgd": 0.01, "signum": 0.01}
#: Sketched-SGD's default k (1% of ~450 coordinates: 4 per step) is too few for 150 steps
#: of this tiny model, whatever the momentum
OPTIONS = {"sketched": {"p": 0.05}}
#: points below allreduce an algorithm may end, where 2 is not its due: SparseLoCo's
#: default aggregation (its authors' code: each coordinate averaged over the workers that
#: sent it) moves a coordinate that one of the 8 non-iid workers sent by that worker's
#: full value; at 1/64 density that costs about 4 points here (docs/modern.md)
MARGIN = {"sparseloco": 0.05}
#: name -> (local momentum used, accuracy), printed at the end of the module
RESULTS: dict[str, tuple[str, float]] = {}


class Net(nn.Module):
    """The user's own model."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(FEATURES, 32)
        self.out = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread, whatever OMP_NUM_THREADS says (more threads
    only spin on tensors this small and contend with the other test workers for the
    cores; the accuracies are the same on any thread count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CENTRES = 1.2 * torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(0))


def blobs(n: int, classes: list[int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.tensor(classes)[torch.randint(0, len(classes), (n,), generator=gen)]
    return CENTRES[y] + torch.randn(n, FEATURES, generator=gen), y


def node_classes(node: int) -> list[int]:
    """Non-iid: nodes 0-3 see two of the four classes, nodes 4-7 one."""
    return [node % CLASSES, (node + 1) % CLASSES] if node < 4 else [node % CLASSES]


def train(name: str, momentum: float) -> float:
    """Accuracy of the nodes' averaged model after STEPS steps."""
    torch.manual_seed(0)
    c = comm.SimulatedCommunicator(topologies.build("ring", NODES))
    models = []
    for _ in range(NODES):
        torch.manual_seed(1)  # one x_1 on every node
        models.append(Net())
    opts = [torch.optim.SGD(m.parameters(), lr=LR.get(name, 0.05), momentum=momentum) for m in models]
    opt = GossipOptimizer(models, opts, algorithms.build(name, c, **OPTIONS.get(name, {})))
    gens = [torch.Generator().manual_seed(100 + i) for i in range(NODES)]
    for _ in range(STEPS):
        opt.zero_grad()
        for i, (m, g) in enumerate(zip(models, gens)):
            x, y = blobs(BATCH, node_classes(i), g)
            F.cross_entropy(m(x), y).backward()
        opt.step()
    avg = Net()
    torch.nn.utils.vector_to_parameters(opt.average(), avg.parameters())
    x, y = blobs(2000, list(range(CLASSES)), torch.Generator().manual_seed(7))
    with torch.no_grad():
        return float((avg(x).argmax(1) == y).float().mean())


@pytest.fixture(scope="module")
def reference():
    acc = train("allreduce", 0.9)
    assert acc > 0.9, f"allreduce itself only reaches {acc:.3f}: the problem is too hard to compare on"
    yield acc
    if RESULTS:
        print(f"\n{'algorithm':<12} {'local momentum':<16} accuracy (allreduce {acc:.3f})")
        for name, (mom, a) in RESULTS.items():
            print(f"{name:<12} {mom:<16} {a:.3f}")


@pytest.mark.parametrize("name", list(algorithms.available()))
def test_every_algorithm_with_the_users_sgd_momentum(name, reference):
    try:
        acc, used = train(name, 0.9), "0.9"
    except MomentumConflict as e:
        msg = str(e)
        assert "\n" not in msg and name in msg and "momentum 0.9" in msg and "momentum=0" in msg, msg
        acc, used = train(name, 0.0), "0 (0.9 refused)"  # what the message says to do
    RESULTS[name] = (used, acc)
    assert acc >= reference - MARGIN.get(name, 0.02), f"{name}: accuracy {acc:.3f}, allreduce {reference:.3f}"


def test_the_problem_tells_compounded_momentum_apart(reference, monkeypatch):
    """Without the refusal, the momenta compound and these end far below allreduce:
    the silent failure the refusal prevents (and that this problem can see)."""
    import gossip.runtime

    monkeypatch.setattr(gossip.runtime, "check_momentum", lambda name, momentum, optimizers: None)
    for name in ("powersgd", "efblocksgdm", "efmomentum"):
        acc = train(name, 0.9)
        assert acc < reference - 0.02, f"{name} with compounded momentum: {acc:.3f}, allreduce {reference:.3f}"


def test_the_algorithms_that_own_momentum_say_so():
    c = comm.SimulatedCommunicator(topologies.build("ring", NODES))
    owners = {n for n in algorithms.available() if algorithms.build(n, c).owns_momentum}
    assert {"powersgd", "efblocksgdm", "signum", "efmomentum"} <= owners
    assert not owners & {"allreduce", "dpsgd", "naive", "dcd", "ecd", "signsgd", "efblocksgd", "efsgd"}
    assert algorithms.build("efsgd", c, momentum=0.5).owns_momentum
    # the same fact from the Config alone, before anything is built (gossip.ddp's check)
    for n in algorithms.available():
        cls = algorithms.algorithm_class(n)
        assert (cls.momentum_of(algorithms.make_config(n)) > 0) == (n in owners), n


def test_no_config_takes_shapes_or_offsets():
    for name in algorithms.available():
        fields = set(algorithms.config_class(name).__dataclass_fields__)
        assert not fields & {"shapes", "offsets"}, name


def _wire(name: str, **opts) -> algorithms.WireFormat:
    c = comm.SimulatedCommunicator(topologies.build("ring", NODES))
    models = [Net() for _ in range(NODES)]
    opt = GossipOptimizer(models, [torch.optim.SGD(m.parameters(), lr=0.1) for m in models],
                          algorithms.build(name, c, **opts))
    return opt.algorithm.wire_format()


@pytest.mark.parametrize("name, opts, label, bits", [
    ("efblocksgd", {}, "blocksign", 1.0),
    ("efblocksgdm", {}, "blocksign", 1.0),
    ("signsgd", {}, "sign", 1.0),
    ("signum", {}, "sign", 1.0),
    ("ecd", {"compressor": "quant:bits=8"}, "quant:bits=8", 8.0),
    ("dcd", {"compressor": "quant:bits=4"}, "quant:bits=4", 4.0),
    ("dpsgd", {}, "fp32", 32.0),
    ("allreduce", {}, "fp32", 32.0),
    ("efsgd", {"merge": "layer"}, "sign", 1.0),
])
def test_algorithms_describe_what_they_send(name, opts, label, bits):
    w = _wire(name, **opts)
    assert (w.label, w.bits_per_coord) == (label, bits)


def test_powersgd_describes_its_rank_and_its_bits():
    w = _wire("powersgd", rank=2)
    assert w.label == "powersgd:rank=2"
    # rank-2 factors P (32x2), Q (10x2) of the 32x10 weight; the 4x32 weight does not pay
    # ((4 + 32) 2 x 2 >= 4 x 32) and travels whole, as do the 32 + 4 biases
    d = 10 * 32 + 32 + 32 * 4 + 4
    sent = 2 * (32 + 10) + 4 * 32 + 32 + 4
    assert w.bits_per_coord == pytest.approx(32 * sent / d, abs=1e-3)


def test_the_layout_reaches_the_algorithm():
    c = comm.SimulatedCommunicator(world_size=2)
    models = [Net(), Net()]
    opt = GossipOptimizer(models, [torch.optim.SGD(m.parameters(), lr=0.1) for m in models],
                          algorithms.build("efblocksgd", c))
    assert opt.layout.names == ("hidden.weight", "hidden.bias", "out.weight", "out.bias")
    assert opt.layout.offsets == (0, 320, 352, 480)
    assert opt.algorithm.layout is opt.layout
    assert opt.algorithm.compressor.spec == "blocksign:offsets=0/320/352/480"  # one block per tensor


def test_a_scheduler_reaches_the_algorithms_step_size():
    c = comm.SimulatedCommunicator(world_size=2)
    models = [Net(), Net()]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    opt = GossipOptimizer(models, opts, algorithms.build("efsgd", c))
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in opts]
    for step in range(3):
        opt.zero_grad()
        for m in models:
            m(torch.randn(4, FEATURES)).sum().backward()
        opt.step()
        assert opt.algorithm.state.prev_lr == pytest.approx(0.1 * 0.5 ** step)
        for s in scheds:
            s.step()


def test_common_options_go_where_a_config_takes_them():
    c = comm.SimulatedCommunicator(topologies.build("ring", NODES))
    common = {"seed": 3, "compressor": "quant:bits=4", "momentum": 0.5}
    assert algorithms.build("dcd", c, common=common).config.compressor == "quant:bits=4"
    assert algorithms.build("powersgd", c, common=common).config.momentum == 0.5
    assert algorithms.build("allreduce", c, common=common).config.seed == 3
    # None values are left out, the algorithm's own options win
    assert algorithms.build("dcd", c, common={"compressor": None}).config.compressor == "quant:bits=8"
    assert algorithms.build("powersgd", c, common=common, momentum=0.8).config.momentum == 0.8
    with pytest.raises(ValueError, match=r"`common` holds only seed, compressor, momentum, got rank"):
        algorithms.build("powersgd", c, common={"rank": 2})
    with pytest.raises(ValueError, match=r"dpsgd: .*unexpected keyword argument 'compressor'"):
        algorithms.build("dpsgd", c, compressor="quant:bits=4")  # options are never dropped


def test_every_hook_is_declared_and_called_without_probing():
    calls = []

    class Counting(algorithms.AllReduce):
        def on_step_end(self, step):
            calls.append(step)

    c = comm.SimulatedCommunicator(world_size=1)
    m = Net()
    opt = GossipOptimizer(m, torch.optim.SGD(m.parameters(), lr=0.1), Counting(algorithms.AllReduceConfig(), c))
    for _ in range(3):
        opt.zero_grad()
        m(torch.randn(4, FEATURES)).sum().backward()
        opt.step()
    assert calls == [1, 2, 3] and opt.state_dict()["steps"] == 3
    a = algorithms.build("allreduce", c)  # the defaults: nothing happens, nothing fails
    a.set_lr(0.1), a.on_step_end(1), a.on_epoch_end(1), a.attach([m]), a.set_event_sink(print)
    assert a.report() is None


def test_the_loop_uses_the_contract_only():
    """The training loop and its components call the hooks the base class declares: no
    probing of algorithms, no reading of Config fields, no reading of an algorithm's State."""
    import inspect

    from gossip.train import agreement, assembly, checkpoint, evaluation, loop, metrics

    for module in (loop, assembly, agreement, checkpoint, metrics, evaluation):
        src = inspect.getsource(module)
        assert "hasattr(" not in src and "isinstance(self.algo" not in src, module.__name__
        assert "dataclasses.fields" not in src and "state.phase" not in src, module.__name__
        assert "shapes" not in src and "offsets" not in src, module.__name__


def test_the_layout_is_validated_and_recorded():
    from gossip.algorithms import ParamLayout

    lay = ParamLayout.from_models([Net(), Net()])
    assert lay == ParamLayout.from_shapes(lay.shapes, lay.names)
    assert lay.to_dict() == {"names": ["hidden.weight", "hidden.bias", "out.weight", "out.bias"],
                             "shapes": [[32, FEATURES], [32], [CLASSES, 32], [CLASSES]],
                             "offsets": [0, 320, 352, 480], "dim": 484}
    assert ParamLayout.from_shapes([(2, 3), (4,)]).names == ("p0", "p1")
    assert ParamLayout.whole(7).blocks == ((0, 7),)
    with pytest.raises(ValueError, match=r"ParamLayout: tensor names must be unique, \['a'\] repeat"):
        ParamLayout.from_shapes([(2,), (3,)], ["a", "a"])
    with pytest.raises(ValueError, match=r"ParamLayout: 1 names for 2 shapes"):
        ParamLayout.from_shapes([(2,), (3,)], ["a"])
    with pytest.raises(TypeError, match=r"ParamLayout: `shapes` must be a sequence of shapes"):
        ParamLayout.from_shapes([(2, 2.5)])
    with pytest.raises(ValueError, match=r"non-negative"):
        ParamLayout.from_shapes([(2, -1)])
    with pytest.raises(ValueError, match=r"model 1 has parameter shapes"):
        ParamLayout.from_models([Net(), nn.Linear(3, 3)])
    c = comm.SimulatedCommunicator(world_size=2)
    with pytest.raises(ValueError, match=r"powersgd: the layout's tensors hold 484 values, the flat parameters 7"):
        algorithms.build("powersgd", c).setup(torch.zeros(2, 7), lay)


class SlowSGD(torch.optim.SGD):
    """The user's optimizer, whose step takes a known time (as Muon's orthogonalisation
    does, several times a small model's backward)."""

    def step(self, closure=None):
        import time

        time.sleep(0.02)
        return super().step(closure)


@pytest.mark.parametrize("name", ["allreduce", "dpsgd"])
def test_the_local_optimizers_step_is_charged_to_compute(name):
    """The time split's compute is the node's computation: its forward and backward
    passes and its optimizer's step (the race's and the benchmark's time model reads it),
    for an algorithm on gradients and one on the parameters."""
    c = comm.SimulatedCommunicator(topologies.build("ring", 3))
    models = [Net() for _ in range(3)]
    opts = [SlowSGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    opt = GossipOptimizer(models, opts, algorithms.build(name, c))
    g = torch.Generator().manual_seed(0)
    steps = 3
    for _ in range(steps):
        opt.zero_grad()
        for i, m in enumerate(models):
            x, y = blobs(BATCH, node_classes(i), g)
            F.cross_entropy(m(x), y).backward()
        opt.step()
    times = c.ledger.times
    slept = 0.02 * 3 * steps  # three nodes' steps, three times
    assert times["compute"] >= slept
    # and not charged elsewhere: the exchange of three tiny models takes a fraction of
    # the sleeps, however loaded the machine, while charging the steps there would
    # put all of them in it
    assert times["compress"] + times["communicate"] < slept / 2
