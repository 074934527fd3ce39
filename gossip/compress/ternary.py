"""``ternary``: TernGrad (Wen et al. 2017): ``s * sign(x_i) * b_i``, ``b_i ~ Bernoulli(|x_i| / s)``.

``s`` is the block's max |x| (fp32, one per block); each value becomes one of
{-s, 0, +s} with the probabilities that keep it unbiased. Codes 0 (zero),
1 (+s), 2 (-s), packed 2 bits each. Variance per block of B values:
``E||Q(x) - x||^2 = s ||x||_1 - ||x||^2 <= (sqrt(B) - 1) / 2 ||x||^2`` (``omega``; the
worst case is one value 1 and the others ``(sqrt(B) - 1) / (B - 1)``).
"""

from __future__ import annotations

import dataclasses

import torch

from . import _blocks, _random as R
from .base import Compressor, Config
from .bitpack import pack_bits, packed_nbytes, unpack_bits
from .registry import register
from .wire import Layout

__all__ = ["Ternary", "TernaryConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TernaryConfig(Config):
    """Options of ``ternary``: the ``block`` size (None: the whole row)."""

    block: int | None = None  # elements per block; None = the whole row

    def __post_init__(self):
        _blocks.check_block(self)


@register
class Ternary(Compressor):
    """TernGrad: each value becomes one of {-s, 0, +s}, 2 bits per value.

    s is the block's max |x|; the probabilities keep the result unbiased."""

    name = "ternary"
    cid = 5
    description = "TernGrad: per-block max|x| times a stochastic sign in {-1, 0, 1}, unbiased, 2 bits per value"
    unbiased = True
    linear = False
    Config = TernaryConfig

    def layout(self, numel: int) -> Layout:
        nb = _blocks.nblocks(self.config.block, numel)
        return Layout((("scale", torch.float32, nb), ("codes", torch.uint8, packed_nbytes(numel, 2))))

    def ideal_nbytes(self, numel: int) -> float:
        numel = self._check_numel(numel)
        return (numel * 2 + 32 * _blocks.nblocks(self.config.block, numel)) / 8

    def omega(self, numel: int) -> float:
        B = _blocks.block_size(self.config.block, self._check_numel(numel))
        return (B**0.5 - 1.0) / 2.0

    def _encode(self, X, keys, v):
        m, d = X.shape
        B = _blocks.block_size(self.config.block, d)
        seeds = R.stream_seeds(keys, R.STREAM_ROUND)
        codes = torch.empty(m, d, dtype=torch.uint8, device=X.device)
        for x3, start, b0 in _blocks.split(X, B):
            nb = x3.shape[1]
            out = codes[:, start: start + nb * x3.shape[2]].view(x3.shape)
            # scale = max |x| per block; b_i ~ Bernoulli(|x_i| / scale), code 1 + [x < 0] if b_i
            _, scale, _ = _blocks.scale_group(x3, keys, seeds, start, b0, B, 1, 2, out)
            self._check_finite(x3.reshape(m, -1), scale)
            v["scale"][:, b0: b0 + nb] = scale.view(m, nb)
        pack_bits(codes, 2, out=v["codes"])

    def _decode(self, v, numel, keys):
        m = v["scale"].shape[0]
        c = unpack_bits(v["codes"], 2, numel)
        lut = torch.tensor([0.0, 1.0, -1.0, 0.0], device=c.device)
        vals = lut[c.long()]
        B = _blocks.block_size(self.config.block, numel)
        outs = []
        for v3, start, b0 in _blocks.split(vals, B):
            nb = v3.shape[1]
            outs.append((v3 * v["scale"][:, b0: b0 + nb].reshape(m, nb, 1)).view(m, -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
