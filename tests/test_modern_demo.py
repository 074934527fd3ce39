"""DeMo (Peng, Quesnelle, Kingma 2024, arXiv:2411.19870) against a transcription of its
reference optimizer, its bytes, its refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.fft
import torch
import torch.nn.functional as F
from torch import nn

from gossip import algorithms, comm
from gossip.algorithms.demo import smaller_split
from gossip.runtime import GossipOptimizer, MomentumConflict

N, STEPS, LR, WD = 3, 5, 0.05, 0.01


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 10)
        self.b = nn.Linear(10, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _batches(steps: int):
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(N)]
            for _ in range(steps)]


def _models():
    out = []
    for _ in range(N):
        torch.manual_seed(0)
        out.append(Net())
    return out


def _dct(n: int) -> torch.Tensor:
    # row j: the orthonormal DCT-II of e_j, as the reference's _dct(eye(n), norm="ortho"),
    # with the entries whose cosine is exactly 0 set to 0 (docs/modern.md: the reference's
    # rounding residue there makes sign() of a decoded exact zero a random +-1)
    B = scipy.fft.dct(np.eye(n), type=2, norm="ortho", axis=1)
    B[np.abs(B) < 1e-12] = 0.0
    return torch.from_numpy(B).float()


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _split(n: int, target: int) -> int:
    """The reference's _get_smaller_split, as written there."""
    divs = _divisors(n)
    for i, v in enumerate(divs):
        if v == target:
            return v
        if v > target:
            return v if i == 0 else divs[i - 1]
    return n


def _reference(batches, chunk: int, topk: int, decay: float):
    """The reference DeMo optimizer (per tensor, per worker), written out from its step():
    weight decay, delta = decay delta + lr g, chunked DCT, top-k per chunk, delta -= the
    decoded own top-k, all-gather, scatter_reduce mean, inverse DCT, sign, SGD step."""
    models = _models()
    params = [list(m.parameters()) for m in models]
    delta = [[torch.zeros_like(p) for p in ps] for ps in params]

    def enc(x):
        if x.dim() > 1:
            n1, n2 = _split(x.shape[0], chunk), _split(x.shape[1], chunk)
            y = x.reshape(x.shape[0] // n1, n1, x.shape[1] // n2, n2)
            y = torch.einsum("yhxw,hb,wd->yxbd", y, _dct(n1), _dct(n2))
            return y.reshape(y.shape[0], y.shape[1], n1 * n2), (n1, n2)
        n1 = _split(x.shape[0], chunk)
        return x.reshape(-1, n1) @ _dct(n1), (n1,)

    def dec(y, ns, shape):
        if len(ns) == 2:
            n1, n2 = ns
            y = y.reshape(y.shape[0], y.shape[1], n1, n2)
            y = torch.einsum("yxbd,hb,wd->yhxw", y, _dct(n1), _dct(n2))
            return y.reshape(shape)
        return (y @ _dct(ns[0]).T).reshape(shape)

    for step in batches:
        for m, (x, y) in zip(models, step):
            m.zero_grad()
            F.cross_entropy(m(x), y).backward()
        with torch.no_grad():
            for k in range(len(params[0])):
                idxs, vals = [], []
                for w in range(N):
                    p = params[w][k]
                    p.mul_(1 - LR * WD)
                    delta[w][k].mul_(decay).add_(p.grad, alpha=LR)
                    y, ns = enc(delta[w][k])
                    kk = max(1, min(topk, y.shape[-1]))
                    i = torch.topk(y.abs(), k=kk, dim=-1).indices
                    v = torch.gather(y, -1, i)
                    own = torch.zeros_like(y).scatter_reduce(-1, i, v, reduce="mean", include_self=False)
                    delta[w][k].sub_(dec(own, ns, p.shape))
                    idxs.append(i)
                    vals.append(v)
                agg = torch.zeros_like(y).scatter_reduce(-1, torch.cat(idxs, -1), torch.cat(vals, -1),
                                                          reduce="mean", include_self=False)
                new = torch.sign(dec(agg, ns, params[0][k].shape))
                for w in range(N):
                    params[w][k].sub_(LR * new)
    return torch.stack([torch.cat([p.detach().reshape(-1) for p in ps]) for ps in params])


def _ours(batches, **opts):
    c = comm.SimulatedCommunicator(None, world_size=N)
    models = _models()
    opt = GossipOptimizer(models, [torch.optim.SGD(m.parameters(), lr=LR, weight_decay=WD) for m in models],
                          algorithms.build("demo", c, **opts))
    for step in batches:
        opt.zero_grad()
        for m, (x, y) in zip(models, step):
            F.cross_entropy(m(x), y).backward()
        opt.step()
    return opt.flat.data.clone(), c, opt


@pytest.mark.parametrize("chunk,topk,decay", [(4, 3, 0.999), (64, 32, 0.9), (5, 1, 0.0)])
def test_update_equals_the_reference_code_transcribed(chunk, topk, decay):
    batches = _batches(STEPS)
    X, _, _ = _ours(batches, compression_chunk=chunk, compression_topk=topk, compression_decay=decay)
    R = _reference(batches, chunk, topk, decay)
    assert torch.allclose(X, R, rtol=0, atol=1e-6), (X - R).abs().max()
    assert not torch.allclose(X, _models_flat(), atol=1e-3)  # it moved
    assert torch.equal(X[0], X[1]) and torch.equal(X[0], X[2])  # every worker takes the same step


def _models_flat():
    m = _models()[0]
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).expand(N, -1)


