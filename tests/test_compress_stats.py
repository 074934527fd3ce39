"""Statistics of the compressors: unbiasedness, variance against theory, biased bounds.

Monte Carlo uses the batched API: one input repeated over many rows, each row with
its own key, so every row is an independent draw. Tolerances are a few standard
errors computed from the compressor's exact per-coordinate variance; seeds are fixed.
"""

import math

import pytest
import torch

import gossip.compress as gc
from gossip.compress import _kernels, _random as R

DRAWS = 4000
Z = 5.5  # standard errors allowed (max over ~64 coordinates per case)


@pytest.fixture(autouse=True)
def _eager():
    old = _kernels.set_backend("eager")
    yield
    _kernels.set_backend(old)


def _x(d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(d, generator=g) * torch.exp(torch.randn(d, generator=g))
    x[3] = 0.0
    x[7] = x[8]  # duplicates
    x[10] = -x[11]
    return x


def _draws(c, x, n=DRAWS, first_key=1):
    X = x.expand(n, -1).contiguous()
    keys = torch.arange(first_key, first_key + n, dtype=torch.int64) * 7919
    return c.decode(c.encode(X, keys), x.numel()).double()


def _quant_var(c, x):
    """Exact per-coordinate variance of quant: p(1-p) step^2, p = frac(t), t as encoded."""
    d = x.numel()
    B = c.config.block or d
    L = c.levels
    var = torch.empty(d, dtype=torch.float64)
    for s in range(0, d, B):
        blk = x[s: s + B].view(1, 1, -1)
        lo, hi = blk.amin(), blk.amax()
        rng = (hi - lo).view(1, 1, 1)
        inv = gc._blocks.safe_inverse(float(L), rng)
        t = ((blk - lo) * inv).clamp(max=L).double().view(-1)
        p = t - t.floor()
        step = (rng / L).double().view(())
        var[s: s + B] = p * (1 - p) * step**2
    return var


def _qsgd_var(c, x):
    d, s = x.numel(), c.config.levels
    B = c.config.block or d
    var = torch.empty(d, dtype=torch.float64)
    for a in range(0, d, B):
        blk = x[a: a + B]
        norm = blk.double().norm().float()
        inv = gc._blocks.safe_inverse(float(s), norm.view(1))
        t = (blk.abs() * inv).clamp(max=s).double()
        p = t - t.floor()
        var[a: a + B] = p * (1 - p) * (norm.double() / s) ** 2
    return var


def _ternary_var(c, x):
    d = x.numel()
    B = c.config.block or d
    var = torch.empty(d, dtype=torch.float64)
    for a in range(0, d, B):
        blk = x[a: a + B].double()
        s = blk.abs().max()
        var[a: a + B] = s * blk.abs() - blk**2
    return var


def _randk_var(c, x):
    d = x.numel()
    k = c.count(d)
    return x.double() ** 2 * (d / k - 1)


CASES = [
    ("quant:bits=1", _quant_var),
    ("quant:bits=2", _quant_var),
    ("quant:bits=3,block=16", _quant_var),
    ("quant:bits=4", _quant_var),
    ("quant:bits=4,block=23", _quant_var),
    ("quant:bits=8", _quant_var),
    ("quant:bits=8,block=16", _quant_var),
    ("quant:bits=12", _quant_var),
    ("quant:bits=16,block=30", _quant_var),
    ("qsgd:levels=1", _qsgd_var),
    ("qsgd:levels=4", _qsgd_var),
    ("qsgd:levels=16,block=24", _qsgd_var),
    ("qsgd:levels=255", _qsgd_var),
    ("ternary", _ternary_var),
    ("ternary:block=16", _ternary_var),
    ("randk:p=0.1", _randk_var),
    ("randk:p=0.5", _randk_var),
    ("randk:p=0.75", _randk_var),  # k > d / 2: the k smallest hashed priorities
    ("randk:k=1", _randk_var),
]


@pytest.mark.parametrize("spec,var_fn", CASES, ids=[c[0] for c in CASES])
def test_unbiased_and_variance_matches_theory(spec, var_fn):
    c = gc.build(spec)
    assert c.unbiased
    x = _x()
    Y = _draws(c, x)
    var = var_fn(c, x)
    xd = x.double()
    # unbiasedness: every coordinate's mean within Z standard errors (plus fp32 slack)
    se = (var / DRAWS).sqrt()
    slack = 1e-6 * (xd.abs().max() + 1)
    dev = (Y.mean(0) - xd).abs()
    assert bool((dev <= Z * se + slack).all()), f"max z = {float(((dev - slack) / se).max()):.2f}"
    # variance: the mean squared error equals the exact sum of the coordinate variances
    sq = ((Y - xd) ** 2).sum(1)
    mse, mse_se = float(sq.mean()), float(sq.std() / math.sqrt(DRAWS))
    theory = float(var.sum())
    assert abs(mse - theory) <= Z * mse_se + 1e-9 * float((xd**2).sum()), (mse, theory, mse_se)


@pytest.mark.parametrize("levels", [1, 2, 8, 64])
@pytest.mark.parametrize("d", [16, 256])
def test_qsgd_variance_bound(levels, d):
    c = gc.build(f"qsgd:levels={levels}")
    x = _x(d, seed=d + levels)
    Y = _draws(c, x, n=1000)
    sq = ((Y - x.double()) ** 2).sum(1)
    bound = min(d / levels**2, math.sqrt(d) / levels) * float((x.double() ** 2).sum())
    assert float(sq.mean()) <= bound + 4 * float(sq.std()) / math.sqrt(1000)
    assert float(_qsgd_var(c, x).sum()) <= bound * (1 + 1e-6)


def test_randk_variance_formula_with_p():
    c = gc.build("randk:p=0.25")
    x = _x(40)
    k = c.count(40)
    assert k == 10
    Y = _draws(c, x)
    sq = ((Y - x.double()) ** 2).sum(1)
    theory = (40 / k - 1) * float((x.double() ** 2).sum())
    assert abs(float(sq.mean()) - theory) <= Z * float(sq.std()) / math.sqrt(DRAWS)
    assert bool(((Y != 0).sum(1) <= k).all())


@pytest.mark.parametrize("k", [1, 5, 32, 64])
def test_topk_contraction(k):
    g = torch.Generator().manual_seed(k)
    X = torch.randn(50, 64, generator=g) ** 3
    c = gc.build(f"topk:k={k}")
    Y = c.decode(c.encode(X, torch.arange(50)), 64)
    err = ((Y - X) ** 2).sum(1)
    assert bool((err <= (1 - k / 64) * (X**2).sum(1) * (1 + 1e-6)).all())
    # and it is the best k-sparse approximation: the kept coordinates are the largest
    kept = (Y != 0).sum(1)
    assert bool((kept <= k).all())


def test_sign_error_is_exactly_the_l1_identity():
    # ||x - ||x||_1/d sign(x)||^2 = ||x||^2 - ||x||_1^2 / d  (Zheng et al. 2019 (arXiv:1905.10936), delta = ||x||_1^2/(d||x||^2))
    g = torch.Generator().manual_seed(3)
    X = torch.randn(20, 100, generator=g)
    Y = gc.build("sign").decode(gc.build("sign").encode(X, torch.arange(20)), 100).double()
    Xd = X.double()
    lhs = ((Xd - Y) ** 2).sum(1)
    rhs = (Xd**2).sum(1) - Xd.abs().sum(1) ** 2 / 100
    assert torch.allclose(lhs, rhs, rtol=1e-5)


def test_rounding_probability_is_exact_for_simple_fractions():
    # quant:bits=1 on [0, 1]: t = x; frac 0.25 / 0.5 / 0.75 rounds up with that probability
    x = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0])
    c = gc.build("quant:bits=1")
    n = 40_000
    Y = _draws(c, x, n=n)
    p = Y.mean(0)
    for i, want in enumerate([0.0, 0.25, 0.5, 0.75, 1.0]):
        assert abs(float(p[i]) - want) <= Z * math.sqrt(want * (1 - want) / n) + 1e-12


