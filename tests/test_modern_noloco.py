"""NoLoCo (Kolehmainen et al. 2025, arXiv:2506.10911) against a transcription of its
outer step on random pairs, its reduction to DiLoCo on an exact average, its bytes."""

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
    with pytest.raises(ValueError, match=r"noloco: .*unexpected keyword.*compressor.*accepted options"):
        algorithms.build("noloco", c, compressor="quant:bits=4")
