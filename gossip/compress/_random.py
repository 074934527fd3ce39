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
32-bit integers, ``hash24`` (format version 4): with the row's stream seed split
into two 32-bit halves ``(s1, s2)``,

    h = M2 * xs12(((i + s1) * M1) ^ s2),  xs12(v) = v ^ (v >> 12),
    u = h >> 8 (the top 24 bits),  digit = u ^ (u >> 15)

in unsigned 32-bit arithmetic, with the odd multipliers M1 = 0x21f0aaad and
M2 = 0x735a2d97 of C. Wellons' ``lowbias32``. For a fixed seed, ``i -> h`` is a
bijection of the 32-bit integers and ``u -> digit`` one of the 24-bit ones, and
``s1`` is uniform when the key is, so every element's digit is exactly uniform over
``[0, 2**24)`` (the marginal is all that unbiasedness and the variance bound use).

Why this shape: a multiply mixes only upwards (bit k of a product depends on bits
0..k of its input), so the counter is multiplied first (consecutive indices then
differ in all high bits), the xorshift brings those high bits down, and the second
multiply spreads them up into the top bits that the digit is read from; the last
fold gives the digit's low bits (the weakest bits of a product) its top bits. Format
version 3 used ``lowbias32`` itself (a xorshift before the first multiply and after
the second): 18 vector operations per element in the compiled kernel from the index to the float digit, against 13
here, and on counters its first xorshift changes nothing within 65,536 consecutive
indices, so digits 256 or more elements apart were correlated in their top bits
(chi-square of the joint top nibbles of pairs, 512 keys x 16,384 elements: p =
1e-175 at lag 4096), which this one is not. ``s2`` is xored in between, so that two
rows whose ``s1`` happen to be close are not shifted copies of each other.
tests/test_compress_random.py checks uniformity, independence of neighbours (lags
1 to 4096, top and low digit bits), keys and digit bits. The shift 12 was chosen over
9 to 16 by those pair tests and by chi-square tests of the differences of digits at
lags 1 to 4096 (the strictest here: every 32-bit hash of this size fails some of
them at 8M pairs; this one least, and far less than lowbias32).

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


_H1 = 0x21F0AAAD  # the multipliers of lowbias32 (C. Wellons, "hash prospector", 2020)
_H2 = 0x735A2D97


def seeds32(seeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 32-bit halves (s1, s2) of int64 stream seeds, as int32 tensors of the same shape."""
    lo = ((seeds & _MASK32) ^ (1 << 31)) - (1 << 31)  # the low half as a signed 32-bit value
    hi = seeds >> 32  # arithmetic shift: already in int32 range
    return lo.to(torch.int32), hi.to(torch.int32)


def hash24(idx: torch.Tensor, s1: torch.Tensor | int, s2: torch.Tensor) -> torch.Tensor:
    """First rounding digits: 24-bit uniform integers (int32) of element indices ``idx``
    (int32) for seed halves ``s1``, ``s2`` (int32, broadcast against ``idx``; ``s1`` may
    be the int 0 when the caller has already added it to ``idx``).

    The digit is the top 24 bits ``u`` of :func:`hash32` folded as ``u ^ (u >> 15)``
    (a bijection of 24-bit values): the low bits of a product depend only on the low
    bits of its input, so the top bits are xored into them. int32 arithmetic wraps
    modulo 2**32 (two's complement); right shifts of possibly negative values are made
    logical with masks. The same integers come out of eager mode, torch.compile and CUDA.
    """
    u = (hash32(idx, s1, s2) >> 8) & 0xFFFFFF
    return u ^ (u >> 15)  # u >= 0: the arithmetic shift is the logical one


def hash32(idx: torch.Tensor, s1: torch.Tensor | int, s2: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash (int32) behind :func:`hash24`: add, odd multiply, xor, xorshift,
    odd multiply; each step is a bijection of 32-bit words."""
    h = idx if isinstance(s1, int) and s1 == 0 else idx + s1
    h = h * _H1
    h = h ^ s2
    h = h ^ ((h >> 12) & 0xFFFFF)  # a logical shift: the arithmetic one, masked
    return h * _H2


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