_REM = 5 / 16  # the remainder of the tie elements below: F - u, exact in fp32 for u < 2**20


def _tie_rows(n: int):
    """n keys and rows [0, t, 1] whose element 1 is a tie of quant:bits=1: t = (u + 5/16)
    * 2**-24, u the element's first (24-bit) digit for the row's key, so F = t * 2**24
    and floor(F) == u. Keys are kept whose digit is below 2**20, so that t is exact in
    fp32 (at most 24 significant bits) and every row has the remainder F - u = 5/16."""
    keys = torch.arange(1, 40 * n, dtype=torch.int64)  # 1 in 16 has a digit below 2**20
    u = _kernels.block_digits(R.stream_seeds(keys, R.STREAM_ROUND), 1, 2, 0)[:, 0, 1]
    keep = (u < (1 << 20)).nonzero()[:n, 0]
    assert keep.numel() == n
    keys, u = keys[keep], u[keep].to(torch.float64)
    t = ((u + _REM) * 2.0**-24).to(torch.float32)
    assert torch.equal(t.to(torch.float64) * 2.0**24 - u, torch.full_like(u, _REM))  # exact
    X = torch.stack([torch.zeros(n), t, torch.ones(n)], 1)
    return X, keys


def test_ties_beyond_the_first_digit_are_resolved_exactly():
    """Rows whose element 1 has a first (24-bit) digit equal to floor(frac * 2**24): a tie.

    On [0, 1] with one bit, t = x rounds up with probability t; given the tie, with
    probability F - u (5/16 here), which the lazily drawn digits must honour.
    """
    n = 20_000
    X, keys = _tie_rows(n)
    c = gc.build("quant:bits=1")
    P = c.encode(X, keys)
    codes = P[:, c.layout(3).offsets["codes"][0]].to(torch.int64)
    up = ((codes >> 1) & 1).double().mean().item()
    assert abs(up - _REM) <= Z * math.sqrt(_REM * (1 - _REM) / n), (up, _REM)
    # the other elements are untouched by the tie path
    assert bool(((codes & 1) == 0).all()) and bool(((codes >> 2) & 1).all())