def test_chunk_rule_is_the_reference_one():
    for n in (1, 3, 7, 10, 12, 64, 97, 100, 128, 4097):
        for t in (1, 4, 64):
            assert smaller_split(n, t) == _split(n, t), (n, t)


def test_bytes_per_step_are_the_ledger_and_a_hand_count():
    _, c, opt = _ours(_batches(3), compression_chunk=4, compression_topk=3)
    # a: 10 x 12 weight in 2 x 4 chunks (15 chunks of 8 values, top 3), bias 10 in chunks
    # of 2 (5 chunks, top 2); b: 3 x 10 in 3 x 2 chunks (5 chunks, top 3), bias 3 (1 chunk)
    K = 15 * 3 + 5 * 2 + 5 * 3 + 1 * 3
    assert opt.algorithm.codec.K == K
    body = 32 + 2 * K  # int16 indices after the header
    body = (body + 3) // 4 * 4 + 4 * K  # fp32 values, 4-byte aligned
    nbytes = (body + 7) // 8 * 8
    assert opt.algorithm.codec.nbytes == nbytes
    assert c.ledger.as_dict()["ops"]["all_gather"]["sent"] == 3 * N * (N - 1) * nbytes
    assert c.ledger.bytes_sent == 3 * N * (N - 1) * nbytes
    wf = opt.algorithm.wire_format()
    assert wf.label == "demo:chunk=4,topk=3" and wf.bits_per_coord == pytest.approx(8 * 6 * K / 163, abs=1e-3)


def test_user_sgd_with_momentum_is_refused_in_one_line():
    c = comm.SimulatedCommunicator(None, world_size=1)
    m = Net()
    with pytest.raises(MomentumConflict, match=r"demo applies its own momentum \(0.999\).*momentum 0.9"):
        GossipOptimizer(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), algorithms.build("demo", c))


@pytest.mark.parametrize("opts,match", [
    ({"compression_topk": 0}, r"compression_topk.*>= 1"),
    ({"compression_chunk": 0}, r"compression_chunk.*>= 1"),
    ({"compression_decay": 1.0}, r"0 <= compression_decay < 1, got 1.0"),
    ({"topk": 3}, r"demo: .*unexpected keyword.*topk.*accepted options: compression_decay"),
])
def test_bad_options_are_one_line(opts, match):
    c = comm.SimulatedCommunicator(None, world_size=2)
    with pytest.raises((ValueError, TypeError), match=match):
        algorithms.build("demo", c, **opts)


def test_damaged_payload_is_named():
    from gossip.errors import PayloadError

    _, _, opt = _ours(_batches(1))
    codec = opt.algorithm.codec
    idx, val = codec.encode(torch.randn(2, codec.dim))
    P = codec.pack(idx, val, tag=7)
    assert torch.equal(codec.unpack(P, 7)[1], val)
    P[1, 40] ^= 1
    with pytest.raises(PayloadError, match="row 1: checksum"):
        codec.unpack(P, 7)
    with pytest.raises(PayloadError, match="row 0: tag"):
        codec.unpack(codec.pack(idx, val, tag=7), 8)
