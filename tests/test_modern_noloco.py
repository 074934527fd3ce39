"""NoLoCo (Kolehmainen et al. 2025, arXiv:2506.10911) against its outer step worked by
hand on two nodes, a transcription of it on random pairs, its reduction to DiLoCo on an
exact average, its bytes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import topologies
from gossip import algorithms, comm
from gossip.runtime import GossipOptimizer
from tests.test_localsgd import CLASSES, FEATURES, Net

N, H, STEPS = 4, 3, 10


def _run(name: str, topo, steps: int = STEPS, **opts):
    c = comm.SimulatedCommunicator(topo, world_size=N)
    models = []
    for _ in range(N):
        torch.manual_seed(0)
        models.append(Net())
    opt = GossipOptimizer(models, [torch.optim.AdamW(m.parameters(), lr=0.1) for m in models],
                          algorithms.build(name, c, **opts))
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        for m in models:
            x = torch.randn(16, FEATURES, generator=gen)
            y = torch.randint(0, CLASSES, (16,), generator=gen)
            F.cross_entropy(m(x), y).backward()
        opt.step()
    return opt.flat.data.clone(), c.ledger.as_dict(), opt


def _reference(alpha: float, beta: float, gamma: float):
    """The outer step written out per node: at the end of round r node i pairs with
    p(i) of the matching drawn for step r - 1 and takes
    delta_i = alpha delta_i - beta (Delta_i + Delta_p)/2 - gamma (phi_i - (phi_i + phi_p)/2),
    phi_i += delta_i, then restarts its inner steps from phi_i."""
    models = []
    for _ in range(N):
        torch.manual_seed(0)
        models.append(Net())
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in models]
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()])  # noqa: E731
    phi = [flat(m).clone() for m in models]
    delta = [torch.zeros_like(phi[0]) for _ in models]
    graph = topologies.build("matching", N)
    gen = torch.Generator().manual_seed(1)
    for t in range(1, STEPS + 1):
        for o in opts:
            o.zero_grad()
        for m in models:
            x = torch.randn(16, FEATURES, generator=gen)
            y = torch.randint(0, CLASSES, (16,), generator=gen)
            F.cross_entropy(m(x), y).backward()
        for o in opts:
            o.step()
        if t % H:
            continue
        p = graph.partners(t // H - 1)
        pg = [phi[i] - flat(models[i]) for i in range(N)]
        new_phi = []
        for i in range(N):
            j = int(p[i])
            delta[i] = alpha * delta[i] - beta * (pg[i] + pg[j]) / 2 - gamma * (phi[i] - (phi[i] + phi[j]) / 2)
            new_phi.append(phi[i] + delta[i])
        phi = new_phi
        with torch.no_grad():
            for i, m in enumerate(models):
                torch.nn.utils.vector_to_parameters(phi[i].clone(), m.parameters())
    return torch.stack([flat(m) for m in models])


def _two_nodes(**opts):
    """NoLoCo on two nodes (the matching always pairs them), H = 1, started from phi^0."""
    c = comm.SimulatedCommunicator(topologies.build("matching", 2), world_size=2)
    algo = algorithms.build("noloco", c, local_steps=1, **opts)
    X = torch.tensor([[1.0, 2.0, 3.0], [5.0, 0.0, -1.0]], dtype=torch.float64)
    algo.setup(X)
    return algo, X


def test_one_outer_step_worked_by_hand():
    """alpha 0.5, beta 0.7, gamma left to its default (= beta, as the authors' code).
    Round 1, inner update U = x - phi:
      x_0 = (0.5, 2.25, 4), x_1 = (6, -1, -0.5)
      Delta_0 = phi_0 - x_0 = (0.5, -0.25, -1), Delta_1 = (-1, 1, -0.5), mean (-0.25, 0.375, -0.75)
      phi mean = (3, 1, 1); phi_0 - mean = (-2, 1, 2) = -(phi_1 - mean)
      delta_0 = -0.7 (-0.25, 0.375, -0.75) - 0.7 (-2, 1, 2) = (1.575, -0.9625, -0.875)
      delta_1 = (0.175, -0.2625, 0.525) - 0.7 (2, -1, -2) = (-1.225, 0.4375, 1.925)
      phi_0 = (2.575, 1.0375, 2.125), phi_1 = (3.775, 0.4375, 0.925)
    Round 2, no inner progress (Delta = 0): only the momentum and the pull act:
      phi mean = (3.175, 0.7375, 1.525); phi_0 - mean = (-0.6, 0.3, 0.6)
      delta_0 = 0.5 (1.575, -0.9625, -0.875) - 0.7 (-0.6, 0.3, 0.6) = (1.2075, -0.69125, -0.8575)
      delta_1 = 0.5 (-1.225, 0.4375, 1.925) - 0.7 (0.6, -0.3, -0.6) = (-1.0325, 0.42875, 1.3825)
      phi_0 = (3.7825, 0.34625, 1.2675), phi_1 = (2.7425, 0.86625, 2.3075)
    The peer's (phi, Delta) cross the wire in fp32: equal to 1e-6, not to float64's rounding."""
    algo, X = _two_nodes(outer_momentum=0.5, outer_lr=0.7)
    assert algo.config.gamma is None and algo.config.pull == 0.7
    algo.step(X, torch.tensor([[-0.5, 0.25, 1.0], [1.0, -1.0, 0.5]], dtype=torch.float64))
    want = torch.tensor([[2.575, 1.0375, 2.125], [3.775, 0.4375, 0.925]], dtype=torch.float64)
    assert torch.allclose(X, want, rtol=0, atol=1e-6), X
    assert torch.allclose(algo.state.momentum, torch.tensor([[1.575, -0.9625, -0.875], [-1.225, 0.4375, 1.925]],
                                                            dtype=torch.float64), rtol=0, atol=1e-6)
    algo.step(X, torch.zeros_like(X))
    want = torch.tensor([[3.7825, 0.34625, 1.2675], [2.7425, 0.86625, 2.3075]], dtype=torch.float64)
    assert torch.allclose(X, want, rtol=0, atol=1e-6), X
    assert torch.equal(algo.state.start, X)


def test_an_explicit_gamma_pulls_apart_from_beta():
    """gamma 0.2, beta 0.7, round 1 of the case above:
      delta_0 = (0.175, -0.2625, 0.525) - 0.2 (-2, 1, 2) = (0.575, -0.4625, 0.125)
      delta_1 = (0.175, -0.2625, 0.525) - 0.2 (2, -1, -2) = (-0.225, -0.0625, 0.925)"""
    algo, X = _two_nodes(outer_momentum=0.5, outer_lr=0.7, gamma=0.2)
    algo.step(X, torch.tensor([[-0.5, 0.25, 1.0], [1.0, -1.0, 0.5]], dtype=torch.float64))
    want = torch.tensor([[1.575, 1.5375, 3.125], [4.775, -0.0625, -0.075]], dtype=torch.float64)
    assert torch.allclose(X, want, rtol=0, atol=1e-6), X


@pytest.mark.parametrize("alpha,beta,gamma", [(0.5, 0.7, 0.5), (0.9, 1.0, 0.1)])
def test_update_equals_the_outer_step_transcribed(alpha, beta, gamma):
    X, _, _ = _run("noloco", topologies.build("matching", N), local_steps=H, outer_momentum=alpha,
                   outer_lr=beta, gamma=gamma)
    R = _reference(alpha, beta, gamma)
    assert torch.allclose(X, R, rtol=0, atol=1e-6), (X - R).abs().max()
    assert not torch.allclose(X[0], X[1])  # pairs drift apart: no global average


def test_exact_average_without_momentum_is_diloco_without_outer_momentum():
    a, _, _ = _run("noloco", topologies.build("complete", N), local_steps=H, outer_momentum=0.0, outer_lr=0.7,
                   gamma=0.5)
    b, _, _ = _run("diloco", None, local_steps=H, outer_momentum=0.0, outer_lr=0.7)
    assert torch.allclose(a, b, rtol=0, atol=1e-6)


def test_bytes_per_round_are_the_ledger_and_a_hand_count():
    _, ledger, opt = _run("noloco", topologies.build("matching", N), local_steps=H)
    d = opt.flat.dim
    rounds = STEPS // H
    payload = 32 + 4 * 2 * d  # header + (phi, Delta) in fp32, d = 83: already a multiple of 8
    assert ledger["ops"]["exchange"]["sent"] == rounds * N * payload
    assert algorithms.default_topology("noloco") == "matching"


def test_bad_options_are_one_line():
    c = comm.SimulatedCommunicator(topologies.build("matching", 2), world_size=2)
    with pytest.raises(ValueError, match=r"Arg `outer_momentum` must satisfy 0 <= outer_momentum < 1, got 1.0"):
        algorithms.build("noloco", c, outer_momentum=1.0)
    with pytest.raises(ValueError, match=r"Arg `gamma` must .*got -0.1"):
        algorithms.build("noloco", c, gamma=-0.1)
    with pytest.raises(ValueError, match=r"noloco: .*unexpected keyword.*compressor.*accepted options"):
        algorithms.build("noloco", c, compressor="quant:bits=4")


def test_a_checkpoint_from_before_gamma_was_recorded():
    """Its state has no ``gamma`` (it ran with the old default 0.5): refused in one line
    under the new default, taken where gamma is given."""
    algo, X = _two_nodes()
    old = {k: v for k, v in algo.state_dict().items() if k != "gamma"}
    with pytest.raises(ValueError, match=r"^noloco: this checkpoint was written when `gamma` defaulted to 0.5; "
                                         r"the default is now `outer_lr` \(0.7\)"):
        algo.load_state_dict(old)
    algo, X = _two_nodes(gamma=0.5)
    algo.load_state_dict(old)
    assert algo.state.gamma == 0.5
