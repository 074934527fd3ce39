"""MuLoCo (Thérien et al. 2025, arXiv:2505.23725): DiLoCo over inner Muon steps with
error-fed compressed pseudo-gradients; against a transcription, its bytes, its refusal."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gossip import algorithms, comm, compress
from gossip.algorithms.muloco import MuonAdamW, muon_optimizer, newton_schulz
from gossip.runtime import GossipOptimizer
from tests.test_localsgd import CLASSES, FEATURES, Net

N, H, STEPS, LR = 3, 4, 9, 0.01


def _models():
    out = []
    for _ in range(N):
        torch.manual_seed(0)
        out.append(Net())
    return out


def _batches(gen, models):
    for m in models:
        x = torch.randn(16, FEATURES, generator=gen)
        y = torch.randint(0, CLASSES, (16,), generator=gen)
        F.cross_entropy(m(x), y).backward()


def _run(precision="auto", **opts):
    c = comm.SimulatedCommunicator(None, world_size=N)
    models = _models()
    opt = GossipOptimizer(models, [muon_optimizer(m, lr=LR, precision=precision) for m in models],
                          algorithms.build("muloco", c, **opts))
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        opt.zero_grad()
        _batches(gen, models)
        opt.step()
    return opt.flat.data.clone(), c.ledger.as_dict(), opt


def test_update_equals_diloco_over_muon_transcribed():
    """Inner: torch.optim.Muon on the weights (lr matched to AdamW's RMS), AdamW on the
    biases; outer, every H steps: Delta = theta - mean_i x_i, b = mu b + Delta,
    theta = theta - lr_out (Delta + mu b), every node restarts from theta."""
    X, _, _ = _run("bfloat16", compressor="identity", error_feedback=False, local_steps=H, outer_lr=0.7,
                   outer_momentum=0.9)
    models = _models()
    opts = []
    for m in models:
        mats = [p for p in m.parameters() if p.dim() == 2]
        rest = [p for p in m.parameters() if p.dim() != 2]
        opts.append((torch.optim.Muon(mats, lr=LR, weight_decay=0.0, adjust_lr_fn="match_rms_adamw"),
                     torch.optim.AdamW(rest, lr=LR, weight_decay=0.0)))
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()])  # noqa: E731
    theta, b = flat(models[0]).clone(), torch.zeros_like(flat(models[0]))
    gen = torch.Generator().manual_seed(1)
    for t in range(1, STEPS + 1):
        for m in models:
            m.zero_grad()
        _batches(gen, models)
        for mu, aw in opts:
            mu.step()
            aw.step()
        if t % H == 0:
            delta = torch.stack([theta - flat(m) for m in models]).mean(0)
            b = 0.9 * b + delta
            theta = theta - 0.7 * (delta + 0.9 * b)
            with torch.no_grad():
                for m in models:
                    torch.nn.utils.vector_to_parameters(theta.clone(), m.parameters())
    R = torch.stack([flat(m) for m in models])
    assert torch.allclose(X, R, rtol=0, atol=1e-6), (X - R).abs().max()


def test_defaults_are_4_bit_error_fed_and_bytes_match_a_hand_count():
    X, ledger, opt = _run(local_steps=H)
    alg = opt.algorithm
    assert alg.config.compressor == "quant:bits=4" and alg.config.error_feedback
    assert algorithms.local_optimizer_default("muloco") == "muon"
    d = opt.flat.dim
    rounds = STEPS // H
    assert ledger["bytes"]["sent"] == rounds * N * (N - 1) * compress.build("quant:bits=4").payload_nbytes(d)
    assert alg.wire_format().label == "quant:bits=4"


def test_muon_on_a_model_without_matrices_is_one_line():
    with pytest.raises(ValueError, match=r"muon: the model has no 2-D parameter \(shapes \[\(3,\)\]\).*adamw"):
        MuonAdamW([torch.nn.Parameter(torch.zeros(3))])


def test_muon_state_round_trips():
    _, _, opt = _run(local_steps=H)
    o = opt.optimizers[0]
    sd = o.state_dict()
    fresh = muon_optimizer(Net(), lr=LR)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.state_dict()["muon"]["state"][0]["momentum_buffer"], sd["muon"]["state"][0]["momentum_buffer"])
    assert sd["ns_dtype"] == "float32" and fresh.ns_dtype == torch.float32  # auto on a CPU
    with pytest.raises(ValueError, match="keys 'muon' and 'adamw'"):
        fresh.load_state_dict({"state": {}})
    # a state saved before the dtype was recorded was made by torch.optim.Muon in bfloat16
    old = {k: v for k, v in sd.items() if k != "ns_dtype"}
    fresh.load_state_dict(old)
    assert fresh.ns_dtype == torch.bfloat16


def _twin_steps(precision_a, precision_b, steps=3, own_step_b=False):
    torch.manual_seed(0)
    a = Net()
    b = Net()
    b.load_state_dict(a.state_dict())
    oa, ob = muon_optimizer(a, lr=LR, precision=precision_a), muon_optimizer(b, lr=LR, precision=precision_b)
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(16, FEATURES, generator=gen)
        y = torch.randint(0, CLASSES, (16,), generator=gen)
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
        oa.step()
        if own_step_b:
            ob._muon_step()
            ob.adamw.step()
        else:
            ob.step()
    return a, b


def test_the_float32_step_is_torch_muons_arithmetic_in_another_dtype():
    """The float32 path is its own transcription of torch.optim.Muon's step: run at
    bfloat16 it gives torch's numbers bit for bit; at float32 it stays close to them and
    is not them (the iterations really run in float32)."""
    a, b = _twin_steps("bfloat16", "bfloat16", own_step_b=True)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    a, b = _twin_steps("bfloat16", "float32")
    with torch.no_grad():
        diffs = [float((pa - pb).abs().max()) for pa, pb in zip(a.parameters(), b.parameters()) if pa.dim() == 2]
    # three steps of about 0.2 * sqrt(max(A, B)) * LR RMS each; bfloat16's 1-2 % error per update
    assert 0 < max(diffs) < LR


def test_newton_schulz_orthogonalises_each_matrix_of_a_stack_on_its_own():
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(5, 12, 7, generator=gen, dtype=torch.float64)
    coeffs = (3.4445, -4.7750, 2.0315)
    stacked = newton_schulz(g, coeffs, 5, 1e-7, torch.float64)
    for i in range(5):
        assert torch.allclose(stacked[i], newton_schulz(g[i], coeffs, 5, 1e-7, torch.float64), atol=1e-12)
    # Muon's iteration brings the singular values near 1 (into about [0.7, 1.2]), not to 1 exactly
    sv = torch.linalg.svdvals(stacked)
    assert sv.min() > 0.5 and sv.max() < 1.5, sv
    # float32 computes the iteration to about 1e-6 of float64; bfloat16 (torch's) to about 1e-2
    err = {dt: float((newton_schulz(g.float(), coeffs, 5, 1e-7, dt).double() - stacked).norm() / stacked.norm())
           for dt in (torch.float32, torch.bfloat16)}
    assert err[torch.float32] < 1e-5 and err[torch.bfloat16] > 1e-3, err
    assert newton_schulz(g, coeffs, 5, 1e-7, torch.float32).dtype == torch.float32


def test_the_cli_offers_the_precisions_the_optimizer_takes():
    from gossip.train import config
    from gossip.algorithms.muloco import MUON_PRECISIONS

    assert config.MUON_PRECISIONS == MUON_PRECISIONS  # config keeps its own copy, to import without torch


def test_an_unknown_precision_is_one_line():
    with pytest.raises(ValueError, match=r"muon: precision must be one of auto, bfloat16, float32, float64, got 'fp8'"):
        muon_optimizer(Net(), precision="fp8")
