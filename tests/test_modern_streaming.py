"""Streaming DiLoCo's overlap (Douillard et al. 2025, arXiv:2501.18512; torchft's
fragment_sync_delay and fragment_update_alpha) and fragments chosen by module."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gossip import algorithms, comm
from gossip.runtime import GossipOptimizer
from tests.test_localsgd import CLASSES, FEATURES, Net, run

N = 3


def _reference(steps: int, H: int, tau: int, alpha: float, lr_out: float, mu: float, cuts):
    """torchft's streaming DiLoCo written out: fragment f (cut at ``cuts``) takes its
    pseudo-gradient theta_f - x_f at the step tau before its sync step o_f and averages
    it; at o_f: b_f = mu b_f + Delta, theta' = theta_f - lr_out (Delta + mu b_f),
    x_f = lerp(theta', x_f, alpha), theta_f = theta'."""
    models = []
    for _ in range(N):
        torch.manual_seed(0)
        models.append(Net())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()])  # noqa: E731
    X = torch.stack([flat(m) for m in models])
    theta, b = X[0].clone(), torch.zeros_like(X[0])
    Fn = len(cuts) - 1
    offs = [((f + 1) * H // Fn) % H for f in range(Fn)]
    sent = {}
    gen = torch.Generator().manual_seed(1)
    for t in range(1, steps + 1):
        for o in opts:
            o.zero_grad()
        for m in models:
            x = torch.randn(16, FEATURES, generator=gen)
            y = torch.randint(0, CLASSES, (16,), generator=gen)
            F.cross_entropy(m(x), y).backward()
        for o in opts:
            o.step()
        X = torch.stack([flat(m) for m in models])
        for f, o in enumerate(offs):
            s, e = cuts[f], cuts[f + 1]
            if t % H == (o - tau) % H:
                sent[f] = (theta[s:e] - X[:, s:e]).mean(0)
            if t % H == o and f in sent:
                delta = sent.pop(f)
                b[s:e] = mu * b[s:e] + delta
                new = theta[s:e] - lr_out * (delta + mu * b[s:e])
                X[:, s:e] = new + alpha * (X[:, s:e] - new)
                theta[s:e] = new
        with torch.no_grad():
            for i, m in enumerate(models):
                torch.nn.utils.vector_to_parameters(X[i].clone(), m.parameters())
    return X


@pytest.mark.parametrize("tau,alpha,modules", [(1, 0.0, ""), (2, 0.5, "b"), (0, 0.5, "")])
def test_update_equals_torchft_transcribed(tau, alpha, modules):
    H, steps = 8, 19
    opts = dict(local_steps=H, fragment_sync_delay=tau, fragment_update_alpha=alpha, outer_lr=0.7,
                outer_momentum=0.9)
    if modules:
        opts["fragment_modules"] = modules
    else:
        opts["fragments"] = 2
    X, _, o = run("diloco", steps, nodes=N, **opts)
    cuts = [0, *[b for _, b in o.algorithm.fragments]]
    R = _reference(steps, H, tau, alpha, 0.7, 0.9, cuts)
    assert torch.allclose(X, R, rtol=0, atol=1e-6), (X - R).abs().max()


def test_fragments_by_module_cut_at_the_named_module():
    _, _, o = run("diloco", 1, nodes=2, local_steps=4, fragment_modules="b")
    # Net: a.weight 8 x 6, a.bias 8 | b.weight 3 x 8, b.bias 3
    assert o.algorithm.fragments == [(0, 56), (56, 83)]
    assert o.algorithm.report()["fragments"][1]["sync_step_mod_h"] == 0


def test_overlap_sends_the_same_bytes():
    opts = dict(local_steps=4, fragments=2, compressor="quant:bits=4")
    _, a, _ = run("diloco", 12, nodes=N, **opts)
    _, b, _ = run("diloco", 12, nodes=N, fragment_sync_delay=1, **opts)
    # quant:bits=4 goes through the sharded exchange (its push and pull, one call each per sync)
    assert a["bytes"] == b["bytes"] and a["ops"]["shard_push"]["calls"] == b["ops"]["shard_push"]["calls"] == 6


def test_resume_with_an_exchange_in_flight_is_bit_identical():
    """At step 6 fragment 1's exchange (posted at step 6, applied at 8) is in flight: the
    state_dict settles it, and a fresh run restored from it continues exactly."""
    opts = dict(local_steps=8, fragments=2, fragment_sync_delay=2, fragment_update_alpha=0.3, error_feedback=True,
                compressor="quant:bits=4")
    full, _, _ = run("diloco", 12, adamw=True, lr=0.01, **opts)
    _, _, opt = run("diloco", 6, adamw=True, lr=0.01, **opts)
    sd = opt.state_dict()
    assert sd["algorithm"]["in_flight"] == (1,)
    _, _, fresh = run("diloco", 0, adamw=True, lr=0.01, **opts)
    fresh.load_state_dict(sd)
    gen = torch.Generator().manual_seed(1)
    for _ in range(6 * 4):
        torch.randn(16, FEATURES, generator=gen), torch.randint(0, CLASSES, (16,), generator=gen)
    for _ in range(6):
        fresh.zero_grad()
        for m in fresh.models:
            x = torch.randn(16, FEATURES, generator=gen)
            y = torch.randint(0, CLASSES, (16,), generator=gen)
            F.cross_entropy(m(x), y).backward()
        fresh.step()
    assert torch.equal(fresh.flat.data, full)


@pytest.mark.parametrize("opts,match", [
    ({"local_steps": 8, "fragments": 2, "fragment_sync_delay": 4},
     r"Arg `fragment_sync_delay` \(tau\) must be below the fragment period local_steps // fragments = 8 // 2 = 4, got 4"),
    ({"fragment_update_alpha": 1.5}, r"Arg `fragment_update_alpha` \(alpha\) must be in \[0, 1\], got 1.5"),
    ({"fragment_modules": "b", "fragments": 3}, r"Arg `fragments` \(3\) disagrees with the 2 fragments"),
    ({"fragment_sync_dela": 1}, r"diloco: .*unexpected keyword.*fragment_sync_dela.*accepted options"),
])
def test_bad_options_are_one_line(opts, match):
    with pytest.raises((ValueError, TypeError), match=match):
        algorithms.build("diloco", comm.SimulatedCommunicator(world_size=2), **opts)


def test_unknown_module_is_one_line():
    c = comm.SimulatedCommunicator(world_size=1)
    m = Net()
    with pytest.raises(ValueError, match=r"`fragment_modules` names 'head', which is no module of the model"):
        GossipOptimizer(m, torch.optim.SGD(m.parameters(), lr=0.1),
                        algorithms.build("diloco", c, local_steps=4, fragment_modules="head"))