def test_ties_are_deterministic_per_key():
    c = gc.build("quant:bits=1")
    x, keys = _tie_rows(50)
    assert torch.equal(c.encode(x, keys), c.encode(x, keys))
    alone = torch.cat([c.encode(x[i:i + 1], keys[i:i + 1]) for i in range(50)])
    assert torch.equal(alone, c.encode(x, keys))


def test_randk_keeps_the_first_k_distinct_draws():
    """Reference in plain Python: draw j is uniform_below(seed, j, d); the first k distinct
    draws are kept (sequential sampling without replacement), reported ascending."""
    d, k = 30, 12
    c = gc.build(f"randk:k={k}")
    keys = torch.tensor([5, -9, 1 << 40])
    seeds = R.stream_seeds(keys, R.STREAM_SAMPLE)
    got = c._positions(keys, d)
    for r in range(3):
        seen, j = [], 0
        while len(seen) < k:
            u = int(R.uniform_below(seeds[r: r + 1], torch.tensor([j]), d))
            if u not in seen:
                seen.append(u)
            j += 1
        assert got[r].tolist() == sorted(seen)


def test_randk_subsets_are_uniform():
    from scipy import stats

    d, k, trials = 20, 5, 20_000
    c = gc.build(f"randk:k={k}")
    chosen = c._positions(torch.arange(trials), d)
    assert bool((chosen[:, 1:] > chosen[:, :-1]).all())  # distinct, ascending
    assert stats.chisquare(torch.bincount(chosen.flatten(), minlength=d).numpy()).pvalue > 1e-4
    # pairs and triples of coordinates appear together as often as in a uniform k-subset
    for group in ((0, 1), (4, 17), (2, 3, 19)):
        together = torch.ones(trials, dtype=torch.bool)
        for i in group:
            together &= (chosen == i).any(1)
        g = len(group)
        expected = math.comb(d - g, k - g) / math.comb(d, k)
        freq = together.double().mean().item()
        assert abs(freq - expected) < 5 * math.sqrt(expected * (1 - expected) / trials), (group, freq, expected)


def _reference_topk(X, k):
    """The k largest |x| per row, ties by lower index, ascending: by a stable sort."""
    order = torch.sort(-X.abs(), dim=1, stable=True).indices
    return order[:, :k].sort(dim=1).values


@pytest.mark.parametrize("kind", ["gauss", "ties", "zeros", "periodic", "spike"])
def test_topk_threshold_selection_is_exact(kind, monkeypatch):
    # rows of 2**15 values and more select through a threshold from a strided sample (and
    # fall back to a full top-k when fewer than k values reach it): still the exact top k
    m, d = 3, 140_003  # a sample of every second value
    full = []
    real = _kernels.run
    monkeypatch.setattr(_kernels, "run", lambda k, *a: (full.append(k.name), real(k, *a))[1])
    g = torch.Generator().manual_seed(4)
    X = torch.randn(m, d, generator=g)
    if kind == "ties":
        X = torch.randint(-3, 4, (m, d), generator=g).float()  # thousands of equal |x|
    elif kind == "zeros":
        X[:, 50:] = 0.0  # fewer non-zeros than k: the fallback
        X[1, 60] = -0.0
    elif kind == "periodic":
        X[:, 1::2] *= 1e-3  # half the values tiny, in step with a strided sample
    elif kind == "spike":
        X[2, ::7] *= 100.0
    for k in (1, 400, 4000):
        c = gc.build(f"topk:k={k}")
        keys = torch.arange(m)
        P = c.encode(X, keys)
        v = c.layout(d).views(P)
        ref = _reference_topk(X, k)
        assert torch.equal(v["index"].long(), ref), (kind, k)
        assert torch.equal(v["values"], X.gather(1, ref))
        assert torch.equal(c.encode(X[1:2], keys[1:2])[0], P[1])  # alone as in the batch
        Y = c.decode(P, d)
        assert torch.equal(Y, torch.zeros_like(X).scatter_(1, ref, X.gather(1, ref)))
    # the sample sees only the large half of "periodic": too high a threshold, the fallback
    assert ("magnitude_keys" in full) == (kind == "periodic")


def test_randk_short_of_draws_draws_more_with_the_same_result(monkeypatch):
    from gossip.compress import sparse

    seeds = R.stream_seeds(torch.arange(6), R.STREAM_SAMPLE)
    want = sparse._first_distinct(seeds, 40, 90)
    monkeypatch.setattr(sparse.math, "log1p", lambda v: 0.0)  # expect no draws at all: retries
    assert torch.equal(sparse._first_distinct(seeds, 40, 90), want)
