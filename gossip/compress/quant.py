"""``quant``: stochastic uniform quantization with b bits per value (papers/002, footnote 1).

Per block, 2**b levels evenly spread over the block's [min, max]; a value rounds to
one of its two neighbouring levels with the probabilities that make it unbiased.
Variance: with ``L = 2**b - 1`` levels and blocks of at most ``B`` values, each value
adds at most ``step^2 / 4`` and ``(max - min)^2 <= 2 ||x_b||^2``, so
``E||Q(x) - x||^2 <= B / (2 L^2) ||x||^2`` (``omega``; ``(1, -1, 0, ..., 0)`` reaches
``(B - 2) / (2 L^2)``).
Body: fp32 ``min`` per block, fp32 ``step = (max - min) / (2**b - 1)`` per block,
then the codes packed b bits each (gossip.compress.bitpack).
"""

from __future__ import annotations

import dataclasses

import torch

from . import _blocks, _random as R
from .base import Compressor, Config
from .bitpack import pack_bits, packed_nbytes, unpack_bits
from . import _kernels
from .registry import register
from .wire import Layout

__all__ = ["Quant", "QuantConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantConfig(Config):
    bits: int = 8
    block: int | None = None  # elements per block; None = the whole row

    def __post_init__(self):
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= 16:
            self._fail("bits", "must be an integer in 1..16")
        _blocks.check_block(self)


@register
class Quant(Compressor):
    name = "quant"
    cid = 3
    description = "stochastic uniform quantizer, 2**bits levels over each block's [min, max], unbiased"
    unbiased = True
    linear = False
    Config = QuantConfig

    @property
    def levels(self) -> int:
        return (1 << self.config.bits) - 1

    def layout(self, numel: int) -> Layout:
        nb = _blocks.nblocks(self.config.block, numel)
        return Layout((("lo", torch.float32, nb), ("step", torch.float32, nb),
                       ("codes", torch.uint8, packed_nbytes(numel, self.config.bits))))

    def ideal_nbytes(self, numel: int) -> float:
        numel = self._check_numel(numel)
        return (numel * self.config.bits + 64 * _blocks.nblocks(self.config.block, numel)) / 8

    def omega(self, numel: int) -> float:
        B = _blocks.block_size(self.config.block, self._check_numel(numel))
        return B / (2.0 * self.levels**2)

    def _encode(self, X, keys, v):
        m, d = X.shape
        bits, L = self.config.bits, self.levels
        B = _blocks.block_size(self.config.block, d)
        seeds = R.stream_seeds(keys, R.STREAM_ROUND)
        # 8-bit codes are the payload bytes: round straight into the payload
        codes = v["codes"] if bits == 8 else torch.empty(m, d, dtype=torch.uint8 if bits < 8 else torch.int32,
                                                          device=X.device)
        for x3, start, b0 in _blocks.split(X, B):
            nb = x3.shape[1]
            out = codes[:, start: start + nb * x3.shape[2]].view(x3.shape)
            # Step 1: the block's [min, max]; Step 2: t = (x - min) * inv in [0, L] is
            # rounded up or down without bias (both in one pass when compiled)
            lo, rng, _ = _blocks.scale_group(x3, keys, seeds, start, b0, B, L, 0, out)
            self._check_finite(x3.reshape(m, -1), rng)  # NaN/inf show up in the range
            # Step 3: the scales that travel
            v["lo"][:, b0: b0 + nb] = lo.view(m, nb)
            v["step"][:, b0: b0 + nb] = (rng / L).view(m, nb)
        if bits != 8:
            pack_bits(codes, bits, out=v["codes"])

    def _decode(self, v, numel, keys):
        m = v["lo"].shape[0]
        codes = unpack_bits(v["codes"], self.config.bits, numel)
        B = _blocks.block_size(self.config.block, numel)
        lo, step = v["lo"], v["step"]
        outs = []
        for c3, start, b0 in _blocks.split(codes, B):
            nb = c3.shape[1]
            a = lo[:, b0: b0 + nb].reshape(m, nb, 1)
            s = step[:, b0: b0 + nb].reshape(m, nb, 1)
            k = _kernels.AFFINE.variant((c3.dtype,))
            outs.append(_kernels.run(k, c3.numel(), c3, a, s).view(m, -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
