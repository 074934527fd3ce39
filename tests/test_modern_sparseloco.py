"""SparseLoCo (Sarfi et al. 2025, arXiv:2508.15706) against a transcription of its
Algorithm 1, its reduction to DiLoCo, its bytes and its refusals."""

from __future__ import annotations

import pytest
import torch

from gossip import algorithms, comm
from gossip.algorithms.demo import smaller_split
from tests.test_localsgd import run

N, H, STEPS, CHUNK = 3, 4, 13, 4


def _topk_chunks(e: torch.Tensor, shape, frac: float):
    """Chunks of a tensor as (chunks, chunk numel): 2-D in (n1 x n2) tiles, 1-D in runs."""
    if len(shape) == 2:
        n1, n2 = smaller_split(shape[0], CHUNK), smaller_split(shape[1], CHUNK)
        t = e.reshape(shape[0] // n1, n1, shape[1] // n2, n2).permute(0, 2, 1, 3)
        return t.reshape(-1, n1 * n2), lambda c: c.reshape(shape[0] // n1, shape[1] // n2, n1, n2) \
            .permute(0, 2, 1, 3).reshape(-1)
    n1 = smaller_split(shape[0], CHUNK)
    return e.reshape(-1, n1), lambda c: c.reshape(-1)


def _compress(e: torch.Tensor, shapes, frac: float, bits: int) -> torch.Tensor:
    """Q(TopK(e)) per tensor and chunk, the result as a dense vector."""
    out, off = [], 0
    for shape in shapes:
        numel = int(torch.tensor(shape).prod())
        chunks, back = _topk_chunks(e[off:off + numel], shape, frac)
        k = max(1, round(frac * chunks.shape[1]))
        i = chunks.abs().topk(k, dim=1).indices
        v = chunks.gather(1, i)
        if bits < 32:  # 2^b evenly spaced levels on [-s, s], nearest
            L = 2 ** bits - 1
            s = v.abs().amax(1, keepdim=True)
            lev = torch.round((v / torch.where(s > 0, s, 1) + 1) * L / 2)
            v = (lev * 2 / L - 1) * s
        out.append(back(torch.zeros_like(chunks).scatter(1, i, v)))
        off += numel
    return torch.cat(out)


def _reference(frac: float, bits: int, beta: float, alpha: float):
    """Algorithm 1 written out, per worker, on the batches and inner AdamW of
    tests.test_localsgd.run (whose inner state is each worker's own, never reset)."""
    import torch.nn.functional as F
    from tests.test_localsgd import FEATURES, CLASSES, Net

    models = []
    for _ in range(N):
        torch.manual_seed(0)
        models.append(Net())
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in models]
    shapes = [tuple(p.shape) for p in models[0].parameters()]
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()])  # noqa: E731
    theta = flat(models[0]).clone()
    err = [torch.zeros_like(theta) for _ in range(N)]
    gen = torch.Generator().manual_seed(1)
    for t in range(1, STEPS + 1):
        for m, o in zip(models, opts):
            o.zero_grad()
        for m in models:
            x = torch.randn(16, FEATURES, generator=gen)
            y = torch.randint(0, CLASSES, (16,), generator=gen)
            F.cross_entropy(m(x), y).backward()
        for o in opts:
            o.step()
        if t % H:
            continue
        sent = []
        for r, m in enumerate(models):
            delta = theta - flat(m)                      # Delta_r = theta - theta_r
            err[r] = beta * err[r] + delta               # e_r <- beta e_r + Delta_r
            d_hat = _compress(err[r], shapes, frac, bits)  # Q(TopK(e_r))
            err[r] = err[r] - d_hat                      # e_r <- e_r - Dhat_r
            sent.append(d_hat)
        theta = theta - alpha * torch.stack(sent).mean(0)  # theta <- theta - alpha mean Dhat
        with torch.no_grad():
            for m in models:
                torch.nn.utils.vector_to_parameters(theta.clone(), m.parameters())
    return torch.stack([flat(m) for m in models])


@pytest.mark.parametrize("frac,bits,beta,alpha", [(0.25, 2, 0.95, 1.0), (0.5, 4, 0.5, 0.7), (1.0, 32, 0.9, 1.0)])
def test_update_equals_algorithm_1_transcribed(frac, bits, beta, alpha):
    X, _, _ = run("sparseloco", STEPS, nodes=N, adamw=True, local_steps=H, chunk=CHUNK, topk_fraction=frac,
                  bits=bits, ef_decay=beta, outer_lr=alpha)
    R = _reference(frac, bits, beta, alpha)
    assert torch.allclose(X, R, rtol=0, atol=2e-6), (X - R).abs().max()


def test_identity_compression_without_ef_is_diloco_without_outer_momentum():
    a, la, _ = run("sparseloco", 9, nodes=N, adamw=True, local_steps=H, topk_fraction=1.0, bits=32, ef_decay=0.0,
                   outer_lr=0.7)
    b, _, _ = run("diloco", 9, nodes=N, adamw=True, local_steps=H, outer_momentum=0.0, outer_lr=0.7)
    assert torch.equal(a, b)


def test_bytes_per_round_are_the_ledger_and_a_hand_count():
    _, ledger, opt = run("sparseloco", 8, nodes=N, adamw=True, local_steps=H, chunk=CHUNK, topk_fraction=0.25, bits=2)
    # Net: a.weight 8 x 6 (4 x 3 tiles: 4 chunks of 12, k=3), a.bias 8 (2 runs of 4, k=1),
    # b.weight 3 x 8 (3 x 4 tiles: 2 chunks of 12, k=3), b.bias 3 (1 run of 3, k=1)
    K, chunks = 4 * 3 + 2 * 1 + 2 * 3 + 1, 4 + 2 + 2 + 1
    off = 32 + 2 * K  # int16 indices
    off += (K * 2 + 7) // 8  # 2-bit codes, 4 per byte
    off = (off + 3) // 4 * 4 + 4 * chunks  # fp32 scales
    nbytes = (off + 7) // 8 * 8
    assert opt.algorithm.codec.K == K and opt.algorithm.codec.nbytes == nbytes
    assert ledger["ops"]["all_gather"]["sent"] == ledger["bytes"]["sent"] == 2 * N * (N - 1) * nbytes


@pytest.mark.parametrize("opts,match", [
    ({"topk_fraction": 0.0}, r"Arg `topk_fraction` must be in \(0, 1\], got 0.0"),
    ({"topk_fraction": 1.5}, r"Arg `topk_fraction` must be in \(0, 1\], got 1.5"),
    ({"bits": 3}, r"Arg `bits` must be one of 1, 2, 4, 8, 32"),
    ({"ef_decay": -0.1}, r"Arg `ef_decay` must be in \[0, 1\]"),
    ({"outer_momentum": 0.9}, r"sparseloco: .*outer_momentum.*accepted options"),
])
def test_bad_options_are_one_line(opts, match):
    with pytest.raises((ValueError, TypeError), match=match):
        algorithms.build("sparseloco", comm.SimulatedCommunicator(None, world_size=2), **opts)
