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

import sys

import torch

__all__ = ["pack_bits", "unpack_bits", "packed_nbytes", "pack_planes", "unpack_planes", "planar_nbytes"]


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
        mask = (1 << bits) - 1
        res = c[..., 0] & mask
        for j in range(1, per):  # a few strided passes beat a reduction over a tiny dim
            res |= (c[..., j] & mask) << (j * bits)
    else:
        res = _pack_generic(codes, bits, n, lead, nbytes)
    if out is not None:
        out.copy_(res)
        return out
    return res


def _overlaps(bits: int):
    """(byte q, code j, shift) for every byte of a group of 8 codes and every code
    with bits in it; shift = bits * j - 8 * q (code bit 0 sits at byte bit shift)."""
    res = []
    for q in range(bits):
        for j in range(8):
            if bits * j < 8 * q + 8 and bits * j + bits > 8 * q:
                res.append((q, j, bits * j - 8 * q))
    return res


def _pack_generic(codes, bits, n, lead, nbytes):
    # a group of 8 codes is `bits` bytes; each byte gathers the (at most three) codes
    # that reach into it, so every step is one strided pass over 1/8 of the codes
    g = (n + 7) // 8
    c = _pad_last(codes.to(torch.int32), 8 * g).view(*lead, g, 8) & ((1 << bits) - 1)
    out = torch.empty(*lead, g, bits, dtype=torch.uint8, device=codes.device)
    acc = None
    for q, j, sh in _overlaps(bits) + [(bits, 0, 0)]:
        if acc is not None and (q != cur):
            out[..., cur] = acc & 0xFF
            acc = None
        if q == bits:
            break
        cur = q
        term = c[..., j] << sh if sh >= 0 else c[..., j] >> -sh
        acc = term if acc is None else acc.bitwise_or_(term)
    return out.view(*lead, g * bits)[..., :nbytes]


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
        c = torch.empty(*lead, nbytes, per, dtype=torch.uint8, device=packed.device)
        for j in range(per):
            torch.bitwise_right_shift(p, j * bits, out=c[..., j])
        c &= (1 << bits) - 1
        return c.view(*lead, nbytes * per)[..., :n]
    g = (n + 7) // 8
    b = _pad_last(p, g * bits).reshape(*lead, g, bits).to(torch.int32)
    mask = (1 << bits) - 1
    out = torch.empty(*lead, g, 8, dtype=torch.int32 if bits > 8 else torch.uint8, device=packed.device)
    terms: dict = {}
    for q, j, sh in _overlaps(bits):
        terms.setdefault(j, []).append((q, sh))
    for j in range(8):
        acc = None
        for q, sh in terms[j]:
            term = b[..., q] >> sh if sh >= 0 else b[..., q] << -sh
            acc = term if acc is None else acc.bitwise_or_(term)
        out[..., j] = acc & mask
    return out.view(*lead, g * 8)[..., :n]


# --------------------------------------------------------------------------------------
# Planar layout (quant, 1..8 bits): the codes of a block of n elements are split into
# 8 planes of N = ceil(n / 8) codes (code j * N + i is in plane j, column i; missing
# codes at the end count as 0). Column i's codes form the 8b-bit integer
# sum_j code(j * N + i) << (b * j), whose byte q is byte q * N + i of the packed
# block: b * N bytes in all. For b = 8 this is the codes themselves (n bytes, no
# padding). Packing and unpacking read and write contiguous runs (they vectorise),
# unlike the LSB-first stream above.
# --------------------------------------------------------------------------------------


def planar_nbytes(n: int, bits: int) -> int:
    """Bytes of ``n`` codes of ``bits`` (1..8) bits in the planar layout."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"planar layout: bits must be an int in 1..8, got {bits!r}")
    return n if bits == 8 else bits * ((n + 7) // 8)


def pack_planes(codes: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """Pack codes (..., n) in [0, 2**bits) into ``out`` (..., planar_nbytes(n, bits)) uint8."""
    n = codes.shape[-1]
    lead = codes.shape[:-1]
    if planar_nbytes(n, bits) != out.shape[-1]:
        raise ValueError(f"pack_planes: {n} codes of {bits} bits take {planar_nbytes(n, bits)} bytes, "
                         f"out has {out.shape[-1]}")
    if bits == 8:
        out.copy_(codes)
        return out
    N = (n + 7) // 8
    wide = torch.int32 if bits <= 4 else torch.int64
    c = _pad_last(codes.to(wide), 8 * N).view(*lead, 8, N) & ((1 << bits) - 1)
    word = c[..., 0, :].clone()
    for j in range(1, 8):
        word |= c[..., j, :] << (bits * j)
    o = out.view(*lead, bits, N)
    for q in range(bits):
        o[..., q, :] = (word >> (8 * q)) & 0xFF
    return out


def unpack_planes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_planes`: uint8 (..., planar_nbytes(n, bits)) -> uint8 codes (..., n)."""
    if packed.shape[-1] != planar_nbytes(n, bits):
        raise ValueError(f"unpack_planes: {n} codes of {bits} bits take {planar_nbytes(n, bits)} bytes, "
                         f"got {packed.shape[-1]}")
    if bits == 8:
        return packed
    lead = packed.shape[:-1]
    N = (n + 7) // 8
    wide = torch.int32 if bits <= 4 else torch.int64
    p = packed.reshape(*lead, bits, N).to(wide)
    word = p[..., 0, :].clone()
    for q in range(1, bits):
        word |= p[..., q, :] << (8 * q)
    out = torch.empty(*lead, 8, N, dtype=torch.uint8, device=packed.device)
    for j in range(8):
        out[..., j, :] = (word >> (bits * j)) & ((1 << bits) - 1)
    return out.view(*lead, 8 * N)[..., :n]
