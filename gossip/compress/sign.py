"""Sign compressors with an L1 scale, for error feedback (biased).

- ``sign``: ``||v||_1 / d * sign(v)`` (papers/000 eq. 1; papers/001 G.3 "Sign+Norm").
- ``blocksign``: papers/000 section 3.2, one scale ``||v_Gb||_1 / d_b`` per block ``G_b``.
  Blocks are given by their start offsets (``offsets=0/100/300``: blocks [0, 100),
  [100, 300), [300, d)), or by a fixed size (``block=256``); with neither, the whole
  vector is one block, which is ``sign``.

Signs travel as 1 bit each (1 = negative; zero counts as positive), scales as fp32.

Both are contractions: per block of B values ``||C(x) - x||^2 = ||x||^2 - ||x||_1^2 / B``,
so delta = min over blocks of ``||x_b||_1^2 / (B ||x_b||^2)``, at least ``1 / B`` (one
non-zero value) and about ``2 / pi`` for Gaussian-like vectors; the declared
``delta(numel)`` is the guaranteed ``1 / (largest block)``.
"""

from __future__ import annotations

import dataclasses

import torch

from . import _blocks
from .base import Compressor, Config
from .bitpack import pack_bits, packed_nbytes, unpack_bits
from .registry import register
from .wire import Layout

__all__ = ["Sign", "BlockSign", "BlockSignConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSignConfig(Config):
    offsets: tuple[int, ...] | None = None  # block start offsets, first 0, strictly increasing
    block: int | None = None  # or: fixed block size

    def __post_init__(self):
        if self.offsets is not None and self.block is not None:
            raise ValueError(f"{type(self)._compressor_name}: give `offsets` or `block`, not both")
        if self.offsets is not None:
            try:
                offs = tuple(int(o) for o in self.offsets)
            except (TypeError, ValueError):
                self._fail("offsets", "must be a sequence of integers")
            if any(isinstance(o, bool) or int(o) != o for o in self.offsets):
                self._fail("offsets", "must be a sequence of integers")
            if not offs or offs[0] != 0 or any(b <= a for a, b in zip(offs, offs[1:])):
                self._fail("offsets", "must start at 0 and increase strictly")
            object.__setattr__(self, "offsets", offs)
        b = self.block
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            self._fail("block", "must be a positive integer (elements per block)")


@register
class BlockSign(Compressor):
    name = "blocksign"
    cid = 8
    description = "blockwise sign with one L1 scale per block (papers/000 sec. 3.2), 1 bit per value, biased"
    unbiased = False
    linear = False
    contractive = True
    Config = BlockSignConfig

    def delta(self, numel: int) -> float:
        return 1.0 / max(b - a for a, b in self._bounds(self._check_numel(numel)))

    def _bounds(self, numel: int) -> list[tuple[int, int]]:
        cfg = self.config
        if cfg.offsets is not None:
            if cfg.offsets[-1] >= numel:
                raise ValueError(
                    f"{self.name}: the last block offset {cfg.offsets[-1]} must be below numel={numel}"
                )
            starts = list(cfg.offsets)
        else:
            B = _blocks.block_size(cfg.block, numel)
            starts = list(range(0, numel, B))
        return list(zip(starts, starts[1:] + [numel]))

    def layout(self, numel: int) -> Layout:
        nb = len(self._bounds(numel))
        return Layout((("scale", torch.float32, nb), ("signs", torch.uint8, packed_nbytes(numel, 1))))

    def ideal_nbytes(self, numel: int) -> float:
        return (self._check_numel(numel) + 32 * len(self._bounds(numel))) / 8

    def _groups(self, X):
        """Yield (x3 (m, nb, B), first block) over runs of equal-size blocks."""
        m, d = X.shape
        if self.config.offsets is None:
            B = _blocks.block_size(self.config.block, d)
            for x3, start, b0 in _blocks.split(X, B):
                yield x3, b0
        else:
            for b0, (a, b) in enumerate(self._bounds(d)):
                yield X[:, a:b].reshape(m, 1, b - a), b0

    def _encode(self, X, keys, v):
        m, d = X.shape
        for x3, b0 in self._groups(X):
            nb, B = x3.shape[1], x3.shape[2]
            # L1 per block in a fixed summation order (same bytes in any batch)
            l1 = _blocks.ordered_sum(x3.abs())
            scale = (l1 / B).to(torch.float32)
            self._check_finite(x3.reshape(m, -1), scale)
            v["scale"][:, b0: b0 + nb] = scale
        pack_bits((X < 0).to(torch.uint8), 1, out=v["signs"])

    def _decode(self, v, numel, keys):
        m = v["scale"].shape[0]
        neg = unpack_bits(v["signs"], 1, numel)
        out = torch.empty(m, numel, dtype=torch.float32, device=neg.device)
        torch.mul(neg, -2.0, out=out).add_(1.0)  # 1 - 2 * negative
        for o3, b0 in self._groups(out):
            nb = o3.shape[1]
            o3.mul_(v["scale"][:, b0: b0 + nb].reshape(m, nb, 1))
        return out


@register
class Sign(BlockSign):
    name = "sign"
    cid = 7
    description = "||v||_1/d * sign(v) (papers/000 eq. 1, papers/001 Sign+Norm), 1 bit per value, biased"
    Config = dataclasses.make_dataclass("SignConfig", [], bases=(Config,), frozen=True, kw_only=True)

    def _bounds(self, numel: int) -> list[tuple[int, int]]:
        return [(0, numel)]

    def _groups(self, X):
        yield X.view(X.shape[0], 1, X.shape[1]), 0
