"""Counter-based randomness derived from int64 row keys.

Every random bit a compressor uses is a pure function of (row key, stream,
element index), so a row encodes to the same bytes alone or inside a batch, on
any device, with or without the compiled fast path.

The generator is SplitMix64 (Steele, Lea and Flood, OOPSLA 2014) used in
counter mode: word ``j`` of a stream seeded with ``s`` is
``mix64(s + (j + 1) * GAMMA)``, where ``mix64`` is SplitMix64's output
function. A stream seed is ``mix64(key ^ (STREAM_BASE * (stream + 1)))``.

The lazily drawn tie-breaking digits of stochastic rounding (``digits``,
``digits_at``) give element ``i`` the 32-bit half ``i % 2`` (low half first) of
word ``i // 2``.

The quantizers' first rounding digit of element ``i`` (24 bits, one per element
and encode, so the one drawn most) comes from a cheaper counter-based hash on
32-bit integers, ``hash24``: with the row's stream seed split into two 32-bit
halves ``(s1, s2)``, ``h = lowbias32'(i + s1, s2)`` (below) and the digit is
``h >> 8``, its top 24 bits. For a fixed seed, ``i -> h`` is a bijection of the
32-bit integers, and ``s1`` is uniform when the key is, so every element's digit
is exactly uniform over ``[0, 2**24)`` (the marginal is all that unbiasedness and
the variance bound use); the hash is C. Wellons' two-multiply ``lowbias32``
(constants 0x21f0aaad, 0x735a2d97, shifts 16/15/15, published avalanche bias
about 0.11, measured there without our extra xor) with ``s2`` xored in between
its rounds, so that two rows whose ``s1`` happen
to be close are not shifted copies of each other. tests/test_compress_random.py
checks uniformity, independence of neighbours, keys and digit bits.

Everything is written with int64 tensor ops (two's-complement wrap-around for
multiplication, explicit masks to turn arithmetic right shifts into logical
ones), so the same integer results come out of eager mode, torch.compile and
CUDA.
"""

from __future__ import annotations

import torch

__all__: list[str] = []  # private module


def _s64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= (1 << 63) else c


GAMMA = _s64(0x9E3779B97F4A7C15)
_M1 = _s64(0xBF58476D1CE4E5B9)
_M2 = _s64(0x94D049BB133111EB)
_MASK32 = 0xFFFFFFFF

# Stream constants: independent random streams per purpose for the same key.
STREAM_ROUND = 0  # first digit of stochastic rounding
STREAM_SAMPLE = 1  # index sampling (randk, randomk, randomblock)
STREAM_TIE = 2  # extra digits for rounding ties, levels 2, 3, ... use 2 + level - 1
_STREAM_BASE = _s64(0xD1B54A32D192ED03)


def _lsr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 by a constant 0 < s < 64."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function on int64 tensors (a bijection of 64-bit words)."""
    z = (z ^ _lsr(z, 30)) * _M1
    z = (z ^ _lsr(z, 27)) * _M2
    return z ^ _lsr(z, 31)


def _mix64_int(z: int) -> int:
    z &= (1 << 64) - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return _s64(z ^ (z >> 31))


_H1 = 0x21F0AAAD  # lowbias32 multipliers (C. Wellons, "hash prospector", 2020)
_H2 = 0x735A2D97


