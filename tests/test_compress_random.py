"""The counter-based random source: exact definition, uniformity, independence.

The quantizers' speed comes from hashing (key, index) instead of drawing from a
stateful generator; these tests show that the hash behaves like independent
uniform draws, so it does not bias the rounding.
"""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from gossip.compress import _random as R

M64 = (1 << 64) - 1


def _mix_ref(z: int) -> int:
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _u(t: torch.Tensor) -> list:
    return [v & M64 for v in t.tolist()]


def test_mix64_matches_reference():
    vals = [0, 1, -1, 12345, 1 << 62, -(1 << 63), 0x0123456789ABCDEF]
    assert _u(R.mix64(torch.tensor(vals))) == [_mix_ref(v) for v in vals]


def test_words_are_splitmix64_in_counter_mode():
    seed = torch.tensor([987654321])
    w = _u(R.words(seed, 5)[0])
    g = 0x9E3779B97F4A7C15
    assert w == [_mix_ref(987654321 + (j + 1) * g) for j in range(5)]


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_digit_layouts_agree(n):
    seeds = R.stream_seeds(torch.tensor([3, -9, 1 << 40]), R.STREAM_ROUND)
    d = R.digits(seeds, n)
    assert d.shape == (3, n) and int(d.min()) >= 0 and int(d.max()) < (1 << 32)
    d2 = R.digits_at(seeds.view(-1, 1), torch.arange(n).view(1, -1))
    assert torch.equal(d, d2)
    assert torch.equal(R.digits(seeds[1:2], n), d[1:2])  # a row alone == in a batch
    w = R.words(seeds, (n + 1) // 2)
    assert torch.equal(d[:, 0::2], w[:, : (n + 1) // 2] & 0xFFFFFFFF)


def _hash24_ref(i: int, s1: int, s2: int) -> int:
    """hash24 written with Python integers (unsigned 32-bit arithmetic)."""
    M = 0xFFFFFFFF
    h = ((i + s1) * 0x21F0AAAD) & M
    h ^= s2 & M
    h ^= h >> 12
    h = (h * 0x735A2D97) & M
    u = h >> 8
    return u ^ (u >> 15)


def test_hash24_matches_reference():
    seeds = R.stream_seeds(torch.tensor([11, -4, 1 << 62]), R.STREAM_ROUND)
    s1, s2 = R.seeds32(seeds)
    assert s1.dtype == s2.dtype == torch.int32
    for r, sd in enumerate(seeds.tolist()):
        assert int(s1[r]) & 0xFFFFFFFF == sd & 0xFFFFFFFF and int(s2[r]) & 0xFFFFFFFF == (sd >> 32) & 0xFFFFFFFF
    idx = torch.tensor([0, 1, 2, 1000, (1 << 31) - 1, -(1 << 31), -1], dtype=torch.int32)
    got = R.hash24(idx.view(1, -1), s1.view(-1, 1), s2.view(-1, 1))
    for r in range(3):
        want = [_hash24_ref(i & 0xFFFFFFFF, int(s1[r]) & 0xFFFFFFFF, int(s2[r])) for i in idx.tolist()]
        assert got[r].tolist() == want


def test_hash24_is_a_bijection_of_the_index():
    # for a fixed seed, i -> h is one-to-one on 32-bit integers (checked on 2**20 indices),
    # which makes each element's digit exactly uniform when the seed is
    s1, s2 = torch.tensor(123456789, dtype=torch.int32), torch.tensor(-987654321, dtype=torch.int32)
    i = torch.arange(1 << 20, dtype=torch.int32)
    h = R.hash32(i, s1, s2)
    assert torch.unique(h).numel() == i.numel()
    u = (h >> 8) & 0xFFFFFF
    assert torch.equal(R.hash24(i, s1, s2), u ^ (u >> 15))
    assert torch.equal(R.hash24(i + s1, 0, s2), R.hash24(i, s1, s2))  # s1 added by the caller


@pytest.mark.parametrize("n,nb,start", [(1, 1, 0), (2, 3, 0), (7, 2, 5), (100, 4, 0), (101, 3, 9)])
def test_block_digit_layout(n, nb, start):
    """First digits of quantizer blocks: element k of block b is element start + b*n + k
    of its row, and its digit is hash24 of that index."""
    from gossip.compress._kernels import block_digits

    seeds = R.stream_seeds(torch.tensor([11, -4]), R.STREAM_ROUND)
    u = block_digits(seeds, nb, n, start)
    s1, s2 = R.seeds32(seeds)
    assert u.shape == (2, nb, n)
    for r in range(2):
        want = [_hash24_ref(start + j, int(s1[r]) & 0xFFFFFFFF, int(s2[r])) for j in range(nb * n)]
        assert u[r].flatten().tolist() == want


def _digits_many(nkeys=256, n=4096, stream=R.STREAM_ROUND, first_key=0):
    keys = torch.arange(first_key, first_key + nkeys, dtype=torch.int64)
    return R.digits(R.stream_seeds(keys, stream), n)


def test_uniformity_chi_square_and_ks():
    d = _digits_many()  # 2**20 digits from consecutive keys
    for shift in (0, 8, 24):  # low, middle and top byte
        counts = torch.bincount(((d >> shift) & 0xFF).flatten(), minlength=256).numpy()
        p = stats.chisquare(counts).pvalue
        assert p > 1e-4, (shift, p)
    u = (d.flatten()[: 200_000].double() + 0.5) / 2.0**32
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-4


def test_rounding_digits_are_uniform_and_independent():
    # the 24-bit first digits of the quantizers: both halves of a word, many keys
    from gossip.compress._kernels import block_digits

    u = block_digits(R.stream_seeds(torch.arange(128), R.STREAM_ROUND), 2, 4096, 0)  # (128, 2, 4096)
    assert int(u.min()) >= 0 and int(u.max()) < (1 << 24)
    for shift in (0, 16):
        counts = torch.bincount(((u >> shift) & 0xFF).flatten(), minlength=256).numpy()
        assert stats.chisquare(counts).pvalue > 1e-4
    lo, hi = u[..., :2048], u[..., 2048:]  # two halves of a block
    tol = 5 / math.sqrt(lo.numel())
    assert abs(_corr(lo, hi)) < tol
    assert abs(_corr(u[:, 0], u[:, 1])) < tol  # neighbouring blocks
    assert abs(_corr(u[:-1], u[1:])) < tol  # consecutive keys
    joint = torch.bincount(((lo >> 20) * 16 + (hi >> 20)).flatten(), minlength=256).numpy()
    assert stats.chisquare(joint).pvalue > 1e-4


def test_rounding_digits_neighbours_bits_and_shifts():
    from gossip.compress._kernels import block_digits

    u = block_digits(R.stream_seeds(torch.arange(256), R.STREAM_ROUND), 1, 4096, 0)[:, 0]  # (256, 4096)
    tol = 5 / math.sqrt(u[:, :-1].numel())
    for lag in (1, 2, 8, 16):  # neighbouring elements, e.g. the codes that share a packed byte
        assert abs(_corr(u[:, :-lag], u[:, lag:])) < tol, lag
    joint = torch.bincount(((u[:, 0::2] >> 20) * 16 + (u[:, 1::2] >> 20)).flatten(), minlength=256).numpy()
    assert stats.chisquare(joint).pvalue > 1e-4
    bits = torch.stack([(u >> s) & 1 for s in (0, 1, 11, 22, 23)])
    frac = bits.double().mean(dim=(1, 2))
    assert torch.all((frac - 0.5).abs() < 5 * 0.5 / math.sqrt(u.numel()))
    uu = (u.flatten()[:200_000].double() + 0.5) / 2.0**24
    assert stats.kstest(uu.numpy(), "uniform").pvalue > 1e-4
    for lag in range(1, 64):  # nearby keys are not shifted copies of each other
        assert not torch.equal(u[0, lag:lag + 100], u[1, :100])
        assert not torch.equal(u[1, lag:lag + 100], u[0, :100])


def _far_pair_pvalues(u: torch.Tensor) -> dict:
    """Chi-square p-values of digits ``lag`` elements apart in a row: the joint top and
    low nibbles, and the top byte of the difference modulo 2**24."""
    res = {}
    for lag in (1, 2, 16, 256, 4096):
        a, b = u[:, :-lag], u[:, lag:]
        for name, sh in (("top", 20), ("low", 0)):
            joint = ((a >> sh) & 15) * 16 + ((b >> sh) & 15)
            res[(name, lag)] = stats.chisquare(torch.bincount(joint.flatten(), minlength=256).numpy()).pvalue
        if lag >= 16:
            diff = ((b - a) & 0xFFFFFF) >> 16
            res[("diff", lag)] = stats.chisquare(torch.bincount(diff.flatten(), minlength=256).numpy()).pvalue
    return res


def test_rounding_digits_far_apart_are_independent():
    """Digits up to 4096 elements apart (a gradient's neighbouring rows): the format 3
    hash (lowbias32 on the counter) failed these at lags 256 and 4096 (p < 1e-10)."""
    from gossip.compress._kernels import block_digits

    u = block_digits(R.stream_seeds(torch.arange(256), R.STREAM_ROUND), 1, 8192, 0)[:, 0].long()
    bad = {k: p for k, p in _far_pair_pvalues(u).items() if p < 1e-4}
    assert not bad, bad


def test_pairs_are_uniform():
    # consecutive positions share a 64-bit word: their joint distribution must be flat
    d = _digits_many(nkeys=64, n=8192)
    a = (d[:, 0::2] >> 28).flatten()
    b = (d[:, 1::2] >> 28).flatten()
    counts = torch.bincount(a * 16 + b, minlength=256).numpy()
    assert stats.chisquare(counts).pvalue > 1e-4


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.double().flatten()
    b = b.double().flatten()
    a -= a.mean()
    b -= b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def test_independence_across_positions_keys_and_streams():
    d = _digits_many(nkeys=512, n=2048)
    tol = 5 / math.sqrt(d.numel() / 2)
    assert abs(_corr(d[:, :-1], d[:, 1:])) < tol  # neighbouring positions
    assert abs(_corr(d[:, :-2], d[:, 2:])) < tol  # next word
    assert abs(_corr(d[:-1], d[1:])) < tol  # consecutive keys, same position
    tie = _digits_many(nkeys=512, n=2048, stream=R.STREAM_TIE)
    assert abs(_corr(d, tie)) < tol  # two streams of the same key
    # bits, not just values: each bit is a fair coin and independent of the next key's
    bits = torch.stack([(d >> s) & 1 for s in (0, 1, 15, 16, 31)])
    frac = bits.double().mean(dim=(1, 2))
    assert torch.all((frac - 0.5).abs() < 5 * 0.5 / math.sqrt(d.numel()))


def test_no_shifted_overlap_between_keys():
    # additive counter streams of nearby keys must not be shifted copies of each other
    d = _digits_many(nkeys=4, n=4096)
    for lag in range(1, 64):
        assert not torch.equal(d[0, lag:lag + 100], d[1, :100])
        assert not torch.equal(d[1, lag:lag + 100], d[0, :100])


def test_uniform_below_is_uniform():
    keys = torch.arange(70_000)
    v = R.uniform_below(R.stream_seeds(keys, R.STREAM_SAMPLE), torch.zeros_like(keys), 7)
    assert int(v.min()) == 0 and int(v.max()) == 6
    assert stats.chisquare(torch.bincount(v, minlength=7).numpy()).pvalue > 1e-4


def test_priorities_give_uniform_subsets():
    d, k, trials = 20, 5, 20_000
    seeds = R.stream_seeds(torch.arange(trials), R.STREAM_SAMPLE)
    pri = R.priorities(seeds, d)
    assert torch.equal(pri & 31, torch.arange(d).expand(trials, d))  # index in the low bits
    assert bool((pri >= 0).all())
    chosen = torch.topk(pri, k, dim=1, largest=False).indices
    counts = torch.bincount(chosen.flatten(), minlength=d).numpy()
    assert stats.chisquare(counts).pvalue > 1e-4
    # pairs of coordinates appear together as often as in a uniform k-subset
    pair = ((chosen == 0).any(1) & (chosen == 1).any(1)).double().mean().item()
    expected = k * (k - 1) / (d * (d - 1))
    assert abs(pair - expected) < 5 * math.sqrt(expected * (1 - expected) / trials)
