"""Packing b-bit unsigned codes (1 <= b <= 16) into bytes, batched over rows.

Layout: the codes of a row are concatenated LSB-first into one little-endian
bit stream; code ``j`` occupies stream bits ``[j*b, (j+1)*b)`` and stream bit
``k`` is bit ``k % 8`` of byte ``k // 8``. A row of ``n`` codes takes exactly
``ceil(n * b / 8)`` bytes; unused high bits of the last byte are zero. For
b = 8 this is the codes themselves, for b = 16 little-endian uint16, for b = 1
the LSB-first bit order of ``numpy.packbits(..., bitorder="little")``.

Works on any device; leading dimensions are batch dimensions.
"""

from __future__ import annotations

import torch

__all__ = ["pack_bits", "unpack_bits", "packed_nbytes"]


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes taken by ``n`` codes of ``bits`` bits: ``ceil(n * bits / 8)``."""
    _check_bits(bits)
    return (n * bits + 7) // 8


def _check_bits(bits) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 16:
        raise ValueError(f"bits must be an int in 1..16, got {bits!r}")


def _pad_last(x: torch.Tensor, to: int) -> torch.Tensor:
    n = x.shape[-1]
    if n == to:
        return x
    out = x.new_zeros(*x.shape[:-1], to)
    out[..., :n] = x
    return out


def pack_bits(codes: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack integer ``codes`` (..., n), each in ``[0, 2**bits)``, into uint8 (..., ceil(n*bits/8)).

    Codes are not range-checked (bits above ``bits`` are dropped). With ``out``, the
    bytes are written there (shape (..., ceil(n*bits/8)), uint8) and it is returned.
    """
    _check_bits(bits)
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise ValueError(f"pack_bits: codes must be an integer tensor, got {codes.dtype}")
    n = codes.shape[-1]
    lead = codes.shape[:-1]
    nbytes = packed_nbytes(n, bits)
    if bits == 8:
        res = codes.to(torch.uint8)
    elif bits == 16:
        res = codes.to(torch.int32).to(torch.int16).contiguous().view(torch.uint8)
    elif bits in (1, 2, 4):
        per = 8 // bits
        c = _pad_last(codes.to(torch.uint8), nbytes * per).view(*lead, nbytes, per)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
        c = c & ((1 << bits) - 1)
        res = (c << shifts).sum(dim=-1, dtype=torch.uint8)
    else:
        res = _pack_generic(codes, bits, n, lead, nbytes)
    if out is not None:
        out.copy_(res)
        return out
    return res


def _group_offsets(bits: int, device):
    j = torch.arange(8, dtype=torch.int64, device=device)
    return j * bits


def _pack_generic(codes, bits, n, lead, nbytes):
    # groups of 8 codes = `bits` bytes, assembled in two int64 words (128 bits)
    g = (n + 7) // 8
    c = _pad_last(codes.to(torch.int64) & ((1 << bits) - 1), 8 * g).view(*lead, g, 8)
    o = _group_offsets(bits, codes.device)
    lo_sh = torch.where(o < 64, o, torch.zeros_like(o))
    lo = torch.where(o < 64, c << lo_sh, torch.zeros_like(c)).sum(dim=-1)
    # bits of codes that cross or live above bit 64
    hi_part = torch.where(
        o >= 64, c << (o - 64).clamp(min=0),
        torch.where(o + bits > 64, c >> (64 - o).clamp(max=63), torch.zeros_like(c)),
    )
    hi = hi_part.sum(dim=-1)
    words = torch.stack((lo, hi), dim=-1)  # (..., g, 2)
    b = _le_bytes(words).reshape(*lead, g, 16)[..., :bits]
    return b.reshape(*lead, g * bits)[..., :nbytes]


def _le_bytes(words: torch.Tensor) -> torch.Tensor:
    """int64 words -> their little-endian bytes (..., 8), independent of host byte order."""
    sh = torch.arange(0, 64, 8, dtype=torch.int64, device=words.device)
    return ((words.unsqueeze(-1) >> sh) & 0xFF).to(torch.uint8)


def _from_le_bytes(b: torch.Tensor) -> torch.Tensor:
    sh = torch.arange(0, 64, 8, dtype=torch.int64, device=b.device)
    return (b.to(torch.int64) << sh).sum(dim=-1)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 (..., >= ceil(n*bits/8)) -> codes (..., n).

    Codes come back as uint8 for ``bits <= 8`` and int32 otherwise; for ``bits == 8``
    the result is a view of ``packed``.
    """
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_bits: packed must be uint8, got {packed.dtype}")
    nbytes = packed_nbytes(n, bits)
    if packed.shape[-1] < nbytes:
        raise ValueError(f"unpack_bits: {n} codes of {bits} bits need {nbytes} bytes, got {packed.shape[-1]}")
    lead = packed.shape[:-1]
    p = packed[..., :nbytes]
    if bits == 8:
        return p  # the bytes are the codes (a view: copy before writing to it)
    if bits == 16:
        pc = p.contiguous()
        lo = pc[..., 0::2].to(torch.int32)
        hi = pc[..., 1::2].to(torch.int32)
        return lo | (hi << 8)
    if bits in (1, 2, 4):
        per = 8 // bits
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        c = (p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        return c.reshape(*lead, nbytes * per)[..., :n]
    g = (n + 7) // 8
    b = _pad_last(p, g * bits).reshape(*lead, g, bits)
    b = _pad_last(b, 16).reshape(*lead, g, 2, 8)
    words = _from_le_bytes(b)  # (..., g, 2)
    lo, hi = words[..., 0:1], words[..., 1:2]
    o = _group_offsets(bits, packed.device)
    mask = (1 << bits) - 1
    # logical right shift of lo by o (o < 64), then the bits from hi
    lo_part = torch.where(o < 64, (lo >> o.clamp(max=63)) & ((1 << (64 - o.clamp(max=63))) - 1), torch.zeros_like(lo))
    hi_part = torch.where(
        o >= 64, hi >> (o - 64).clamp(min=0),
        torch.where(o + bits > 64, hi << (64 - o).clamp(min=0, max=63), torch.zeros_like(hi)),
    )
    c = (lo_part | hi_part) & mask
    out = c.reshape(*lead, g * 8)[..., :n]
    return out.to(torch.uint8) if bits <= 8 else out.to(torch.int32)
