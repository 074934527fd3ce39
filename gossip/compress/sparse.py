"""Sparsifiers: ``randk`` (unbiased), ``topk``, ``randomk``, ``randomblock`` (biased, for error feedback).

Payload sizes are fixed by (parameters, numel), so the random ones keep exactly
``k`` coordinates, with ``k = k`` or ``k = max(1, round(p * d))``:

- ``randk`` (Tang et al. 2018, arXiv:1803.06443, footnote 2, with a fixed count): k coordinates chosen
  uniformly without replacement from the row key; each coordinate is kept with
  probability k/d and scaled by d/k, so E[C(x)] = x exactly and
  E||C(x) - x||^2 = (d/k - 1) ||x||^2. The key is in the header: the receiver
  regenerates the same coordinates and only the k fp32 values travel.
- ``randomk`` (Vogels et al. 2019, arXiv:1905.13727, G.2): the same coordinates, values not scaled; a
  contraction, E||C(x) - x||^2 = (1 - k/d) ||x||^2 (delta = k/d).
- ``randomblock`` (Vogels et al. 2019, arXiv:1905.13727, G.1): k consecutive coordinates starting at an
  offset drawn uniformly from 0..d-k (the block always fits, unlike a slice that
  runs past the end), values not scaled; the end coordinates are kept only when
  the block starts or ends there, so delta = 1/(d-k+1) (1 when k = d).
- ``topk`` (Vogels et al. 2019, arXiv:1905.13727, G.4): the k largest |x_i| (ties broken by lower index),
  fp32 values and int32 indices; ||C(x) - x||^2 <= (1 - k/d) ||x||^2 (delta = k/d).

Drawing the coordinates (randk, randomk) for ``k <= d / 2``: draw ``j`` of a row is
``u_j = uniform_below(seed, j, d)`` (a 63-bit SplitMix64 word modulo d, bias at
most d / 2**63), and the row keeps the first k distinct values of ``u_0, u_1, ...``.
This is sequential sampling without replacement by rejection, so the kept set is
a uniform k-subset (for uniform draws) and every coordinate is kept with
probability exactly k/d. About ``-d ln(1 - k/d)`` draws are needed (at most
``1.39 k``); one stable sort of the draws finds, per value, its first draw. For ``k > d / 2`` the k smallest of d hashed priorities are kept
(``_random.priorities``), also a uniform k-subset.

Selecting the top k: a threshold ``t`` is taken from a strided sample of ``|x|``
(a sample rank a few standard deviations above ``k`` times the sampling rate), the
coordinates with ``|x| >= t`` are collected in one chunked pass, and the top k of
those candidates are taken by (|x|, lower index). Every one of the k largest
reaches ``t`` whenever at least k coordinates do, so the result is exactly the top
k of the whole row; the threshold only changes the time taken. If fewer than k
reach ``t`` in some row (an unlucky sample, or a row of mostly zeros), the batch is
done again with one top-k over every coordinate. Rows below 2**15 values, or k
above d / 8, take that path directly.

With the same key on every node (a shared seed), ``randomk`` and ``randomblock``
payload bodies can be summed: they are linear, as Vogels et al. 2019 (arXiv:1905.13727) all-reduces them.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import _kernels, _random as R, _scratch
from .base import Compressor, Config
from .registry import register
from .wire import Layout

__all__ = ["RandK", "RandomK", "RandomBlock", "TopK", "SparseConfig"]


def _count_config(name: str, default_p: float):
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class _Cfg(Config):
        p: float | None = None  # fraction of coordinates kept, in (0, 1]
        k: int | None = None  # or: number of coordinates kept

        def __post_init__(self):
            if self.p is not None and self.k is not None:
                raise ValueError(f"{name}: give `p` or `k`, not both")
            if self.p is None and self.k is None:
                object.__setattr__(self, "p", default_p)
            if self.p is not None:
                p = self.p
                if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
                    self._fail("p", "must be a number in (0, 1]")
                object.__setattr__(self, "p", float(p))
            if self.k is not None:
                k = self.k
                if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                    self._fail("k", "must be an integer >= 1")

    _Cfg.__name__ = _Cfg.__qualname__ = name.capitalize() + "Config"
    _Cfg.__doc__ = (f"Options of ``{name}``: the fraction ``p`` of coordinates kept, in (0, 1], or their "
                    f"number ``k``; neither: p = {default_p}.")
    return _Cfg


SparseConfig = _count_config("sparse", 0.01)
"""Options of ``sparse``: the fraction ``p`` of coordinates kept, in (0, 1], or their number ``k``;
neither: p = 0.01. Each sparsifier has its own, with its default ``p`` (``Compressor.Config``)."""


def _uniform_draws(seeds: torch.Tensor, n: int, d: int) -> torch.Tensor:
    """``uniform_below(seed, j, d)`` for j = 0 .. n-1: (m, n) int64, computed in place."""
    m = seeds.shape[0]
    z = torch.arange(1, n + 1, dtype=torch.int64, device=seeds.device).mul_(R.GAMMA)
    z = z.view(1, n) + seeds.view(m, 1)
    t = torch.empty_like(z)
    for shift, mult in ((30, R._M1), (27, R._M2)):  # mix64, as in _random.words
        torch.bitwise_right_shift(z, shift, out=t)
        t.bitwise_and_((1 << (64 - shift)) - 1)
        z.bitwise_xor_(t).mul_(mult)
    torch.bitwise_right_shift(z, 31, out=t)
    t.bitwise_and_((1 << 33) - 1)
    z.bitwise_xor_(t)
    z.bitwise_right_shift_(1).bitwise_and_((1 << 62) - 1 + (1 << 62))  # the logical shift by 1
    return z.remainder_(d)


def _first_distinct(seeds: torch.Tensor, k: int, d: int) -> torch.Tensor:
    """The first k distinct values of each row's draws uniform_below(seed, j, d),
    j = 0, 1, ...: (m, k) int64, ascending (see the module docstring)."""
    m = seeds.shape[0]
    dev = seeds.device
    mean = -d * math.log1p(-k / d)  # expected draws for k distinct values
    # the count of draws is a sum of geometric variables, of variance below
    # k (k/d) / (1 - k/d)**2; a shortfall (rare) draws more, with the same result
    extra = 6 * math.sqrt(k * (k / d)) / (1 - k / d) + 8
    while True:
        n = int(math.ceil(mean + extra))
        u = _uniform_draws(seeds, n, d)
        rows = torch.arange(m, dtype=torch.int64, device=dev).view(m, 1) * d
        # one stable sort of row * d + value: rows stay apart, values ascend, and equal
        # values keep the order of their draws
        key = (u + rows).view(-1)
        if m * d <= 1 << 31:
            key = key.to(torch.int32)  # sorts twice as fast
        srt = torch.sort(key, stable=True)
        val = srt.values.view(m, n)
        draw = srt.indices.view(m, n)
        if m > 1:
            draw = draw - torch.arange(m, dtype=torch.int64, device=dev).view(m, 1) * n
        first = torch.ones(m, n, dtype=torch.int32, device=dev)  # a value's first draw (1) or a repeat (0)
        torch.ne(val[:, 1:], val[:, :-1], out=first[:, 1:])
        # the same flags in draw order; their running count reaches k at the cut
        by_draw = torch.empty_like(first).scatter_(1, draw, first)
        count = by_draw.cumsum_(1)
        cut = torch.searchsorted(count, torch.full((m, 1), k, dtype=torch.int32, device=dev))
        if bool((cut < n).all()):
            break
        extra *= 4  # fewer than k distinct values in n draws (rare): draw more
    keep = first.bool() & (draw <= cut)  # exactly k per row
    return val[keep].view(m, k).to(torch.int64) - rows


class _Sparse(Compressor):
    unbiased = False
    linear = False

    def count(self, numel: int) -> int:
        """Coordinates kept for ``numel`` elements; raises ValueError if k > numel."""
        numel = self._check_numel(numel)
        if self.config.k is not None:
            if self.config.k > numel:
                raise ValueError(f"{self.name}: k={self.config.k} exceeds numel={numel} (k must be <= numel)")
            return self.config.k
        return max(1, min(numel, round(self.config.p * numel)))

    def layout(self, numel: int) -> Layout:
        return Layout((("values", torch.float32, self.count(numel)),))

    def ideal_nbytes(self, numel: int) -> float:
        return 4.0 * self.count(numel)

    def _positions(self, keys: torch.Tensor, numel: int) -> torch.Tensor:
        """Kept coordinates of each row, ascending: (m, k) int64, from the keys alone."""
        k = self.count(numel)
        seeds = R.stream_seeds(keys, R.STREAM_SAMPLE)
        if k == numel:
            return torch.arange(numel, device=keys.device).expand(keys.shape[0], numel)
        if 2 * k <= numel:
            return _first_distinct(seeds, k, numel)
        pri = _kernels.priorities(seeds, numel)
        idx = torch.topk(pri, k, dim=1, largest=False, sorted=False).indices
        return idx.sort(dim=1).values

    def _encode(self, X, keys, v):
        self._check_finite(X)
        idx = self._positions(keys, X.shape[1])
        torch.gather(X, 1, idx, out=v["values"]) if v["values"].is_contiguous() else v["values"].copy_(X.gather(1, idx))

    def _decode_into(self, v, numel, keys, out):
        idx = self._positions(keys.to(v["values"].device), numel)
        vals = v["values"]
        if self._scale(numel) != 1.0:
            vals = vals * self._scale(numel)
        out.zero_()
        out.scatter_(1, idx, vals)

    def _scale(self, numel: int) -> float:
        return 1.0


@register
class RandK(_Sparse):
    """Random sparsification, unbiased: k = round(p d) coordinates scaled by d/k.

    The coordinates are drawn from the key."""

    name = "randk"
    cid = 6
    description = "random sparsification: k = round(p*d) coordinates from the key, scaled by d/k, unbiased"
    unbiased = True
    Config = _count_config("randk", 0.1)

    def _scale(self, numel: int) -> float:
        # d/k in fp32 arithmetic: the multiply happens in fp32
        return numel / self.count(numel)

    def omega(self, numel: int) -> float:
        return numel / self.count(numel) - 1.0


@register
class RandomK(_Sparse):
    """Random K: k coordinates at positions shared by all nodes, not rescaled.

    Biased and linear, a delta-contraction with delta = k/d."""

    name = "randomk"
    cid = 10
    description = "Random K (Vogels et al. 2019, arXiv:1905.13727, G.2): k coordinates from a shared seed, unscaled, biased, linear"
    linear = True
    contractive = True
    Config = _count_config("randomk", 0.01)

    def delta(self, numel: int) -> float:
        return self.count(numel) / numel


@register
class RandomBlock(_Sparse):
    """Random Block: k consecutive coordinates at an offset shared by all nodes.

    Not rescaled: biased and linear."""

    name = "randomblock"
    cid = 11
    description = "Random Block (Vogels et al. 2019, arXiv:1905.13727, G.1): k consecutive coordinates at a shared random offset, biased, linear"
    linear = True
    contractive = True
    Config = _count_config("randomblock", 0.01)

    def delta(self, numel: int) -> float:
        return 1.0 / (numel - self.count(numel) + 1)

    def _positions(self, keys, numel):
        k = self.count(numel)
        seeds = R.stream_seeds(keys, R.STREAM_SAMPLE)
        start = R.uniform_below(seeds, torch.zeros_like(seeds), numel - k + 1)
        return start.view(-1, 1) + torch.arange(k, device=keys.device)


@register
class TopK(_Sparse):
    """Top K: the k coordinates of largest magnitude, with their int32 indices.

    Biased, a delta-contraction with delta = k/d."""

    name = "topk"
    cid = 9
    description = "Top K (Vogels et al. 2019, arXiv:1905.13727, G.4): the k largest |x_i| with their int32 indices, biased"
    contractive = True
    Config = _count_config("topk", 0.01)

    def delta(self, numel: int) -> float:
        return self.count(numel) / numel

    def layout(self, numel: int) -> Layout:
        if numel >= 1 << 31:
            raise ValueError(f"topk: numel must be below 2**31 (int32 indices), got {numel}")
        k = self.count(numel)
        return Layout((("values", torch.float32, k), ("index", torch.int32, k)))

    def ideal_nbytes(self, numel: int) -> float:
        return 8.0 * self.count(numel)

    def _encode(self, X, keys, v):
        m, d = X.shape
        k = self.count(d)
        if d < _TOPK_MIN_NUMEL or k * _TOPK_MAX_FRACTION > d:
            self._check_finite(X)
            # distinct keys ordered by |x| then lower index: the selection is unique
            mag = _kernels.run(_kernels.MAGNITUDE_KEYS, X.numel(), X)
            idx = torch.topk(mag, k, dim=1, sorted=False).indices.sort(dim=1).values
        else:
            idx = self._threshold_topk(X, k)
        torch.gather(X, 1, idx, out=v["values"])
        v["index"].copy_(idx)

    def _threshold_topk(self, X, k):
        """The top k of each row by (|x|, lower index), through a threshold (module docstring)."""
        m, d = X.shape
        step = max(1, d // _TOPK_SAMPLE)
        S = (d + step - 1) // step
        if m * S <= _TOPK_CHUNK:  # kept across calls; a large batch's sample is a temporary
            sample = _scratch.buffer("topk.sample", m * S, torch.float32, X.device).view(m, S)
            torch.abs(X[:, ::step], out=sample)
        else:
            sample = X[:, ::step].abs()
        mean = S * k / d  # expected sample values at or above the k-th largest |x|
        rank = min(S, int(mean + 4 * math.sqrt(mean) + 2))
        t = torch.topk(sample, rank, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
        cand, peak = _candidates(X, t)
        self._check_finite(X, peak)  # NaN or inf shows up in the per-row max |x|
        counts = torch.bincount(cand // d, minlength=m) if m > 1 else torch.tensor([cand.numel()])
        if bool((counts >= k).all()):
            return _top_of_candidates(X, cand, counts, k)
        # fewer than k values reach the threshold in some row (an unlucky sample, or a
        # row of mostly zeros): one top-k over every coordinate
        mag = _kernels.run(_kernels.MAGNITUDE_KEYS, X.numel(), X)
        return torch.topk(mag, k, dim=1, sorted=False).indices.sort(dim=1).values

    def _decode_into(self, v, numel, keys, out):
        idx = v["index"].to(torch.int64)
        if bool(((idx < 0) | (idx >= numel)).any()):
            raise ValueError(f"topk.decode: index out of range for numel={numel}")
        out.zero_()
        out.scatter_(1, idx, v["values"])


def _candidates(X: torch.Tensor, t: torch.Tensor):
    """Flat positions ``row * d + column`` (ascending) of the values with |x| >= t (t: (m, 1)),
    in one pass over X in cache-sized chunks, and the max |x| of each row (m,)."""
    m, d = X.shape
    dev = X.device
    cols = d if d <= _TOPK_CHUNK else _TOPK_CHUNK
    rows = max(1, _TOPK_CHUNK // cols)
    absx = _scratch.buffer("topk.abs", rows * cols, torch.float32, dev)
    cpad = -(-cols // 8) * 8
    hit = _scratch.buffer("topk.hit", rows * cpad, torch.uint8, dev)
    peaks = _scratch.buffer("topk.peak", m * -(-d // cols), torch.float32, dev).view(m, -1)
    found = []
    tl = t.view(-1).tolist()  # fp32 values: compared exactly
    for r0 in range(0, m, rows):
        rr = min(rows, m - r0)
        for c, a in enumerate(range(0, d, cols)):
            n = min(cols, d - a)
            npad = -(-n // 8) * 8
            av = absx[: rr * n].view(rr, n)
            torch.abs(X[r0: r0 + rr, a: a + n], out=av)
            torch.amax(av, dim=1, out=peaks[r0: r0 + rr, c])
            # flags in place as fp32 0/1, then int32 0/1 (bits >> 29): vectorised, unlike a
            # bool output; a scalar threshold where one row is done at a time (a broadcast
            # tensor is several times slower)
            torch.ge(av, tl[r0] if rr == 1 else t[r0: r0 + rr], out=av)
            h32 = av.view(torch.int32)
            torch.bitwise_right_shift(h32, 29, out=h32)
            hv = hit[: rr * npad].view(rr, npad)
            hv[:, :n].copy_(h32)
            if npad > n:
                hv[:, n:] = 0
            # words of 8 flags first: most are zero, and a scan of words is 8 times shorter
            w = hit[: rr * npad].view(torch.int64).nonzero().view(-1)
            if w.numel() == 0:
                continue
            sub = hit[: rr * npad].view(-1, 8).index_select(0, w).view(torch.bool).nonzero()
            flat = w[sub[:, 0]] * 8 + sub[:, 1]  # position in the (rr, npad) block
            if rr == 1:
                found.append(flat + (r0 * d + a) if a else flat + r0 * d)
            else:
                found.append((flat // npad + r0) * d + flat % npad + a)
    cand = torch.cat(found) if len(found) != 1 else found[0]
    return cand, peaks.amax(dim=1)


def _top_of_candidates(X, cand, counts, k):
    """Top k by (|x|, lower index) among each row's candidates: (m, k) ascending indices.
    ``cand``: ascending flat positions ``row * d + column``; ``counts`` per row, each >= k."""
    m, d = X.shape
    mag = X.view(-1).index_select(0, cand).abs_().view(torch.int32).to(torch.int64)
    if m == 1:
        keys = (mag << 32) | (0xFFFFFFFF - cand)
        thr = torch.topk(keys, k, sorted=False).values.amin()
        return cand[keys >= thr].view(1, k)  # keys are distinct: exactly k, ascending
    r = cand // d
    col = cand - r * d
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(cand.shape[0], device=cand.device) - starts[r]
    keys = torch.full((m, int(counts.max())), -1, dtype=torch.int64, device=cand.device)  # below every real key
    keys[r, slot] = (mag << 32) | (0xFFFFFFFF - col)
    thr = torch.topk(keys, k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    keep = keys >= thr  # exactly k per row, in column order
    return (0xFFFFFFFF - (keys[keep] & 0xFFFFFFFF)).view(m, k)


_TOPK_MIN_NUMEL = 1 << 15  # below: one top-k over every coordinate
_TOPK_MAX_FRACTION = 8  # k above d / 8: likewise
_TOPK_SAMPLE = 1 << 16  # the sample's stride is d // this (at least 1): 2**16 to 2**17 values of a long row
_TOPK_CHUNK = 1 << 18  # elements per step of the candidate pass (1.25 MiB of scratch)
