"""Sign compressors with an L1 scale, for error feedback (biased).

- ``sign``: ``||v||_1 / d * sign(v)`` (Zheng et al. 2019, arXiv:1905.10936, eq. 1; Vogels et al. 2019 (arXiv:1905.13727) G.3 "Sign+Norm").
- ``blocksign``: Zheng et al. 2019 (arXiv:1905.10936) section 3.2, one scale ``||v_Gb||_1 / d_b`` per block ``G_b``.
  Blocks are given by their start offsets (``offsets=0/100/300``: blocks [0, 100),
  [100, 300), [300, d)), or by a fixed size (``block=256``); with neither, the whole
  vector is one block, which is ``sign``.

Signs travel as 1 bit each (1 = negative; zero counts as positive), scales as fp32.

Speed: encoding runs over the row in chunks of ``_CHUNK`` elements that stay in the
cache: ``|x|`` and ``x < 0`` (as 0/1 bytes) into per-thread scratch buffers, fp32 partial sums of
``|x|``, and the 8 sign bits of each byte gathered with one 64-bit multiply (the 8
0/1 bytes of a word times ``0x0102040810204080`` hold them in their top byte).
Decoding looks each sign byte up in a table of its 8 decoded values (``+-scale``,
one table per row), one ``index_select`` pass that writes the output once.

The scale ``||x_b||_1 / d_b`` is summed in two levels: fp32 sums of runs of
``_GROUP`` = 1024 consecutive ``|x|`` from the block's start (the last run of a
block shorter), then those partial sums added in order in float64. ATen reduces a
contiguous run of a given length the same way wherever it sits, so a row gives the
same bytes alone and in a batch; the relative error is about 1e-7 (fp32 over 1024
values), and the last bit may differ between CPU types (vector widths) and CUDA.

Both are contractions: per block of B values ``||C(x) - x||^2 = ||x||^2 - ||x||_1^2 / B``,
so delta = min over blocks of ``||x_b||_1^2 / (B ||x_b||^2)``, at least ``1 / B`` (one
non-zero value) and about ``2 / pi`` for Gaussian-like vectors; the declared
``delta(numel)`` is the guaranteed ``1 / (largest block)``.
"""

from __future__ import annotations

import dataclasses

import torch

from . import _blocks, _scratch
from .base import Compressor, Config
from .bitpack import packed_nbytes
from .registry import register
from .wire import Layout

__all__ = ["Sign", "BlockSign", "BlockSignConfig"]

_GROUP = 1024  # |x| values per fp32 partial sum of a scale
_CHUNK = 1 << 18  # elements (rows x columns) per step of the chunked loops (1.5 MiB of scratch)
_MAGIC = 0x0102040810204080  # (8 bytes of 0/1) * _MAGIC: their bits in the top byte, byte j -> bit j
_TABLES: dict = {}  # device -> (256, 8) fp32: the signs +-1 of each byte's 8 values


def _sign_table(device) -> torch.Tensor:
    t = _TABLES.get(device)
    if t is None:
        bits = (torch.arange(256).view(-1, 1) >> torch.arange(8)) & 1
        t = _TABLES[device] = (1 - 2 * bits).to(torch.float32).to(device)
    return t


def _partial_sums(a: torch.Tensor, out: torch.Tensor) -> None:
    """fp32 sums of runs of _GROUP values of ``a`` (..., n) from its start (the last run
    shorter) into ``out`` (..., ceil(n / _GROUP))."""
    n = a.shape[-1]
    q = n // _GROUP
    if q:
        torch.sum(a[..., : q * _GROUP].unflatten(-1, (q, _GROUP)), -1, out=out[..., :q])
    if n % _GROUP:
        torch.sum(a[..., q * _GROUP:], -1, out=out[..., q])


