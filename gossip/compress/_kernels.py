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

If compiling or running a compiled kernel fails (no C++ compiler, an
unsupported platform), a warning is issued once and that kernel falls back to
eager mode for the rest of the process.
"""

from __future__ import annotations

import os
import types
import warnings

import torch

from . import _random as R

__all__: list[str] = []

MIN_COMPILED_NUMEL = 1 << 20
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
            return k.compiled()(*args)
        except Exception as e:  # compiler missing or broken: degrade, do not fail
            k.failed = True
            warnings.warn(
                f"gossip.compress: compiled kernel {k.name!r} unavailable ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); using the eager fallback",
                RuntimeWarning,
                stacklevel=3,
            )
    return k.eager(*args)


# --------------------------------------------------------------------------------------
# Stochastic rounding.
#
# For t >= 0, code = floor(t) + [U < frac(t)] with U uniform in [0, 1). U's first 32
# bits are the element's digit u of stream STREAM_ROUND, compared with
# F = frac(t) * 2**32 (exact in fp32: a power-of-two scaling); the comparison is
# exact in float64. D = F - u > 0 means "up" unless 0 < D < 1, where u == floor(F)
# and F has bits below 2**-32 (only possible when t < 2**-9): then the next 32 bits
# of U decide, drawn lazily for those few elements (resolve_ties). So
# P(up) == frac(t) exactly for the fp32 value t.
#
# Modes: 0 = affine, t = (x - a) * s, code = level (quant);
#        1 = signed, t = |x| * s, code = 2 * level + [x < 0] (qsgd);
#        2 = ternary, t = |x| * s, code = level * (1 + [x < 0]) (terngrad).
# x: (m, nb, B) float32; a, s: (m, nb, 1) float32; seeds: (m,) int64; start: index of
# x[:, 0, 0] within the row; out: (m, nb, B) integer tensor that receives the codes.
# Returns the tie flags (m, nb, B).
# --------------------------------------------------------------------------------------

_TWO32 = 4294967296.0


def _scaled(x, a, s, L: float, mode: int):
    t = (x - a) * s if mode == 0 else x.abs() * s
    return t.clamp(max=L)


def _sr_compiled(x, a, s, seeds, start: int, L: float, mode: int, out):
    m, nb, B = x.shape
    t = _scaled(x, a, s, L, mode)
    f = t.floor()
    F = ((t - f) * _TWO32).to(torch.float64)
    i = (torch.arange(nb, device=x.device) * B).view(1, nb, 1) + torch.arange(B, device=x.device).view(1, 1, B) + start
    u = R.digits_at(seeds.view(m, 1, 1), i).to(torch.float64)
    D = F - u
    up = (D > 0).to(torch.float32)
    lvl = f + up
    if mode == 1:
        lvl = lvl * 2 + (x < 0).to(torch.float32)
    elif mode == 2:
        lvl = lvl * (1 + (x < 0).to(torch.float32))
    # ties as a uint8 computed arithmetically (bool outputs vectorise badly in inductor)
    tie = up * (D < 1).to(torch.float32)
    out.copy_(lvl)
    return tie.to(torch.uint8)


def _sr_eager(x, a, s, seeds, start: int, L: float, mode: int, out):
    m, nb, B = x.shape
    if mode == 0:
        t = torch.sub(x, a)
    else:
        t = x.abs()
    t.mul_(s).clamp_(max=L)
    f = t.floor()
    t.sub_(f).mul_(_TWO32)
    F = t.to(torch.float64)
    del t
    if start == 0:
        u = R.digits(seeds, nb * B).reshape(m, nb, B)
    else:
        i = (torch.arange(nb, device=x.device) * B).view(1, nb, 1) + torch.arange(B, device=x.device).view(1, 1, B) + start
        u = R.digits_at(seeds.view(m, 1, 1), i)
    D = F.sub_(u)
    del u
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


SR = Kernel("stochastic_round", _sr_eager, _sr_compiled)


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
    F = ((t - f) * _TWO32).to(torch.float64)
    # a tie means the first digit equals floor(F): only F's fraction is still open
    rem = F - F.floor()  # in (0, 1): the bits of frac(t) beyond the first 32
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
        if level > 8:  # cannot happen for fp32 input: 9 * 32 bits cover every fp32 fraction
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


def _minmax_eager(x):
    # two vectorised reductions beat aminmax(dim=...), which is not vectorised on CPU
    return x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)


def _minmax_compiled(x):
    return torch.aminmax(x, dim=-1, keepdim=True)


MINMAX = Kernel("minmax", _minmax_eager, _minmax_compiled)


def _absmax_eager(x):
    return torch.linalg.vector_norm(x, ord=float("inf"), dim=-1, keepdim=True)


def _absmax_compiled(x):
    return x.abs().amax(dim=-1, keepdim=True)


ABSMAX = Kernel("absmax", _absmax_eager, _absmax_compiled)


def _checksum(words, w):
    return (words * w).sum(dim=1, dtype=torch.int64) & 0xFFFFFFFF


CHECKSUM = Kernel("checksum", _checksum)
