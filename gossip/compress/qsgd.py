"""``qsgd``: QSGD (Alistarh et al. 2017), the quantizer of Tang et al.'s (2018, arXiv:1803.06443) 8-bit runs.

Per block, ``t_i = |x_i| / ||x||_2 * s`` is rounded stochastically to an integer
level in ``0..s`` (unbiased), and sent with the sign bit. Body: the fp32 norm per
block, then codes ``2 * level + [x < 0]`` packed ``1 + ceil(log2(s + 1))`` bits
each. Variance: ``E||Q(x) - x||^2 <= min(d / s^2, sqrt(d) / s) ||x||^2`` per block.
"""

from __future__ import annotations

import dataclasses

import torch

from . import _blocks, _random as R
from .base import Compressor, Config
from .bitpack import pack_bits, packed_nbytes, unpack_bits
from .registry import register
from .wire import Layout

__all__ = ["QSGD", "QSGDConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class QSGDConfig(Config):
    """Options of ``qsgd``: ``levels`` s (1..32767) and the ``block`` size (None: the whole row)."""

    levels: int = 16  # s: quantization levels of |x_i| / ||x||
    block: int | None = None  # elements per block; None = the whole row

    def __post_init__(self):
        s = self.levels
        if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= 32767:
            self._fail("levels", "must be an integer in 1..32767 (codes of at most 16 bits)")
        _blocks.check_block(self)


@register
class QSGD(Compressor):
    """QSGD: s levels of |x_i| / ||x||_2 per block, a sign bit, stochastic rounding.

    Each |x_i| / ||x||_2 * s is rounded to one of the s + 1 levels so that the result is
    unbiased; the block's fp32 norm is sent with the codes (see the module)."""

    name = "qsgd"
    cid = 4
    description = "QSGD: s levels of |x_i|/||x||_2 per block plus a sign bit, stochastic rounding, unbiased"
    unbiased = True
    linear = False
    Config = QSGDConfig

    @property
    def bits(self) -> int:
        return 1 + self.config.levels.bit_length()

    def layout(self, numel: int) -> Layout:
        nb = _blocks.nblocks(self.config.block, numel)
        return Layout((("norm", torch.float32, nb), ("codes", torch.uint8, packed_nbytes(numel, self.bits))))

    def ideal_nbytes(self, numel: int) -> float:
        numel = self._check_numel(numel)
        return (numel * self.bits + 32 * _blocks.nblocks(self.config.block, numel)) / 8

    def omega(self, numel: int) -> float:
        B = _blocks.block_size(self.config.block, self._check_numel(numel))
        s = self.config.levels
        return min(B / s**2, B**0.5 / s)

    def _encode(self, X, keys, v):
        m, d = X.shape
        s = self.config.levels
        B = _blocks.block_size(self.config.block, d)
        seeds = R.stream_seeds(keys, R.STREAM_ROUND)
        codes = torch.empty(m, d, dtype=torch.uint8 if self.bits <= 8 else torch.int32, device=X.device)
        for x3, start, b0 in _blocks.split(X, B):
            nb = x3.shape[1]
            # Step 1: the block norms, summed in a fixed order (identical bytes in any batch)
            norm = _blocks.ordered_sum(x3.to(torch.float64).square_()).sqrt_().to(torch.float32).view(m, nb, 1)
            self._check_finite(x3.reshape(m, -1), norm)
            # Step 2: level = round(|x| / norm * s) without bias, code = 2 * level + sign
            inv = _blocks.safe_inverse(float(s), norm)
            out = codes[:, start: start + nb * x3.shape[2]].view(x3.shape)
            _blocks.round_group(x3, torch.zeros_like(norm), inv, keys, seeds, start, b0, B, s, 1, out)
            v["norm"][:, b0: b0 + nb] = norm.view(m, nb)
        pack_bits(codes, self.bits, out=v["codes"])

    def _decode(self, v, numel, keys):
        m = v["norm"].shape[0]
        c = unpack_bits(v["codes"], self.bits, numel).to(torch.int32)
        B = _blocks.block_size(self.config.block, numel)
        vals = (c >> 1).to(torch.float32).mul_(1 - 2 * (c & 1).to(torch.float32))
        outs = []
        for v3, start, b0 in _blocks.split(vals, B):
            nb = v3.shape[1]
            step = v["norm"][:, b0: b0 + nb].reshape(m, nb, 1) / self.config.levels
            outs.append((v3 * step).view(m, -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