def _ordered_total(parts: torch.Tensor) -> torch.Tensor:
    """Partial sums (..., P) fp32 added in index order in float64: (...) float64."""
    cs = _scratch.buffer("sign.cumsum", parts.numel(), torch.float64, parts.device).view(parts.shape)
    cs.copy_(parts)  # (a cumsum with a dtype would convert into a temporary)
    cs.cumsum_(-1)
    return cs[..., -1]


def _block_l1(x3: torch.Tensor) -> torch.Tensor:
    """Per-block L1 norms (m, nb) float64 of x3 (m, nb, B), summed as described above."""
    m, nb, B = x3.shape
    parts = torch.empty(m, nb, -(-B // _GROUP), dtype=torch.float32, device=x3.device)
    _partial_sums(x3.abs(), parts)
    return _ordered_total(parts)


def _encode_chunks(X: torch.Tensor, signs: torch.Tensor, parts: torch.Tensor | None) -> None:
    """Sign bits of X (m, d) into ``signs`` (m, ceil(d / 8)) uint8 and, if ``parts`` is
    given, the fp32 partial sums of |x| per run of _GROUP (m, ceil(d / _GROUP)); in
    cache-sized chunks of rows x columns (columns a multiple of _GROUP unless a row fits)."""
    m, d = X.shape
    dev = X.device
    cols = d if d <= _CHUNK else _CHUNK
    rows = max(1, _CHUNK // cols)
    cpad = -(-cols // 8) * 8
    neg = _scratch.buffer("sign.neg", rows * cpad, torch.uint8, dev)
    # x < 0 as fp32 0/1 (ATen's comparisons vectorise for a 32-bit output of the input's
    # dtype, not for bool or uint8 ones, and other output dtypes take a temporary), whose
    # bits >> 29 are the int32 0/1, then narrowed to bytes: about twice as fast as a bool
    # output. The flags reuse the |x| buffer once its sums are taken.
    absx = _scratch.buffer("sign.abs", rows * cols, torch.float32, dev)
    words = _scratch.buffer("sign.words", rows * cpad // 8, torch.int64, dev)
    for r0 in range(0, m, rows):
        rr = min(rows, m - r0)
        for a in range(0, d, cols):
            n = min(cols, d - a)
            npad = -(-n // 8) * 8
            xc = X[r0: r0 + rr, a: a + n]
            if parts is not None:
                av = absx[: rr * n].view(rr, n)
                torch.abs(xc, out=av)
                _partial_sums(av, parts[r0: r0 + rr, a // _GROUP:])
            nv = neg[: rr * npad].view(rr, npad)
            f = absx[: rr * n].view(rr, n)
            torch.lt(xc, 0, out=f)
            n32 = f.view(torch.int32)
            torch.bitwise_right_shift(n32, 29, out=n32)  # 1.0f = 0x3F800000 -> 1
            nv[:, :n].copy_(n32)
            if npad > n:
                nv[:, n:] = 0  # the unused high bits of a row's last byte are zero
            w = words[: rr * npad // 8]
            torch.mul(neg[: rr * npad].view(torch.int64), _MAGIC, out=w)
            signs[r0: r0 + rr, a // 8: a // 8 + npad // 8].copy_(w.view(torch.uint8).view(rr, npad // 8, 8)[..., 7])


def _decode_chunks(signs: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """out (m, d) = scale[r] * (+-1 per sign bit), by table lookup per byte."""
    m, d = out.shape
    dev = out.device
    T = _sign_table(dev)
    d8 = d // 8  # whole bytes; the last d % 8 values are done apart
    if d8:
        cols = min(d8, _CHUNK // 8)
        rows = max(1, min(64, _CHUNK // 8 // cols))
        tab = _scratch.buffer("sign.table", rows * 256 * 8, torch.float32, dev).view(rows, 256, 8)
        idx = _scratch.buffer("sign.index", rows * cols, torch.int64, dev)
        off = torch.arange(0, rows * 256, 256, dtype=torch.int64, device=dev).view(rows, 1)
        tmp = None
        for r0 in range(0, m, rows):
            rr = min(rows, m - r0)
            t = tab[:rr]
            torch.mul(T, scale[r0: r0 + rr].view(rr, 1, 1), out=t)
            for c0 in range(0, d8, cols):
                nb = min(cols, d8 - c0)
                iv = idx[: rr * nb].view(rr, nb)
                iv.copy_(signs[r0: r0 + rr, c0: c0 + nb])  # (an add with a cast would take a temporary)
                if rr > 1:
                    iv.add_(off[:rr])  # row r's table starts at 256 r
                dst = out[r0: r0 + rr, c0 * 8: (c0 + nb) * 8]
                if dst.is_contiguous():
                    torch.index_select(t.view(rr * 256, 8), 0, iv.view(-1), out=dst.view(rr * nb, 8))
                else:
                    if tmp is None:
                        tmp = _scratch.buffer("sign.rows", rows * cols * 8, torch.float32, dev)
                    tv = tmp[: rr * nb * 8].view(rr * nb, 8)
                    torch.index_select(t.view(rr * 256, 8), 0, iv.view(-1), out=tv)
                    dst.copy_(tv.view(rr, nb * 8))
    r = d - d8 * 8
    if r:
        last = T.index_select(0, signs[:, d8].to(torch.int64))[:, :r]
        torch.mul(last, scale.view(m, 1), out=out[:, d8 * 8:])


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSignConfig(Config):
    """Options of ``blocksign``: the blocks, by start ``offsets`` or a fixed ``block`` size.

    ``offsets`` start at 0 and increase strictly; neither given: one block per row."""

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
    """Blockwise sign: 1 bit per value and one scale per block.

    The scale is the block's mean absolute value (biased, a delta-contraction)."""

    name = "blocksign"
    cid = 8
    description = "blockwise sign with one L1 scale per block (Zheng et al. 2019, arXiv:1905.10936, sec. 3.2), 1 bit per value, biased"
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

    def code_bits(self, numel: int) -> float:
        return 1.0  # one sign bit a value (the scales are side information)

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
            scale = _blocks.divide(_block_l1(x3), B).to(torch.float32)
            self._check_finite(x3.reshape(m, -1), scale)
            v["scale"][:, b0: b0 + nb] = scale
        _encode_chunks(X, v["signs"], None)

    def _decode_into(self, v, numel, keys, out):
        m = v["scale"].shape[0]
        _decode_chunks(v["signs"], torch.ones(m, dtype=torch.float32, device=out.device), out)
        for o3, b0 in self._groups(out):
            nb = o3.shape[1]
            o3.mul_(v["scale"][:, b0: b0 + nb].reshape(m, nb, 1))


@register
class Sign(BlockSign):
    """Scaled sign, ||x||_1 / d * sign(x): ``blocksign`` with one block per row."""

    name = "sign"
    cid = 7
    description = "||v||_1/d * sign(v) (Zheng et al. 2019, arXiv:1905.10936, eq. 1, Vogels et al. 2019 (arXiv:1905.13727) Sign+Norm), 1 bit per value, biased"
    Config = dataclasses.make_dataclass("SignConfig", [], bases=(Config,), frozen=True, kw_only=True)

    def _bounds(self, numel: int) -> list[tuple[int, int]]:
        return [(0, numel)]

    def _groups(self, X):
        yield X.view(X.shape[0], 1, X.shape[1]), 0

    def _encode(self, X, keys, v):
        # one pass over X in cache-sized chunks: partial L1 sums and sign bits together
        m, d = X.shape
        parts = _scratch.buffer("sign.parts", m * -(-d // _GROUP), torch.float32, X.device).view(m, -1)
        _encode_chunks(X, v["signs"], parts)
        scale = (_ordered_total(parts) / d).to(torch.float32)
        self._check_finite(X, scale)
        v["scale"].copy_(scale.view(m, 1))

    def _decode_into(self, v, numel, keys, out):
        _decode_chunks(v["signs"], v["scale"].reshape(-1), out)
