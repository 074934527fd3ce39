"""Sparsifiers: ``randk`` (unbiased), ``topk``, ``randomk``, ``randomblock`` (biased, for error feedback).

Payload sizes are fixed by (parameters, numel), so the random ones keep exactly
``k`` coordinates, with ``k = k`` or ``k = max(1, round(p * d))``:

- ``randk`` (papers/002 footnote 2, with a fixed count): k coordinates chosen
  uniformly without replacement from the row key; each coordinate is kept with
  probability k/d and scaled by d/k, so E[C(x)] = x exactly and
  E||C(x) - x||^2 = (d/k - 1) ||x||^2. The key is in the header: the receiver
  regenerates the same coordinates and only the k fp32 values travel.
- ``randomk`` (papers/001 G.2): the same coordinates, values not scaled; a
  contraction, E||C(x) - x||^2 = (1 - k/d) ||x||^2 (delta = k/d).
- ``randomblock`` (papers/001 G.1): k consecutive coordinates starting at an
  offset drawn uniformly from 0..d-k (the block always fits, unlike a slice that
  runs past the end), values not scaled; the end coordinates are kept only when
  the block starts or ends there, so delta = 1/(d-k+1) (1 when k = d).
- ``topk`` (papers/001 G.4): the k largest |x_i| (ties broken by lower index),
  fp32 values and int32 indices; ||C(x) - x||^2 <= (1 - k/d) ||x||^2 (delta = k/d).

With the same key on every node (a shared seed), ``randomk`` and ``randomblock``
payload bodies can be summed: they are linear, as papers/001 all-reduces them.
"""

from __future__ import annotations

import dataclasses

import torch

from . import _kernels, _random as R
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
    return _Cfg


SparseConfig = _count_config("sparse", 0.01)


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
        pri = _kernels.priorities(seeds, numel)
        idx = torch.topk(pri, k, dim=1, largest=False, sorted=False).indices
        return idx.sort(dim=1).values

    def _encode(self, X, keys, v):
        self._check_finite(X)
        idx = self._positions(keys, X.shape[1])
        torch.gather(X, 1, idx, out=v["values"]) if v["values"].is_contiguous() else v["values"].copy_(X.gather(1, idx))

    def _decode(self, v, numel, keys):
        idx = self._positions(keys.to(v["values"].device), numel)
        vals = v["values"] * self._scale(numel)
        out = torch.zeros(vals.shape[0], numel, dtype=torch.float32, device=vals.device)
        return out.scatter_(1, idx, vals)

    def _scale(self, numel: int) -> float:
        return 1.0


@register
class RandK(_Sparse):
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
    name = "randomk"
    cid = 10
    description = "Random K (papers/001 G.2): k coordinates from a shared seed, unscaled, biased, linear"
    linear = True
    contractive = True
    Config = _count_config("randomk", 0.01)

    def delta(self, numel: int) -> float:
        return self.count(numel) / numel


@register
class RandomBlock(_Sparse):
    name = "randomblock"
    cid = 11
    description = "Random Block (papers/001 G.1): k consecutive coordinates at a shared random offset, biased, linear"
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
    name = "topk"
    cid = 9
    description = "Top K (papers/001 G.4): the k largest |x_i| with their int32 indices, biased"
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
        self._check_finite(X)
        m, d = X.shape
        k = self.count(d)
        # distinct keys ordered by |x| then lower index: the selection is unique
        mag = _kernels.run(_kernels.MAGNITUDE_KEYS, X.numel(), X)
        idx = torch.topk(mag, k, dim=1, sorted=False).indices.sort(dim=1).values
        v["values"].copy_(X.gather(1, idx))
        v["index"].copy_(idx)

    def _decode(self, v, numel, keys):
        idx = v["index"].to(torch.int64)
        if bool(((idx < 0) | (idx >= numel)).any()):
            raise ValueError(f"topk.decode: index out of range for numel={numel}")
        out = torch.zeros(idx.shape[0], numel, dtype=torch.float32, device=idx.device)
        return out.scatter_(1, idx, v["values"])
