"""``quant``: stochastic uniform quantization with b bits per value (Tang et al. 2018 (arXiv:1803.06443), footnote 1).

Per block, 2**b levels evenly spread over the block's [min, max]; a value rounds to
one of its two neighbouring levels with the probabilities that make it unbiased.
Variance: with ``L = 2**b - 1`` levels and blocks of at most ``B`` values, each value
adds at most ``step^2 / 4`` and ``(max - min)^2 <= 2 ||x_b||^2``, so
``E||Q(x) - x||^2 <= B / (2 L^2) ||x||^2`` (``omega``; ``(1, -1, 0, ..., 0)`` reaches
``(B - 2) / (2 L^2)``).
Body: fp32 ``min`` per block, fp32 ``step = (max - min) / (2**b - 1)`` per block,
then the codes. For b <= 8 the codes are packed in the planar layout
(gossip.compress.bitpack.pack_planes: b * ceil(n / 8) bytes for n codes, n bytes
for b = 8), so that rounding and packing run in one vectorised pass: block by
block (then the last, shorter block) when the block size is a multiple of 8, else
the whole row at once. For b > 8 the row's codes are one LSB-first bit stream
(pack_bits).
"""

from __future__ import annotations

import dataclasses

import torch

from . import _blocks, _random as R
from .base import Compressor, Config
from .bitpack import pack_bits, pack_planes, packed_nbytes, planar_nbytes, unpack_bits, unpack_planes
from . import _kernels
from .registry import register
from .wire import Layout

__all__ = ["Quant", "QuantConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantConfig(Config):
    """Options of ``quant``: ``bits`` per value (1..16) and the ``block`` size (None: the whole row)."""

    bits: int = 8
    block: int | None = None  # elements per block; None = the whole row

    def __post_init__(self):
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= 16:
            self._fail("bits", "must be an integer in 1..16")
        _blocks.check_block(self)


@register
class Quant(Compressor):
    """Stochastic uniform quantization with 2**bits levels over each block's [min, max].

    Each value is rounded up or down with the probabilities that make it unbiased (see
    the module)."""

    name = "quant"
    cid = 3
    description = "stochastic uniform quantizer, 2**bits levels over each block's [min, max], unbiased"
    unbiased = True
    linear = False
    Config = QuantConfig

    @property
    def levels(self) -> int:
        return (1 << self.config.bits) - 1

    def _per_block(self, numel: int) -> bool:
        """Whether the codes are packed block by block (else as one stream per row)."""
        return self.config.bits <= 8 and _blocks.block_size(self.config.block, numel) % 8 == 0

    def _codes_nbytes(self, numel: int) -> int:
        bits = self.config.bits
        if not self._per_block(numel):
            return packed_nbytes(numel, bits) if bits > 8 else planar_nbytes(numel, bits)
        B = _blocks.block_size(self.config.block, numel)
        nb, tail = divmod(numel, B)
        return nb * planar_nbytes(B, bits) + (planar_nbytes(tail, bits) if tail else 0)

    def layout(self, numel: int) -> Layout:
        nb = _blocks.nblocks(self.config.block, numel)
        return Layout((("lo", torch.float32, nb), ("step", torch.float32, nb),
                       ("codes", torch.uint8, self._codes_nbytes(numel))))

    def ideal_nbytes(self, numel: int) -> float:
        numel = self._check_numel(numel)
        return (numel * self.config.bits + 64 * _blocks.nblocks(self.config.block, numel)) / 8

    def code_bits(self, numel: int) -> float:
        return float(self.config.bits)  # the code width (the scales are side information)

    def omega(self, numel: int) -> float:
        B = _blocks.block_size(self.config.block, self._check_numel(numel))
        return B / (2.0 * self.levels**2)

    def _groups(self, d: int):
        """(start, first block, blocks, block size, byte offset of its codes) per group of
        blocks: the full blocks, then the last, shorter one (byte offsets: per-block packing)."""
        B = _blocks.block_size(self.config.block, d)
        nb, tail = divmod(d, B)
        res = [(0, 0, nb, B, 0)] if nb else []
        if tail:
            res.append((nb * B, nb, 1, tail, nb * planar_nbytes(B, min(self.config.bits, 8))))
        return res

    def _encode(self, X, keys, v):
        m, d = X.shape
        bits, L = self.config.bits, self.levels
        seeds = R.stream_seeds(keys, R.STREAM_ROUND)
        per_block = self._per_block(d)
        row = None  # the codes of the row, when they are packed as one stream
        if not per_block:
            row = torch.empty(m, d, dtype=torch.int32 if bits > 8 else torch.uint8, device=X.device)
        for start, b0, nb, B, off in self._groups(d):
            x3 = X[:, start: start + nb * B].view(m, nb, B)
            # Step 1: the block's [min, max]; Step 2: t = (x - min) * inv in [0, L] is
            # rounded up or down without bias; Step 3: the codes are packed (all in one
            # pass when compiled)
            if not per_block:
                lo, rng, _ = _blocks.scale_group(x3, keys, seeds, start, b0, B, L, 0,
                                                 row[:, start: start + nb * B].view(m, nb, B))
            else:
                out = v["codes"][:, off: off + nb * planar_nbytes(B, bits)].view(m, nb, -1)
                if bits == 8:  # 8-bit codes are the payload bytes: round straight into the payload
                    lo, rng, _ = _blocks.scale_group(x3, keys, seeds, start, b0, B, L, 0, out)
                elif _kernels.planar_wanted(bits, B, x3.numel(), X.device):
                    lo, rng, _ = _kernels.quant_planar_encode(x3, keys, seeds, start, bits, out)
                else:  # rounding and packing chunk by chunk
                    lo, rng, _ = _kernels.quant_planar_encode_eager(x3, keys, seeds, start, bits, out)
            self._check_finite(x3.reshape(m, -1), rng)  # NaN/inf show up in the range
            # the scales that travel
            v["lo"][:, b0: b0 + nb] = lo.view(m, nb)
            v["step"][:, b0: b0 + nb] = _blocks.divide(rng, L).view(m, nb)  # the same bytes on CUDA
        if row is not None:
            if bits > 8:
                pack_bits(row, bits, out=v["codes"])
            else:
                pack_planes(row, bits, v["codes"])

    def _decode_into(self, v, numel, keys, out):
        m = v["lo"].shape[0]
        bits = self.config.bits
        per_block = self._per_block(numel)
        row = None
        if not per_block:
            row = unpack_bits(v["codes"], bits, numel) if bits > 8 else unpack_planes(v["codes"], bits, numel)
        for start, b0, nb, B, off in self._groups(numel):
            a = v["lo"][:, b0: b0 + nb].reshape(m, nb, 1)
            s = v["step"][:, b0: b0 + nb].reshape(m, nb, 1)
            o3 = out[:, start: start + nb * B].view(m, nb, B)
            if row is not None:
                c3 = row[:, start: start + nb * B].view(m, nb, B)
            else:
                p3 = v["codes"][:, off: off + nb * planar_nbytes(B, bits)].view(m, nb, -1)
                if bits < 8:
                    if _kernels.planar_wanted(bits, B, o3.numel(), out.device):
                        _kernels.quant_planar_decode(p3, a, s, bits, o3)
                    else:  # unpacking and the affine map chunk by chunk
                        _kernels.quant_planar_decode_eager(p3, a, s, bits, o3)
                    continue
                c3 = p3  # 8-bit codes are the payload bytes
            k = _kernels.AFFINE.variant((c3.dtype,))
            _kernels.run(k, c3.numel(), c3, a, s, o3)
