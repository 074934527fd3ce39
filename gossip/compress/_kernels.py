"""Element-wise kernels with an optional torch.compile fast path.

Each kernel has an eager form (plain torch, any device) and a form handed to
``torch.compile`` (inductor fuses the hashing, rounding and conversion into one
loop). Both forms compute bit-identical results: integer hashing is exact, and
the floating-point steps are single IEEE operations in the same order
(inductor compiles with ``-ffp-contract=off``), which the tests check.

Backend choice, from the environment variable ``GOSSIP_COMPRESS_BACKEND``:

- ``auto`` (default): compiled on CPU for calls of at least ``MIN_COMPILED_NUMEL``
  elements, eager otherwise and on other devices;
- ``compile``: compiled on CPU whatever the size;
- ``eager``: never compile.

The first compiled call of each kernel in a process is checked against the eager
form on the same input, bit for bit. If compiling or running a compiled kernel
fails (no C++ compiler, an unsupported platform) or the check finds a
difference, a warning is issued once and that kernel falls back to eager mode for
the rest of the process.
"""

from __future__ import annotations

import os
import types
import warnings

import torch

from . import _random as R

__all__: list[str] = []

MIN_COMPILED_NUMEL = 1 << 16
_BACKENDS = ("auto", "compile", "eager")
_backend = os.environ.get("GOSSIP_COMPRESS_BACKEND", "auto").strip().lower() or "auto"
if _backend not in _BACKENDS:
    warnings.warn(
        f"GOSSIP_COMPRESS_BACKEND must be one of {', '.join(_BACKENDS)}, got {_backend!r}; using 'auto'",
        stacklevel=1,
    )
    _backend = "auto"


def set_backend(name: str) -> str:
    """Select the kernel backend ('auto', 'compile' or 'eager'); returns the previous one."""
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(_BACKENDS)}, got {name!r}")
    old, _backend = _backend, name
    return old


def get_backend() -> str:
    return _backend


class Kernel:
    """One element-wise computation in eager and compiled form.

    Variants (``variant(key)``) get their own copy of the compiled function's code
    object, so that torch.compile keeps a separate cache (and recompile budget) for
    each specialisation (quantizer mode, code dtype, number of levels).
    """

    def __init__(self, name: str, eager, compiled_src=None):
        self.name = name
        self.eager = eager
        self.src = compiled_src or eager
        self._compiled = None
        self._variants: dict = {}
        self.failed = False
        self.verified = False

    def compiled(self):
        if self._compiled is None:
            self._compiled = torch.compile(self.src, dynamic=True, fullgraph=True)
        return self._compiled

    def variant(self, key) -> "Kernel":
        k = self._variants.get(key)
        if k is None:
            tag = "_" + "_".join(str(p).replace(".", "_").replace("torch_", "") for p in key)
            code = self.src.__code__.replace(co_name=self.src.__name__ + tag)
            src = types.FunctionType(code, self.src.__globals__, code.co_name, self.src.__defaults__,
                                     self.src.__closure__)
            k = self._variants[key] = Kernel(self.name + tag, self.eager, src)
        return k


def _want_compiled(k: Kernel, numel: int, device: torch.device) -> bool:
    if _backend == "eager" or k.failed or device.type != "cpu":
        return False
    return _backend == "compile" or numel >= MIN_COMPILED_NUMEL


