"""SparseLoCo (Sarfi et al. 2025, arXiv:2508.15706) against a transcription of its
Algorithm 1 with the authors' code's quantizer and aggregation, its reduction to
DiLoCo, its bytes, its refusals and its checkpoints of the earlier rule."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from gossip import algorithms, comm
from gossip.algorithms.demo import smaller_split
from tests.test_localsgd import run

N, H, STEPS, CHUNK = 3, 4, 13, 4


def _topk_chunks(e: torch.Tensor, shape):
    """Chunks of a tensor as (chunks, chunk numel): 2-D in (n1 x n2) tiles, 1-D in runs."""
    if len(shape) == 2:
        n1, n2 = smaller_split(shape[0], CHUNK), smaller_split(shape[1], CHUNK)
        t = e.reshape(shape[0] // n1, n1, shape[1] // n2, n2).permute(0, 2, 1, 3)
        return t.reshape(-1, n1 * n2), lambda c: c.reshape(shape[0] // n1, shape[1] // n2, n1, n2) \
            .permute(0, 2, 1, 3).reshape(-1)
    n1 = smaller_split(shape[0], CHUNK)
    return e.reshape(-1, n1), lambda c: c.reshape(-1)


def _statistical(v: torch.Tensor, bits: int, rng: float = 6.0) -> torch.Tensor:
    """The authors' quantizer on one tensor's kept values, decoded: 2^b bins of width
    rng sigma / 2^b around the mean, each bin decoded as the mean of what fell in it."""
    bins = 2 ** bits
    mu = v.mean()
    c = v - mu
    sigma = c.norm() / math.sqrt(c.numel() - 1) if c.numel() > 1 else torch.tensor(0.0)
    s = rng * sigma / bins
    if s == 0 or not torch.isfinite(s):
        s = torch.tensor(1.0)
    code = (c / s + bins // 2).round().clamp(0, bins - 1)
    out = torch.empty_like(v)
    for b in range(bins):
        inside = code == b
        if inside.any():
            out[inside] = c[inside].mean() + mu
    return out


def _uniform(v: torch.Tensor, bits: int) -> torch.Tensor:
    """The earlier rule, per chunk (rows of v): 2^b levels evenly spaced on [-s, s]."""
    L = 2 ** bits - 1
    s = v.abs().amax(1, keepdim=True)
    lev = torch.round((v / torch.where(s > 0, s, 1) + 1) * L / 2)
    return (lev * 2 / L - 1) * s


def _compress(e: torch.Tensor, shapes, frac: float, bits: int, quantizer: str):
    """Q(TopK(e)) per tensor and chunk as a dense vector, and the mask of what was sent."""
    out, sent, off = [], [], 0
    for shape in shapes:
        numel = math.prod(shape)
        chunks, back = _topk_chunks(e[off:off + numel], shape)
        k = max(1, round(frac * chunks.shape[1]))
        i = chunks.abs().topk(k, dim=1).indices
        v = chunks.gather(1, i)
        if bits < 32:
            v = _statistical(v.reshape(-1), bits).reshape(v.shape) if quantizer == "statistical" else _uniform(v, bits)
        out.append(back(torch.zeros_like(chunks).scatter(1, i, v)))
        sent.append(back(torch.zeros_like(chunks).scatter(1, i, 1.0)))
        off += numel
    return torch.cat(out), torch.cat(sent)


def _reference(frac: float, bits: int, beta: float, alpha: float, quantizer: str, aggregate: str):
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
        sent, who = [], []
        for r, m in enumerate(models):
            delta = theta - flat(m)                      # Delta_r = theta - theta_r
            err[r] = beta * err[r] + delta               # e_r <- beta e_r + Delta_r
            d_hat, mask = _compress(err[r], shapes, frac, bits, quantizer)  # Q(TopK(e_r))
            err[r] = err[r] - d_hat                      # e_r <- e_r - Dhat_r
            sent.append(d_hat)
            who.append(mask)
        if aggregate == "senders":  # the authors' code: each coordinate over the workers that sent it
            total = torch.stack(sent).sum(0)
            count = torch.stack(who).sum(0)
            mean = torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))
        else:  # the paper's equation: over all R workers
            mean = torch.stack(sent).mean(0)
        theta = theta - alpha * mean                    # theta <- theta - alpha Delta
        with torch.no_grad():
            for m in models:
                torch.nn.utils.vector_to_parameters(theta.clone(), m.parameters())
    return torch.stack([flat(m) for m in models])


@pytest.mark.parametrize("frac,bits,beta,alpha,quantizer,aggregate", [
    (0.25, 2, 0.95, 1.0, "statistical", "senders"),   # the defaults' rule
    (0.5, 4, 0.5, 0.7, "statistical", "senders"),
    (1.0, 32, 0.9, 1.0, "statistical", "senders"),
    (0.25, 1, 0.9, 0.8, "statistical", "workers"),    # the paper's mean over all workers
    (0.25, 2, 0.95, 1.0, "uniform", "workers"),       # the earlier rule
])
def test_update_equals_algorithm_1_transcribed(frac, bits, beta, alpha, quantizer, aggregate):
    X, _, _ = run("sparseloco", STEPS, nodes=N, adamw=True, local_steps=H, chunk=CHUNK, topk_fraction=frac,
                  bits=bits, ef_decay=beta, outer_lr=alpha, quantizer=quantizer, aggregate=aggregate)
    R = _reference(frac, bits, beta, alpha, quantizer, aggregate)
    assert torch.allclose(X, R, rtol=0, atol=2e-6), (X - R).abs().max()


def test_the_two_aggregations_differ_where_supports_differ():
    a, _, _ = run("sparseloco", 8, nodes=N, adamw=True, local_steps=H, chunk=CHUNK, topk_fraction=0.25)
    b, _, _ = run("sparseloco", 8, nodes=N, adamw=True, local_steps=H, chunk=CHUNK, topk_fraction=0.25,
                  aggregate="workers")
    # a coordinate sent by one worker of three moves by its whole value, not a third of it
    assert (a - b).abs().max() > 1e-3


def test_identity_compression_without_ef_is_diloco_without_outer_momentum():
    a, la, _ = run("sparseloco", 9, nodes=N, adamw=True, local_steps=H, topk_fraction=1.0, bits=32, ef_decay=0.0,
                   outer_lr=0.7)
    b, _, _ = run("diloco", 9, nodes=N, adamw=True, local_steps=H, outer_momentum=0.0, outer_lr=0.7)
    assert torch.equal(a, b)


@pytest.mark.parametrize("quantizer", ["statistical", "uniform"])
def test_bytes_per_round_are_the_ledger_and_a_hand_count(quantizer):
    _, ledger, opt = run("sparseloco", 8, nodes=N, adamw=True, local_steps=H, chunk=CHUNK, topk_fraction=0.25, bits=2,
                         quantizer=quantizer)
    # Net: a.weight 8 x 6 (4 x 3 tiles: 4 chunks of 12, k=3), a.bias 8 (2 runs of 4, k=1),
    # b.weight 3 x 8 (3 x 4 tiles: 2 chunks of 12, k=3), b.bias 3 (1 run of 3, k=1)
    K, chunks, tensors = 4 * 3 + 2 * 1 + 2 * 3 + 1, 4 + 2 + 2 + 1, 4
    off = 32 + 2 * K  # int16 indices
    off += (K * 2 + 7) // 8  # 2-bit codes, 4 per byte
    # fp32: per tensor the mean and 4 bin means (statistical), per chunk a scale (uniform)
    off = (off + 3) // 4 * 4 + 4 * (tensors * (1 + 4) if quantizer == "statistical" else chunks)
    nbytes = (off + 7) // 8 * 8
    assert opt.algorithm.codec.K == K and opt.algorithm.codec.nbytes == nbytes
    assert ledger["ops"]["all_gather"]["sent"] == ledger["bytes"]["sent"] == 2 * N * (N - 1) * nbytes


def test_a_checkpoint_of_the_earlier_rule():
    """A state saved before the rule was recorded (uniform quantizer, mean over all
    workers) is refused in one line under the defaults and continues under its rule;
    a state of one rule is refused under another."""
    _, _, opt = run("sparseloco", 2, nodes=N, adamw=True, local_steps=H, chunk=CHUNK)
    old = {k: v for k, v in opt.algorithm.state_dict().items() if k not in ("quantizer", "aggregate")}
    with pytest.raises(ValueError, match=r"^sparseloco: this checkpoint was written before SparseLoCo followed the "
                                         r"authors' code; this run asks for quantizer='statistical', "
                                         r"aggregate='senders': resume it with quantizer='uniform' and "
                                         r"aggregate='workers', or start the run again$"):
        opt.algorithm.load_state_dict(old)
    _, _, earlier = run("sparseloco", 2, nodes=N, adamw=True, local_steps=H, chunk=CHUNK, quantizer="uniform",
                        aggregate="workers")
    earlier.algorithm.load_state_dict(old)
    assert earlier.algorithm.state.t == 2 and torch.equal(earlier.algorithm.state.error, old["error"])
    with pytest.raises(ValueError, match=r"^sparseloco: this checkpoint was written with quantizer='statistical', "
                                         r"aggregate='senders'; this run asks for quantizer='uniform'"):
        earlier.algorithm.load_state_dict(opt.algorithm.state_dict())


@pytest.mark.parametrize("opts,match", [
    ({"topk_fraction": 0.0}, r"Arg `topk_fraction` must be in \(0, 1\], got 0.0"),
    ({"topk_fraction": 1.5}, r"Arg `topk_fraction` must be in \(0, 1\], got 1.5"),
    ({"bits": 3}, r"Arg `bits` must be one of 1, 2, 4, 8, 32"),
    ({"ef_decay": -0.1}, r"Arg `ef_decay` must be in \[0, 1\]"),
    ({"outer_momentum": 0.9}, r"sparseloco: .*outer_momentum.*accepted options"),
    ({"quantizer": "lloyd"}, r"Arg `quantizer` must be one of statistical, uniform, got 'lloyd'"),
    ({"aggregate": "sum"}, r"Arg `aggregate` must be one of senders, workers, got 'sum'"),
    ({"quant_range": 0}, r"Arg `quant_range`"),
])
def test_bad_options_are_one_line(opts, match):
    with pytest.raises((ValueError, TypeError), match=match):
        algorithms.build("sparseloco", comm.SimulatedCommunicator(None, world_size=2), **opts)


def test_a_range_the_quantizer_does_not_use_warns():
    c = comm.SimulatedCommunicator(None, world_size=2)
    with pytest.warns(UserWarning, match=r"`quant_range` 4.0 has no effect with quantizer='uniform'"):
        algorithms.build("sparseloco", c, quantizer="uniform", quant_range=4.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        algorithms.build("sparseloco", c, quant_range=4.0)