def seeds32(seeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 32-bit halves (s1, s2) of int64 stream seeds, as int32 tensors of the same shape."""
    lo = ((seeds & _MASK32) ^ (1 << 31)) - (1 << 31)  # the low half as a signed 32-bit value
    hi = seeds >> 32  # arithmetic shift: already in int32 range
    return lo.to(torch.int32), hi.to(torch.int32)


def hash24(idx: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """First rounding digits: 24-bit uniform integers (int32) of element indices ``idx``
    (int32) for seed halves ``s1``, ``s2`` (int32, broadcast against ``idx``).

    int32 arithmetic wraps modulo 2**32 (two's complement); right shifts are made
    logical with masks. The same integers come out of eager mode and torch.compile.
    """
    return (hash32(idx, s1, s2) >> 8) & 0xFFFFFF


def hash32(idx: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """The whole 32-bit hash (int32) behind :func:`hash24`: add, xorshift, odd multiply,
    xor, xorshift, odd multiply, xorshift; each step is a bijection of 32-bit words."""
    h = idx + s1
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _H1
    h = h ^ s2
    h = h ^ ((h >> 15) & 0x1FFFF)
    h = h * _H2
    return h ^ ((h >> 15) & 0x1FFFF)


def stream_seeds(keys: torch.Tensor, stream: int) -> torch.Tensor:
    """Per-row seed of one stream: ``mix64(key ^ (STREAM_BASE * (stream + 1)))``."""
    c = ((_STREAM_BASE & ((1 << 64) - 1)) * (stream + 1)) & ((1 << 64) - 1)
    if keys.numel() <= 16 and keys.device.type == "cpu":  # a few rows: plain ints are faster
        return torch.tensor([_mix64_int(k ^ c) for k in keys.tolist()], dtype=torch.int64)
    return mix64(keys.to(torch.int64) ^ _s64(c))


def words(seeds: torch.Tensor, nwords: int, offset: int = 0) -> torch.Tensor:
    """64-bit words ``offset .. offset+nwords-1`` of each row's stream: (m, nwords) int64."""
    j = torch.arange(offset + 1, offset + nwords + 1, dtype=torch.int64, device=seeds.device)
    z = j.mul_(GAMMA).unsqueeze(0) + seeds.view(-1, 1)
    # in-place from here on: large tensors are expensive to allocate
    t = torch.empty_like(z)
    for shift, mult in ((30, _M1), (27, _M2)):
        torch.bitwise_right_shift(z, shift, out=t)
        t.bitwise_and_((1 << (64 - shift)) - 1)
        z.bitwise_xor_(t).mul_(mult)
    torch.bitwise_right_shift(z, 31, out=t)
    t.bitwise_and_((1 << 33) - 1)
    return z.bitwise_xor_(t)


def digits(seeds: torch.Tensor, n: int) -> torch.Tensor:
    """Unsigned 32-bit digits of elements ``0 .. n-1``: shape (m, n) int64.

    Element ``i`` is half ``i % 2`` (low half first) of word ``i // 2``. The
    halves are read by shifting, not by reinterpreting memory, so the result
    does not depend on the machine's byte order.
    """
    w = words(seeds, (n + 1) // 2)
    out = torch.empty(w.shape[0], 2 * w.shape[1], dtype=torch.int64, device=w.device)
    torch.bitwise_and(w, _MASK32, out=out[:, 0::2])
    torch.bitwise_right_shift(w, 32, out=out[:, 1::2])
    out[:, 1::2].bitwise_and_(_MASK32)
    return out[:, :n]


def digits_at(seeds: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Digits at arbitrary element indices; ``seeds`` broadcasts against ``index``.

    Same values as :func:`digits` (this is the element-wise form the compiled
    kernels use, and the form used to draw a few extra digits for ties).
    """
    w = mix64(seeds + ((index >> 1) + 1) * GAMMA)
    return (w >> ((index & 1) * 32)) & _MASK32


def uniform_below(seeds: torch.Tensor, index: torch.Tensor, n: torch.Tensor | int) -> torch.Tensor:
    """Integers in ``[0, n)`` from whole 64-bit words (bias at most n / 2**63)."""
    w = mix64(seeds + (index + 1) * GAMMA)
    return _lsr(w, 1) % n


def priorities(seeds: torch.Tensor, n: int) -> torch.Tensor:
    """Distinct random int64 priorities for elements ``0 .. n-1`` (shape (m, n)).

    The low ``ceil(log2 n)`` bits hold the element index, the high bits are random,
    so the k smallest priorities form a uniformly random k-subset up to ties of
    the random part, which are broken by index (probability ~ n / 2**(63 - log2 n)
    per draw that a tie decides the k-th element).
    """
    nb = max(1, (n - 1).bit_length())
    w = words(seeds, n)
    w = _lsr(w, 1 + nb) << nb  # 63 - nb random bits, non-negative
    idx = torch.arange(n, dtype=torch.int64, device=w.device)
    return w.bitwise_or_(idx)