def run(k: Kernel, numel: int, *args):
    dev = next(a.device for a in args if isinstance(a, torch.Tensor))
    if _want_compiled(k, numel, dev):
        try:
            if k.verified:
                return k.compiled()(*args)
            return _run_verified(k, args)
        except Exception as e:  # compiler missing or broken: degrade, do not fail
            _disable(k, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return k.eager(*args)


def _disable(k: Kernel, why: str) -> None:
    k.failed = True
    warnings.warn(f"gossip.compress: compiled kernel {k.name!r} unavailable ({why}); using the eager fallback",
                  RuntimeWarning, stacklevel=4)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point():
            return bool(((a == b) | (a.isnan() & b.isnan())).all())
        return torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _run_verified(k: Kernel, args):
    """First compiled call of a kernel in this process: also run the eager form on
    copies of the arguments and compare results and written outputs bit for bit. A
    mismatch (a miscompilation) disables the compiled form and keeps the eager result."""
    copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    res = k.compiled()(*args)
    ref = k.eager(*copies)
    if _same(res, ref) and all(_same(a, c) for a, c in zip(args, copies)):
        k.verified = True
        return res
    for a, c in zip(args, copies):
        if isinstance(a, torch.Tensor) and not _same(a, c):
            a.copy_(c)
    _disable(k, "its results differ from the eager form")
    return ref


# --------------------------------------------------------------------------------------
# Stochastic rounding.
#
# For t >= 0, code = floor(t) + [U < frac(t)] with U uniform in [0, 1). U's first 24
# bits are the element's digit u of stream STREAM_ROUND, compared with
# F = frac(t) * 2**24 in fp32 (a power-of-two scaling: exact; u < 2**24: exact).
# D = F - u > 0 means "up" unless 0 < D < 1, where u == floor(F) and F has bits
# below 2**-24, only possible when t < 0.5 (for t >= 0.5 the fp32 spacing of t is at
# least 2**-24, so F is an integer): then further 32-bit digits of U decide, drawn
# lazily for those few elements (resolve_ties). Wherever |D| >= 1 its sign is right
# even if D was rounded, and for 0 < D < 1 it is exact. So P(up) == frac(t)
# exactly, for the fp32 value t.
#
# Digits are laid out per block so that one 64-bit word serves two elements that
# sit half a block apart (both halves are contiguous, so the fused loop stays
# vectorised and hashes once per pair): in a block of n elements whose words start
# at w0, with H = n // 2, element k < H reads the low half of word w0 + k, element
# H + k the high half of word w0 + k, and when n is odd the last element reads the
# low half of word w0 + H. Full blocks of size B start at w0 = b * ceil(B / 2); the
# tail block after nb full blocks at w0 = nb * ceil(B / 2). A "low" digit is bits
# 8..31 of the word, a "high" digit bits 40..63.
#
# Modes: 0 = affine, t = (x - a) * s, code = level (quant);
#        1 = signed, t = |x| * s, code = 2 * level + [x < 0] (qsgd);
#        2 = ternary, t = |x| * s, code = level * (1 + [x < 0]) (terngrad).
# --------------------------------------------------------------------------------------

_TWO32 = 4294967296.0
_TWO24 = 16777216.0
_MASK24 = 0xFFFFFF


def block_digits(seeds: torch.Tensor, nb: int, n: int, w0: int) -> torch.Tensor:
    """First (24-bit) digits (m, nb, n) int64 of nb blocks of n elements, block b at word w0 + b*ceil(n/2)."""
    m = seeds.shape[0]
    hb, H = (n + 1) // 2, n // 2
    W = R.words(seeds, nb * hb, offset=w0).view(m, nb, hb)
    u = torch.empty(m, nb, n, dtype=torch.int64, device=seeds.device)
    torch.bitwise_right_shift(W[..., :H], 8, out=u[..., :H])
    u[..., :H].bitwise_and_(_MASK24)
    torch.bitwise_right_shift(W[..., :H], 40, out=u[..., H: 2 * H])
    u[..., H: 2 * H].bitwise_and_(_MASK24)
    if n % 2:
        torch.bitwise_right_shift(W[..., H:], 8, out=u[..., 2 * H:])
        u[..., 2 * H:].bitwise_and_(_MASK24)
    return u


def _scaled(x, a, s, L: float, mode: int):
    t = (x - a) * s if mode == 0 else x.abs() * s
    return t.clamp(max=L)


def _round_half(x, a, s, u, L: float, mode: int):
    """Codes and tie flags (float32 0/1) of one half; u: the digits (int64)."""
    t = _scaled(x, a, s, L, mode)
    f = t.floor()
    F = (t - f) * _TWO24
    D = F - u.to(torch.int32).to(torch.float32)  # narrowing first vectorises better
    up = (D > 0).to(torch.float32)
    lvl = f + up
    if mode == 1:
        lvl = lvl * 2 + (x < 0).to(torch.float32)
    elif mode == 2:
        lvl = lvl * (1 + (x < 0).to(torch.float32))
    # ties as float arithmetic, not bool logic: bool outputs vectorise badly in inductor
    return lvl, up * (D < 1).to(torch.float32)


def _pairs(xl, xh, a, s, seeds, w0: int, hb: int, L: float, mode: int, ol, oh):
    m, nb, H = xl.shape
    j = (torch.arange(nb, device=xl.device) * hb).view(1, nb, 1) + torch.arange(H, device=xl.device).view(1, 1, H)
    w = R.mix64(seeds.view(m, 1, 1) + (j + (w0 + 1)) * R.GAMMA)
    lo, tlo = _round_half(xl, a, s, (w >> 8) & _MASK24, L, mode)
    hi, thi = _round_half(xh, a, s, (w >> 40) & _MASK24, L, mode)
    ol.copy_(lo)
    oh.copy_(hi)
    return tlo, thi


def _sr_pairs_compiled(xl, xh, a, s, seeds, w0: int, hb: int, L: float, mode: int, ol, oh):
    """Both halves of nb blocks: xl = x[..., :H], xh = x[..., H:2H]; returns tie flags
    (m, nb, H) uint8, bit 0 for the low half, bit 1 for the high half."""
    tlo, thi = _pairs(xl, xh, a, s, seeds, w0, hb, L, mode, ol, oh)
    return (tlo + 2 * thi).to(torch.uint8)


def _sr_eager(x, a, s, u, L: float, mode: int, out):
    """The same rounding with all digits given: u (m, nb, B) int64. Returns bool ties."""
    if mode == 0:
        t = torch.sub(x, a)
    else:
        t = x.abs()
    t.mul_(s).clamp_(max=L)
    f = t.floor()
    D = t.sub_(f).mul_(_TWO24).sub_(u)  # u < 2**24 converts to fp32 exactly
    up = D > 0
    tie = up & (D < 1)
    del D
    lvl = f.add_(up)
    if mode == 1:
        lvl.mul_(2).add_(x < 0)
    elif mode == 2:
        lvl.mul_((x < 0).to(torch.float32).add_(1))
    out.copy_(lvl)
    return tie


SR = Kernel("stochastic_round", _sr_pairs_compiled)


def safe_inverse(L: float, R: torch.Tensor) -> torch.Tensor:
    """fp32 ``inv`` close to ``L / R`` with ``inv * R <= L`` exactly, 0 where R == 0.

    Rounded down when needed so that ``fl(v * inv) <= L`` for every ``0 <= v <= R``:
    codes never exceed the top level.
    """
    inv = torch.where(R > 0, L / R, torch.zeros_like(R))
    over = inv.to(torch.float64) * R.to(torch.float64) > L  # exact: fp32 * fp32 fits in fp64
    return torch.where(over, torch.nextafter(inv, torch.zeros_like(inv)), inv)


def _scales(x, L: float, mode: int):
    """Per-block offset a, range R and inverse step s (each (m, nb, 1)) for modes 0 and 2."""
    if mode == 0:
        a = x.amin(dim=-1, keepdim=True)
        R = x.amax(dim=-1, keepdim=True) - a
    else:
        R = x.abs().amax(dim=-1, keepdim=True)
        a = torch.zeros_like(R)
    return a, R, safe_inverse(L, R)


def _fused_compiled(x, seeds, w0: int, hb: int, L: float, mode: int, ol, oh):
    """Scales and rounding of nb blocks in one compiled call (quant and ternary).

    For quant (mode 0) only the number of ties comes back: ties need t < 0.5, the
    lowest half level, and then have probability 2**-24, so they are rare enough
    that a second pass to locate them (stochastic_round) is cheaper on average than
    writing a flag per element. Ternary values mostly lie below 0.5: flags.
    """
    H = ol.shape[2]
    a, R, s = _scales(x, L, mode)
    tlo, thi = _pairs(x[..., :H], x[..., H: 2 * H], a, s, seeds, w0, hb, L, mode, ol, oh)
    if mode == 0:
        return a, R, s, (tlo + thi).sum()
    return a, R, s, (tlo + 2 * thi).to(torch.uint8)


FUSED = Kernel("scale_and_round", _fused_compiled)


def scale_and_round(x, keys, seeds, start: int, w0: int, L: float, mode: int, out):
    """Block scales and stochastic rounding for quant (mode 0) and ternary (mode 2).

    Returns (a, R, s): offset, range and inverse step per block, (m, nb, 1) each.
    """
    m, nb, B = x.shape
    H, hb = B // 2, (B + 1) // 2
    k = FUSED.variant((mode, out.dtype, L))
    if H and _want_compiled(k, x.numel(), x.device):
        a, R, s, flags = run(k, x.numel(), x, seeds, w0, hb, float(L), mode, out[..., :H], out[..., H: 2 * H])
        if flags.dim() == 0:  # a tie count: locate the ties, if any, with a second pass
            if int(flags) == 0:
                flags = torch.zeros((), dtype=torch.uint8, device=x.device)  # nothing to finish
            else:
                stochastic_round(x, a, s, keys, seeds, start, w0, L, mode, out)
                return a, R, s
        _finish(x, a, s, keys, seeds, start, w0, L, mode, out, flags)
    else:
        a, R, s = _scales(x, float(L), mode)
        tie = _sr_eager(x, a, s, block_digits(seeds, nb, B, w0), float(L), mode, out)
        if bool(tie.any()):
            resolve_ties(out, tie, x, a, s, keys, start, float(L), mode)
    return a, R, s


def stochastic_round(x, a, s, keys, seeds, start: int, w0: int, L: float, mode: int, out) -> None:
    """Round nb blocks x (m, nb, B) into the integer codes ``out`` (m, nb, B).

    ``start``: row index of x[:, 0, 0] (names the tie-breaking digits); ``w0``: first
    word of the blocks' digits (see the layout above).
    """
    m, nb, B = x.shape
    H, hb = B // 2, (B + 1) // 2
    k = SR.variant((mode, out.dtype, L))
    if H and _want_compiled(k, x.numel(), x.device):
        flags = run(k, x.numel(), x[..., :H], x[..., H: 2 * H], a, s, seeds, w0, hb, float(L), mode,
                    out[..., :H], out[..., H: 2 * H])
        _finish(x, a, s, keys, seeds, start, w0, L, mode, out, flags)
    else:
        tie = _sr_eager(x, a, s, block_digits(seeds, nb, B, w0), float(L), mode, out)
        if bool(tie.any()):
            resolve_ties(out, tie, x, a, s, keys, start, float(L), mode)


def _finish(x, a, s, keys, seeds, start, w0, L, mode, out, flags) -> None:
    """After the compiled pairs: the odd last element of each block, then any ties."""
    m, nb, B = x.shape
    H, hb = B // 2, (B + 1) // 2
    tie = None
    if bool(flags.any()):
        tie = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
        tie[..., :H] = (flags & 1).bool()
        tie[..., H: 2 * H] = (flags & 2).bool()
    if B % 2:  # the odd last element of each block, on its own word
        w = R.mix64(seeds.view(m, 1, 1) + (torch.arange(nb, device=x.device).view(1, nb, 1) * hb
                                            + (w0 + H + 1)) * R.GAMMA)
        t_odd = _sr_eager(x[..., 2 * H:], a, s, (w >> 8) & _MASK24, float(L), mode, out[..., 2 * H:])
        if bool(t_odd.any()):
            if tie is None:
                tie = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
            tie[..., 2 * H:] = t_odd
    if tie is not None:
        resolve_ties(out, tie, x, a, s, keys, start, float(L), mode)


def resolve_ties(codes, tie, x, a, s, keys, start: int, L: float, mode: int) -> None:
    """Finish the rounding of the elements flagged in ``tie`` (in place in ``codes``)."""
    idx = tie.nonzero()
    if idx.numel() == 0:
        return
    r, b, k = idx.unbind(1)
    B = x.shape[2]
    i = b * B + k + start
    xs = x[r, b, k]
    t = _scaled(xs, a[r, b, 0], s[r, b, 0], L, mode)
    f = t.floor()
    F = (t - f) * _TWO24
    # a tie means the first digit equals floor(F): only F's fraction is still open
    rem = (F - F.floor()).to(torch.float64)  # in (0, 1): the bits of frac(t) beyond the first 24
    up = torch.zeros_like(rem, dtype=torch.bool)
    open_ = torch.ones_like(up)
    level = 0
    while bool(open_.any()):
        seeds = R.stream_seeds(keys[r], R.STREAM_TIE + level)
        Rm = rem * _TWO32  # exact: rem has at most 24 significant bits
        ud = R.digits_at(seeds, i).to(torch.float64)
        Dn = Rm - ud
        decided = open_ & ((Dn <= 0) | (Dn >= 1))
        up = torch.where(decided, Dn > 0, up)
        open_ = open_ & ~decided
        rem = torch.where(open_, Dn, rem)
        level += 1
        if level > 8:  # cannot happen for fp32 input: 24 + 8 * 32 bits cover every fp32 fraction
            raise RuntimeError("stochastic rounding did not terminate")
    lvl = f + up.to(torch.float32)
    if mode == 1:
        lvl = lvl * 2 + (xs < 0).to(torch.float32)
    elif mode == 2:
        lvl = lvl * (1 + (xs < 0).to(torch.float32))
    codes[r, b, k] = lvl.to(codes.dtype)


# --------------------------------------------------------------------------------------
# Affine decode: out = codes * step + a (two roundings, no fused multiply-add).
# --------------------------------------------------------------------------------------


def _affine_compiled(codes, a, step):
    return codes.to(torch.float32) * step + a


def _affine_eager(codes, a, step):
    out = codes.to(torch.float32)
    return out.mul_(step).add_(a)


AFFINE = Kernel("affine_decode", _affine_eager, _affine_compiled)


def _priorities_compiled(seeds, idx, shift, mask):
    # element-wise form of _random.priorities (same integers); the shift amount and
    # mask come in as tensors so that no symbolic shape enters a constant
    w = R.mix64(seeds.view(-1, 1) + (idx + 1) * R.GAMMA)
    return (((w >> (shift + 1)) & mask) << shift) | idx


def _priorities_eager(seeds, idx, shift, mask):
    return R.priorities(seeds, idx.shape[1])


def priorities(seeds: torch.Tensor, n: int) -> torch.Tensor:
    nb = max(1, (n - 1).bit_length())
    idx = torch.arange(n, dtype=torch.int64, device=seeds.device).view(1, n)
    shift = torch.tensor(nb, dtype=torch.int64, device=seeds.device)
    mask = torch.tensor((1 << (63 - nb)) - 1, dtype=torch.int64, device=seeds.device)
    return run(PRIORITIES, seeds.numel() * n, seeds, idx, shift, mask)


PRIORITIES = Kernel("priorities", _priorities_eager, _priorities_compiled)


def _magnitude_keys(X):
    # |x| as its fp32 bit pattern (monotone for non-negative floats) above the
    # complemented index: distinct int64 keys, larger for larger |x|, then lower index
    d = X.shape[1]
    i = torch.arange(d, dtype=torch.int64, device=X.device)
    return (X.abs().view(torch.int32).to(torch.int64) << 32) | (0xFFFFFFFF - i)


MAGNITUDE_KEYS = Kernel("magnitude_keys", _magnitude_keys)


def _checksum(words, w):
    return (words * w).sum(dim=1, dtype=torch.int64) & 0xFFFFFFFF


CHECKSUM = Kernel("checksum", _checksum)
