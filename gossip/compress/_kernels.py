"""Element-wise kernels with an optional torch.compile fast path.

Each kernel has an eager form (plain torch, any device) and a form handed to
``torch.compile`` (inductor fuses the hashing, rounding and conversion into one
loop). Both forms compute bit-identical results: integer hashing is exact, and
the floating-point steps are single IEEE operations in the same order
(inductor compiles with ``-ffp-contract=off``), which the tests check.

Backend choice, from the environment variable ``GOSSIP_COMPRESS_BACKEND``:

- ``auto`` (default), on CPU: eager below ``MIN_COMPILED_NUMEL`` elements per call.
  Above, a kernel whose compiled form inductor's cache already holds (see "What the
  compile cache holds" below) is compiled at its first such call: a warm compile
  loads the compiled code instead of making it (on a 2-core AMD EPYC at load 0.7,
  the first call of quant:bits=8 on 8M values took 5.3 s with a warm cache,
  importing inductor included, and quant:bits=4's after it 2.0 s, against 16.0 s and
  8.0 s with an empty one; ``experiments/cold_start.py --caches empty,warm``). Any
  other kernel runs eager until its eager calls have processed
  ``EAGER_BUDGET_NUMEL`` elements in this process, then compiled. So with an empty
  cache no call compiles at once, however large: the first step of a run never waits
  for a cold compilation (a large model's eager first step takes a fraction of a
  second per call), and compiling happens in the step during which the budget runs
  out, in the calling thread. The eager forms run in cache-sized chunks ("The eager
  forms in cache-sized chunks" below): at 16M values on one thread of an AMD EPYC,
  quant:bits=8's and quant:bits=4's eager round trips ran at 0.13 of a memcpy
  (``experiments/bench_compress.py --backend eager``, load 0.8), 14 times the speed
  of the earlier eager forms (a chain of full-size temporaries, 0.008 of a memcpy,
  timed in the same process), where the compiled ones ran at 0.29 and 0.32 on a
  quiet machine: the eager forms are 2-3 times slower per element (1.3 and 0.9 times
  timed in one process at load 1.3, which slowed the compiled kernels' memory
  traffic more). Compiling a kernel costs seconds (more on a loaded machine, each
  kernel is its own graph), so a short run of a small model (the command line's
  MNIST-1D default) never pays a compilation; at the 1-3 ns per element that
  compiling saves, the budget's 2**30 elements cost 1-3 s more in eager form than
  compiled, less than a cold compilation. Eager on other devices;
- ``compile``: compiled on CPU whatever the size, from the first call;
- ``eager``: never compile.

A run may so switch from the eager to the compiled form of a kernel part way
through, and a resumed run switches at a different step: that keeps runs and
resumes bit-identical because both forms give the same bits (the contract above,
checked at the switch). Compiled kernels run under ``torch.no_grad()`` (grad mode
is part of torch.compile's guards: calls from a training step and from outside one
would compile the same graph twice).

The first compiled call of each kernel in a process is checked against the eager
form on the same input, bit for bit. If compiling or running a compiled kernel
fails (no C++ compiler, an unsupported platform) or the check finds a
difference, a warning is issued once and that kernel falls back to eager mode for
the rest of the process. A kernel whose code object meets torch.compile's recompile
limit (inputs of many shapes in one process) continues on a fresh copy of its code
object, with one warning, up to ``RECOMPILE_RENEWALS`` times (``Kernel.renew``).
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import hashlib
import os
import re
import tempfile
import types
import warnings
from pathlib import Path

import numpy as np
import torch

from . import _random as R, _scratch

R_ = R  # the _random module, under a name that the kernels' local `R` (a range) does not shadow

__all__: list[str] = []

MIN_COMPILED_NUMEL = 1 << 16
#: auto: elements a kernel processes in eager form before it is compiled, unless the
#: compile cache holds it (at the 1-3 ns per element that compiling saves over the
#: chunked eager forms, 1-3 s: less than a cold compilation, 14-28 s)
EAGER_BUDGET_NUMEL = 1 << 30
_BACKENDS = ("auto", "compile", "eager")
#: ``Kernel.failure`` of a kernel whose compiled results differed from the eager form's
MISCOMPILED = "its results differ from the eager form"
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
    """The kernel backend in use: 'auto', 'compile' or 'eager' (see :func:`set_backend`)."""
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
        #: why the compiled form was given up (``failed``): the compiler's error, or
        #: :data:`MISCOMPILED` when its results differed from the eager form's
        self.failure: str | None = None
        self.verified = False
        #: elements processed in eager form by calls that the budget kept from compiling
        self.eager_numel = 0
        self.budget_spent = False
        #: whether auto has asked the compile cache about this kernel (at its first call)
        self.cache_checked = False
        #: kernels whose auto decision this one follows (:func:`_follow`): a verified
        #: compile of this one vouches for them in the compile cache too
        self.deciders: set = set()
        #: times the compiled form met torch.compile's recompile limit and was renewed
        #: (:meth:`renew`, :data:`RECOMPILE_RENEWALS`)
        self.recompiles = 0

    def compiled(self):
        if self._compiled is None:
            self._compiled = torch.compile(self.src, dynamic=True, fullgraph=True)
        return self._compiled

    def renew(self) -> None:
        """Give the compiled form a fresh copy of its code object (``recompiles`` counts
        them): torch.compile keeps its graphs and its recompile limit per code object, so
        the fresh copy starts with none, and compiles (or loads from inductor's cache) the
        graphs of the shapes it meets from then on."""
        self.recompiles += 1
        src = self.src
        code = src.__code__.replace(co_name=f"{self.name}_r{self.recompiles}")
        self.src = types.FunctionType(code, src.__globals__, code.co_name, src.__defaults__, src.__closure__)
        self._compiled = None

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
    """Whether this call of ``k`` takes the compiled form. In ``auto`` mode, at its first
    call of at least ``MIN_COMPILED_NUMEL`` elements a kernel whose compiled form is in
    the compile cache (:data:`compile_cache`) compiles at once; otherwise an eager call
    of at least ``MIN_COMPILED_NUMEL`` elements counts against the kernel's eager budget
    (never compiled on its first call: the first step stays fast)."""
    if _backend == "eager" or k.failed or device.type != "cpu":
        return False
    if _backend == "compile" or k.budget_spent:
        return True
    if numel < MIN_COMPILED_NUMEL:
        return False
    if not k.cache_checked:
        k.cache_checked = True
        if compile_cache.holds(k.name):  # a warm compile: seconds at most, so at once
            k.budget_spent = True
            return True
    k.eager_numel += numel
    if k.eager_numel >= EAGER_BUDGET_NUMEL:
        k.budget_spent = True
        return True
    return False


def _follow(k: Kernel, decider: Kernel) -> None:
    """``k`` runs on behalf of ``decider``, whose auto decision (budget or compile cache)
    it shares: compiled once ``decider``'s is, and its verified compile marks ``decider``
    as held by the compile cache."""
    k.budget_spent |= decider.budget_spent
    k.deciders.add(decider)


# --------------------------------------------------------------------------------------
# What the compile cache holds.
#
# A kernel's compiled form is written by inductor into its on-disk caches (the FX graph
# cache, under TORCHINDUCTOR_CACHE_DIR); a later process that compiles the same graph
# loads it from there in a fraction of a cold compilation's time. Whether an entry is
# there cannot be asked of inductor without importing it (seconds) and tracing the
# graph, so this module keeps its own record: after a compiled kernel has been verified
# (its first compiled call gave the eager bits) and inductor reported a cache store or
# hit for it (its counters, not a bypass), an empty marker file named after the kernel
# is written in a folder inside inductor's cache folder, named after the torch version
# and this module's sources (a change to either makes other graphs). The marker sits
# with what it vouches for: deleting inductor's cache deletes the markers too, and a
# fresh TORCHINDUCTOR_CACHE_DIR has none. Asking is one stat() per kernel and process.
# With inductor's caches switched off (TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 or
# TORCHINDUCTOR_FX_GRAPH_CACHE=0) nothing is held and nothing written.
# --------------------------------------------------------------------------------------


def inductor_cache_dir() -> str:
    """The folder of inductor's caches, as torch._inductor.runtime.cache_dir_utils.cache_dir()
    names it (``TORCHINDUCTOR_CACHE_DIR``, else ``torchinductor_<user>`` in the temporary
    folder), without importing inductor or creating the folder."""
    d = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if d is None:
        try:
            user = getpass.getuser()
        except (KeyError, ModuleNotFoundError, OSError):
            getuid = getattr(os, "getuid", None)
            user = f"uid_{getuid()}" if callable(getuid) else "unknown_user"
        d = os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
    return os.path.abspath(d)


def _caches_off() -> bool:
    env = os.environ
    return (env.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "0") == "1"
            or env.get("TORCH_COMPILE_FORCE_DISABLE_CACHES", "0") == "1"
            or env.get("TORCHINDUCTOR_FX_GRAPH_CACHE", "1") == "0")


@functools.lru_cache(maxsize=1)
def _sources_tag() -> str:
    """A short hash of the torch version and of the sources the kernels are made of."""
    h = hashlib.sha256(torch.__version__.encode())
    here = Path(__file__).resolve().parent
    for name in ("_kernels.py", "_random.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


class MarkerCache:
    """The record of compiled kernels in inductor's cache folder (see above)."""

    def __init__(self):
        self._written: set = set()

    def folder(self) -> Path:
        return Path(inductor_cache_dir()) / "gossip-compress" / _sources_tag()

    def holds(self, name: str) -> bool:
        """Whether a verified compiled form of kernel ``name`` is in the compile cache."""
        return not _caches_off() and (self.folder() / name).is_file()

    def note(self, name: str) -> None:
        """Record that kernel ``name``'s compiled form is in the compile cache (once per
        process; a folder that cannot be written is left alone)."""
        if name in self._written or _caches_off():
            return
        self._written.add(name)
        try:
            f = self.folder()
            f.mkdir(parents=True, exist_ok=True)
            (f / name).touch()
        except OSError:
            pass


#: what auto asks at a kernel's first call (tests put a fake in its place)
compile_cache = MarkerCache()


def _fx_cache_counts() -> tuple[int, int]:
    """Inductor's FX graph cache events in this process: (stores or hits, bypasses)."""
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return c["fxgraph_cache_miss"] + c["fxgraph_cache_hit"], c["fxgraph_cache_bypass"]


def run(k: Kernel, numel: int, *args):
    """Call kernel ``k`` on ``args`` (``numel`` elements), compiled or eager as the
    backend decides; a compiled form that fails or miscompiles falls back to the eager."""
    dev = next(a.device for a in args if isinstance(a, torch.Tensor))
    if _want_compiled(k, numel, dev):
        while not k.failed:
            try:
                with torch.no_grad():
                    if k.verified:
                        return k.compiled()(*args)
                    return _run_verified(k, args)
            except Exception as e:  # compiler missing or broken: degrade, do not fail
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                if not _recompile_limit(e):
                    _disable(k, why)
                elif k.recompiles < RECOMPILE_RENEWALS:
                    _renew(k)  # nothing ran: the call is made again on the fresh code object
                else:
                    _disable(k, f"torch.compile's recompile limit, met {k.recompiles + 1} times ({why})")
    return k.eager(*args)


#: times a kernel's compiled form is renewed (:meth:`Kernel.renew`) after meeting
#: torch.compile's recompile limit before it falls back to the eager form for good
RECOMPILE_RENEWALS = 4


def _recompile_limit(e: BaseException) -> bool:
    """Whether ``e`` is torch.compile refusing another graph for a code object
    (``torch._dynamo.config.recompile_limit`` graphs already: with ``fullgraph=True`` it
    raises where it would otherwise run the Python function uncompiled)."""
    while e is not None:
        if type(e).__name__ == "FailOnRecompileLimitHit":
            return True
        e = e.__cause__
    return False


def _renew(k: Kernel) -> None:
    """A kernel met the recompile limit: a fresh code object, with one warning per kernel."""
    if not k.recompiles:
        from torch._dynamo import config

        warnings.warn(f"gossip.compress: compiled kernel {k.name!r} met torch.compile's recompile limit "
                      f"({config.recompile_limit} graphs of one code object: calls of many shapes in this "
                      f"process); it continues on a fresh code object, up to {RECOMPILE_RENEWALS} times "
                      f"(Kernel.recompiles counts them)", RuntimeWarning, stacklevel=4)
    k.renew()


def _disable(k: Kernel, why: str) -> None:
    k.failed = True
    k.failure = why
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
    fn = k.compiled()
    before = _fx_cache_counts()
    res = fn(*args)
    cached, bypassed = (x - y for x, y in zip(_fx_cache_counts(), before))
    ref = k.eager(*copies)
    if _same(res, ref) and all(_same(a, c) for a, c in zip(args, copies)):
        k.verified = True
        if cached and not bypassed:  # inductor stored its graph (or found it): warm for later processes
            for name in (k.name, *(d.name for d in k.deciders)):
                compile_cache.note(name)
        return res
    for a, c in zip(args, copies):
        if isinstance(a, torch.Tensor) and not _same(a, c):
            a.copy_(c)
    _disable(k, MISCOMPILED)
    return ref


# --------------------------------------------------------------------------------------
# Stochastic rounding.
#
# For t >= 0, code = floor(t) + [U < frac(t)] with U uniform in [0, 1). U's first 24
# bits are the element's digit u = hash24(i, seed) (see _random: one int32 hash per
# element, i the element's index in its row; the compiled kernels are handed i + s1),
# compared with F = frac(t) * 2**24 in fp32 (a power-of-two scaling: exact; u < 2**24: exact). D = F - u > 0 means "up"
# unless 0 < D < 1, where u == floor(F) and F has bits below 2**-24, only possible
# when t < 0.5 (for t >= 0.5 the fp32 spacing of t is at least 2**-24, so F is an
# integer): then further 32-bit digits of U decide, drawn lazily for those few
# elements (resolve_ties). Wherever |D| >= 1 its sign is right even if D was
# rounded, and for 0 < D < 1 it is exact. So P(up) == frac(t) exactly, for the fp32
# value t.
#
# Modes: 0 = affine, t = (x - a) * s, code = level (quant);
#        1 = signed, t = |x| * s, code = 2 * level + [x < 0] (qsgd);
#        2 = ternary, t = |x| * s, code = level * (1 + [x < 0]) (terngrad).
# --------------------------------------------------------------------------------------

_TWO32 = 4294967296.0
_TWO24 = 16777216.0
_MASK24 = 0xFFFFFF


def block_digits(seeds: torch.Tensor, nb: int, n: int, start: int) -> torch.Tensor:
    """First (24-bit) digits (m, nb, n) int32 of nb blocks of n elements, the first
    element being element ``start`` of its row: element i's digit is hash24(i, seed)."""
    s1, s2 = R.seeds32(seeds)
    e = torch.arange(start, start + nb * n, dtype=torch.int32, device=seeds.device).view(1, nb, n)
    return R.hash24(e, s1.view(-1, 1, 1), s2.view(-1, 1, 1))


def _seed_args(seeds: torch.Tensor, start: int):
    """Arguments of the compiled kernels: the seed's high half s2 and ``start + s1``, the
    hash's input of the first element (int32 (m, 1, 1) each). Adding s1 here, once per
    row, saves the kernels one vector add per element."""
    s1, s2 = R.seeds32(seeds)
    m = seeds.shape[0]
    b = s1.to(torch.int64) + start
    b = ((b + (1 << 31)) & R._MASK32) - (1 << 31)  # wrapped to int32, as the eager index + s1 wraps
    return s2.view(m, 1, 1), b.to(torch.int32).view(m, 1, 1)


def _index(x, base):
    """Element indices (m or 1, nb, B) int32 of blocks x (m, nb, B) that start at element
    ``base`` (int32, 0-d or (m, 1, 1))."""
    nb, B = x.shape[1], x.shape[2]
    dev = x.device
    return base + (torch.arange(nb, dtype=torch.int32, device=dev) * B).view(1, nb, 1) \
        + torch.arange(B, dtype=torch.int32, device=dev).view(1, 1, B)


def _scaled(x, a, s, L: float, mode: int):
    if mode == 0:
        # no clamp: a is the block's min and s = safe_inverse(L, max - a), so
        # fl(x - a) <= fl(max - a) = R and fl(fl(x - a) * s) <= fl(R * s) <= L
        # (rounding is monotone): t <= L already, and a clamp costs a pass
        return (x - a) * s
    return (x.abs() * s).clamp(max=L)


def _round_half(x, a, s, u, L: float, mode: int):
    """Codes and tie flags (float32 0/1); u: the digits (int32)."""
    t = _scaled(x, a, s, L, mode)
    f = t.floor()
    F = (t - f) * _TWO24
    D = F - u.to(torch.float32)
    up = (D > 0).to(torch.float32)
    lvl = f + up
    if mode == 1:
        lvl = lvl * 2 + (x < 0).to(torch.float32)
    elif mode == 2:
        lvl = lvl * (1 + (x < 0).to(torch.float32))
    # ties as float arithmetic, not bool logic: bool outputs vectorise badly in inductor
    return lvl, up * (D < 1).to(torch.float32)


# The compiled kernels get the mode and the top level L as integer constants of their
# own code object (see _closure_variant), not as arguments, and make the float L
# inside: torch.compile treats float arguments (and float closure cells) as symbols,
# and inductor then compiled the first value it saw into the clamp, so a second
# variant in the same process rounded with the first one's L (the first-call check
# caught it).


def _make_sr(mode: int, levels: int, dtype=None):
    def stochastic_round(x, a, s, s2, base, out):
        """Round blocks x (m, nb, B) into ``out``; returns tie flags (m, nb, B) uint8."""
        L = float(levels)
        lvl, tie = _round_half(x, a, s, R_.hash24(_index(x, base), 0, s2), L, mode)
        out.copy_(lvl)
        return tie.to(torch.uint8)

    return stochastic_round


def _sr_eager(x, a, s, u, L: float, mode: int, out):
    """The same rounding with all digits given: u (m, nb, B) int32. Returns bool ties."""
    if mode == 0:
        t = torch.sub(x, a).mul_(s)  # <= L without a clamp: see _scaled
    else:
        t = x.abs().mul_(s).clamp_(max=L)
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


_VARIANTS: dict = {}


def _variant(name: str, factory, key) -> "Kernel":
    k = _VARIANTS.get((name, key))
    if k is None:
        k = _VARIANTS[(name, key)] = _closure_variant(name, factory, key)
    return k


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


def _make_fused(mode: int, levels: int, dtype=None):
    def scale_and_round(x, s2, base, out):
        """Scales and rounding of nb blocks in one compiled call (quant and ternary).

        For quant (mode 0) only whether there is a tie comes back: ties need t < 0.5,
        the lowest half level, and then have probability 2**-24, so they are rare
        enough that a second pass to locate them is cheaper on average than writing a
        flag per element. Ternary values mostly lie below 0.5: flags.
        """
        L = float(levels)
        a, R, s = _scales(x, L, mode)
        lvl, tie = _round_half(x, a, s, R_.hash24(_index(x, base), 0, s2), L, mode)
        out.copy_(lvl)
        if mode == 0:
            return a, R, s, tie.amax()
        return a, R, s, tie.to(torch.uint8)

    return scale_and_round


def _ties(x, a, s, seeds, start: int, L: float, mode: int, out) -> torch.Tensor:
    """Where the first digit leaves the rounding open (bool, like x); eager."""
    return _sr_eager(x, a, s, block_digits(seeds, x.shape[1], x.shape[2], start), float(L), mode,
                     torch.empty_like(out))


# --------------------------------------------------------------------------------------
# The eager forms in cache-sized chunks.
#
# ATen runs one loop per operation, so an eager kernel makes one pass over its data per
# operation: over a 16M-element tensor each of the rounding's ~20 operations streamed 64
# MB through memory and allocated (and faulted in) a temporary of that size. These forms
# cut the data into chunks of at most EAGER_CHUNK elements and run each chunk's fixed
# sequence of operations in place in per-thread scratch buffers that stay in the cache
# (gossip.compress._scratch): the input is read once and the output written once.
#
# The digits: hash24 starts with (i + s1) * M1 (mod 2**32), which for a run of
# consecutive indices e0 + j is j * M1 + (e0 + s1) * M1: one add of a per-run constant
# to a cached table of j * M1. The rest of hash24 follows, step by step and in place,
# in the same wrapping 32-bit arithmetic (NumPy's uint32 on the CPU, USE_NUMPY). The
# rounding: D = F - u is taken as u - F in one operation, torch.sub(u, frac,
# alpha=2**24) (frac * 2**24 is exact, so fused or not it rounds once, and u - F
# rounds to -D exactly); "up" (D > 0) is u - F < 0 as fp32 0/1 (ATen's comparisons
# vectorise for an output of the input's dtype), and the level floor(t) + up. A tie
# (0 < D < 1) needs t < 0.5, so a chunk whose smallest t is 0.5 or more has none; in the
# others, frac(max(u - F, -1)) < 0 exactly at the ties, which are then resolved
# (tie_levels) before the chunk's codes are stored. The same IEEE operations on the
# same values as _sr_eager and the compiled kernels: the same bits.
# --------------------------------------------------------------------------------------

#: elements per chunk of the chunked eager forms on the CPU: their three scratch buffers
#: of 4-byte values (3 MiB) stay in the caches, and a chunk is long enough that the cost
#: of a call (a few microseconds in ATen, ~40 calls a chunk) stays small against the
#: work. On an AMD EPYC (1 thread, 16M values) the 8-bit round trip took 1.5-2 times as
#: long in chunks of 2**15, whose buffers fit a core's L2 cache, and about the same in
#: chunks of 2**17 to 2**19
EAGER_CHUNK = 1 << 18
#: elsewhere (a GPU pays per kernel launch, not per pass over memory): chunks this large
EAGER_CHUNK_OTHER = 1 << 24
_COUNTER_PRODUCTS: dict = {}


def _wrap32(v: int) -> int:
    """An integer modulo 2**32, as the int32 value with those bits."""
    v &= R._MASK32
    return v - (1 << 32) if v >= 1 << 31 else v


def _as_int32(v: torch.Tensor) -> torch.Tensor:
    """int64 values modulo 2**32, as int32."""
    return (((v + (1 << 31)) & R._MASK32) - (1 << 31)).to(torch.int32)


def _counter_products(n: int, device) -> torch.Tensor:
    """(j * M1) mod 2**32 for j = 0 .. n - 1 (int32), kept per device."""
    t = _COUNTER_PRODUCTS.get(device)
    if t is None or t.numel() < n:
        t = _COUNTER_PRODUCTS[device] = _as_int32(torch.arange(n, dtype=torch.int64, device=device) * R._H1)
    return t[:n]


def _chunk_size(device) -> int:
    return EAGER_CHUNK if device.type == "cpu" else EAGER_CHUNK_OTHER


def _plan(m: int, nb: int, J: int, N: int, CH: int):
    """Chunks (r0, r1, b0, b1, i0, i1) of the columns [i0, i1) of J planes of N columns
    in blocks [b0, b1) of rows [r0, r1): pieces of one block when a block holds a chunk
    or more, else whole blocks of one row when a row does, else whole rows."""
    B = J * N
    if B >= CH:
        n = max(1, CH // J)
        for r in range(m):
            for b in range(nb):
                for i0 in range(0, N, n):
                    yield r, r + 1, b, b + 1, i0, min(N, i0 + n)
    elif nb * B >= CH:
        kb = CH // B
        for r in range(m):
            for b0 in range(0, nb, kb):
                yield r, r + 1, b0, min(nb, b0 + kb), 0, N
    else:
        rr = max(1, CH // (nb * B))
        for r0 in range(0, m, rr):
            yield r0, min(m, r0 + rr), 0, nb, 0, N


def _run_bases(S1: list, plan: list, J: int, N: int, B: int, start: int, device) -> list:
    """Per chunk of ``plan``: (e + s1) * M1 mod 2**32 (int32) of the first element e =
    start + i0 + b B + j N of each of its runs (row r, block b, plane j), shaped (rr, kb,
    J, 1) to broadcast against the chunk."""
    m = len(S1)
    single = [c for c in plan if c[1] - c[0] == 1 and c[3] - c[2] == 1]
    res: dict = {}
    if single:  # one block of one row per chunk (pieces of blocks): all in one go
        e = torch.tensor([start + i0 + b0 * B + S1[r0] for r0, _, b0, _, i0, _ in single], dtype=torch.int64)
        v = _as_int32((e.view(-1, 1) + torch.arange(J, dtype=torch.int64) * N) * R._H1).to(device)
        for c, row in zip(single, v.view(-1, 1, 1, J, 1).unbind(0)):
            res[c] = row
    if len(single) < len(plan):  # runs of whole blocks (i0 = 0)
        nb = max(c[3] for c in plan)
        w = (torch.tensor(S1, dtype=torch.int64).view(m, 1, 1)
             + (torch.arange(nb, dtype=torch.int64) * B + start).view(1, nb, 1)
             + (torch.arange(J, dtype=torch.int64) * N).view(1, 1, J))
        w = _as_int32(w * R._H1).to(device).unsqueeze(-1)
        for c in plan:
            if c not in res:
                res[c] = w[c[0]:c[1], c[2]:c[3]]
    return [res[c] for c in plan]


_CONSTS: dict = {}


def _consts(device) -> dict:
    """0-d tensors of the chunked forms' constants, per device (a Python number operand
    costs ATen a conversion to a tensor at every call)."""
    c = _CONSTS.get(device)
    if c is None:
        i32 = {k: torch.tensor(v, dtype=torch.int32, device=device) for k, v in
               (("m20", 0xFFFFF), ("m24", 0xFFFFFF), ("h2", R._H2), ("s12", 12), ("s8", 8), ("s15", 15))}
        f32 = {k: torch.tensor(v, dtype=torch.float32, device=device) for k, v in (("zero", 0.0), ("neg1", -1.0))}
        c = _CONSTS[device] = {**i32, **f32}
    return c


def _digits_into(h, t, P, base, s2, K) -> None:
    """hash24 of a chunk's elements into h (int32, (rr, kb, J, n)), given P = j * M1 for
    the columns (n), the runs' bases and the seeds' high halves s2 (int32 (rr, 1, 1, 1));
    t: int32 scratch of h's shape; K: :func:`_consts`. The steps of _random.hash32 and
    hash24."""
    torch.add(P, base, out=h)  # (i + s1) * M1
    h.bitwise_xor_(s2)
    torch.bitwise_right_shift(h, K["s12"], out=t)
    t.bitwise_and_(K["m20"])  # the logical shift
    h.bitwise_xor_(t)
    h.mul_(K["h2"])
    h.bitwise_right_shift_(K["s8"])
    h.bitwise_and_(K["m24"])  # u, the top 24 bits
    torch.bitwise_right_shift(h, K["s15"], out=t)
    h.bitwise_xor_(t)  # u ^ (u >> 15)


#: on the CPU, NumPy hashes the digits with its unsigned 32-bit operations (its right
#: shifts are logical: 8 operations instead of 10, and a call costs less; the same
#: integers) and casts the 8-bit codes (ATen's fp32 to uint8 conversion has no vector
#: code); False: torch's operations, as on other devices
USE_NUMPY = True


def _digits_into_np(h, t, P, base, s2) -> None:
    """:func:`_digits_into` in NumPy on uint32 views of the same buffers (h, t, P: arrays;
    base and s2: uint32 arrays or scalars)."""
    np.add(P, base, out=h)  # (i + s1) * M1
    np.bitwise_xor(h, s2, out=h)
    np.right_shift(h, 12, out=t)
    np.bitwise_xor(h, t, out=h)
    np.multiply(h, np.uint32(R._H2), out=h)
    np.right_shift(h, 8, out=h)  # u, the top 24 bits
    np.right_shift(h, 15, out=t)
    np.bitwise_xor(h, t, out=h)  # u ^ (u >> 15)


def _u32(t: torch.Tensor):
    return t.numpy().view(np.uint32)


def _chunk_levels(xc, h, ff, uf, tf, a4c, s4c, Lt, K, mode: int):
    """One chunk of :func:`_eager_round`: its levels into ``ff`` (fp32) from its digits
    ``h``, ``uf`` and ``tf`` the fp32 views of the scratch; the positions of its ties
    (``nonzero`` rows), or None when it has none."""
    uf.copy_(h)  # the digits u in fp32 (exact: below 2**24); tf takes h's place
    if mode == 0:
        torch.sub(xc, a4c, out=tf).mul_(s4c)  # t <= L without a clamp: see _scaled
    else:
        torch.abs(xc, out=tf).mul_(s4c)
        torch.minimum(tf, Lt, out=tf)  # clamp(max=L)
    low = tf.amin().item() < 0.5  # ties need t < 0.5
    torch.floor(tf, out=ff)
    tf.sub_(ff)  # frac(t)
    torch.sub(uf, tf, alpha=_TWO24, out=uf)  # u - F = -D
    tie = None
    if low:
        torch.maximum(uf, K["neg1"], out=tf)
        if tf.frac_().amin().item() < 0:  # some -1 < u - F < 0: ties
            tie = ((uf > -1) & (uf < 0)).nonzero()
    torch.lt(uf, K["zero"], out=tf)  # up
    ff.add_(tf)
    if mode:
        torch.lt(xc, K["zero"], out=tf)  # x < 0
        if mode == 1:
            torch.add(tf, ff, alpha=2, out=ff)  # 2 level + [x < 0]
        else:
            ff.addcmul_(ff, tf)  # level (1 + [x < 0])
    return tie


def _eager_round(x4, a, s, keys, seeds, start: int, L: float, mode: int, store) -> None:
    """Stochastic rounding (as _sr_eager, ties resolved) of x4 (m, nb, J, N): J planes of
    N columns per block, element j N + i of its block (a, s: (m, nb, 1)), chunk by chunk;
    ``store(r0, r1, b0, b1, i0, i1, codes, scratch)`` takes each chunk's levels, fp32 (rr,
    kb, J, n), with an int32 scratch buffer of their size."""
    m, nb, J, N = x4.shape
    B = J * N
    dev = x4.device
    CH = _chunk_size(dev)
    K = _consts(dev)
    s1, s2 = R.seeds32(seeds)
    S1 = s1.tolist()
    s2t = s2.to(dev).view(m, 1, 1, 1)
    a4, s4 = a.view(m, nb, 1, 1), s.view(m, nb, 1, 1)
    Lt = torch.tensor(L, dtype=torch.float32, device=dev)
    P = _counter_products(min(N, max(1, CH // J)), dev)
    f32 = torch.float32
    plan = list(_plan(m, nb, J, N, CH))
    bases = _run_bases(S1, plan, J, N, B, start, dev)
    cmax = max(CH, J)
    flat = (_scratch.buffer("eager.h", cmax, torch.int32, dev), _scratch.buffer("eager.t", cmax, torch.int32, dev),
            _scratch.buffer("eager.f", cmax, f32, dev))
    views: dict = {}  # per chunk shape: the buffers' views, made once (a call costs microseconds)
    use_np = USE_NUMPY and dev.type == "cpu"
    if use_np:
        S2n = _u32(s2.view(m, 1, 1, 1))
        S2u = [np.uint32(v) for v in S2n.reshape(-1).tolist()]
    for (r0, r1, b0, b1, i0, i1), base in zip(plan, bases):
        rr, kb, n = r1 - r0, b1 - b0, i1 - i0
        shape = (rr, kb, J, n)
        v = views.get(shape)
        if v is None:
            cnt = rr * kb * J * n
            h, t, ff = (f[:cnt].view(shape) for f in flat)
            Pn = P[:n].view(1, 1, 1, n)
            v = views[shape] = (h, t, ff, t.view(f32), h.view(f32), Pn,
                                (_u32(h), _u32(t), _u32(Pn)) if use_np else None)
        h, t, ff, uf, tf, Pn, npv = v
        xc = x4[r0:r1, b0:b1, :, i0:i1]
        if npv is None:
            _digits_into(h, t, Pn, base, s2t[r0:r1], K)
        else:
            _digits_into_np(*npv, _u32(base), S2u[r0] if r1 - r0 == 1 else S2n[r0:r1])
        tie = _chunk_levels(xc, h, ff, uf, tf, a4[r0:r1, b0:b1], s4[r0:r1, b0:b1], Lt, K, mode)
        if tie is not None:
            rl, bl, jl, il = tie.unbind(1)
            r, b = rl + r0, bl + b0
            ff[rl, bl, jl, il] = tie_levels(xc[rl, bl, jl, il], a4[r, b, 0, 0], s4[r, b, 0, 0], keys[r],
                                            b * B + jl * N + il + (start + i0), L, mode)
        store(r0, r1, b0, b1, i0, i1, ff, h)


def _store_codes(dst, codes, scratch) -> None:
    """dst = codes (fp32 integers); scratch: an int32 buffer of at least codes' size.

    Into uint8, ATen's fp32 conversion has no vector code: on the CPU NumPy's cast (with
    it) writes the bytes, elsewhere the codes go through int32 (two vectorised passes)."""
    if dst.dtype != torch.uint8:
        dst.copy_(codes)
    elif USE_NUMPY and dst.device.type == "cpu":
        with np.errstate(invalid="ignore"):  # NaN codes of non-finite input, which encode then refuses
            np.copyto(dst.numpy(), codes.numpy(), casting="unsafe")
    else:
        i32 = scratch if scratch.shape == codes.shape else scratch.view(-1)[: codes.numel()].view(codes.shape)
        i32.copy_(codes)
        dst.copy_(i32)


def _round_into(x, a, s, keys, seeds, start: int, L: float, mode: int, out) -> None:
    """Round blocks x (m, nb, B) into the integer codes ``out`` (m, nb, B), chunk by chunk."""
    o4 = out.unsqueeze(2)

    def store(r0, r1, b0, b1, i0, i1, ff, scratch):
        _store_codes(o4[r0:r1, b0:b1, :, i0:i1], ff, scratch)

    _eager_round(x.unsqueeze(2), a, s, keys, seeds, start, float(L), mode, store)


def quant_planar_encode_eager(x, keys, seeds, start: int, bits: int, out):
    """The eager form of :func:`quant_planar_encode`: blocks x (m, nb, 8N) -> packed codes
    out (m, nb, bits * N), rounding and packing chunk by chunk; returns (a, R, s)."""
    m, nb, B = x.shape
    N = B // 8
    L = float((1 << bits) - 1)
    a, R, s = _scales(x, L, 0)
    if B % 8:  # a last, shorter block: its last column is padded (bitpack.pack_planes)
        from .bitpack import pack_planes

        codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
        _round_into(x, a, s, keys, seeds, start, L, 0, codes)
        pack_planes(codes, bits, out)
        return a, R, s
    o4 = out.view(m, nb, bits, N)
    dev = x.device
    if 8 % bits == 0:
        k = 8 // bits  # codes per byte: byte row q holds planes q k .. q k + k - 1

        def store(r0, r1, b0, b1, i0, i1, ff, scratch):
            f5 = ff.view(r1 - r0, b1 - b0, bits, k, i1 - i0)
            acc = f5[:, :, :, 0]
            for r in range(1, k):  # byte = sum of code << (bits r): exact in fp32
                acc.add_(f5[:, :, :, r], alpha=1 << (bits * r))
            _store_codes(o4[r0:r1, b0:b1, :, i0:i1], acc, scratch)
    else:
        def store(r0, r1, b0, b1, i0, i1, ff, scratch):
            shape = (r1 - r0, b1 - b0, i1 - i0)
            cnt = shape[0] * shape[1] * shape[2]
            w = _scratch.buffer("eager.word", cnt, torch.int64, dev).view(shape)
            tmp = _scratch.buffer("eager.wtmp", cnt, torch.int64, dev).view(shape)
            w.copy_(ff[:, :, 0])
            for j in range(1, 8):  # the column's 8 b-bit word
                tmp.copy_(ff[:, :, j])
                w.add_(tmp, alpha=1 << (bits * j))
            for q in range(bits):
                torch.bitwise_right_shift(w, 8 * q, out=tmp)
                o4[r0:r1, b0:b1, q, i0:i1].copy_(tmp.bitwise_and_(0xFF))

    _eager_round(x.unflatten(-1, (8, N)), a, s, keys, seeds, start, L, 0, store)
    return a, R, s


def quant_planar_decode_eager(p, a, step, bits: int, out) -> None:
    """The eager form of :func:`quant_planar_decode`, chunk by chunk: packed codes p (m,
    nb, bits * N) -> out (m, nb, 8N) fp32 = code * step + a."""
    m, nb, nby = p.shape
    N = nby // bits
    if out.shape[2] != 8 * N:  # a last, shorter block: its last column is padded
        from .bitpack import unpack_planes

        _affine_chunks(unpack_planes(p, bits, out.shape[2]), a, step, out)
        return
    p4, o4 = p.view(m, nb, bits, N), out.view(m, nb, 8, N)
    a4, s4 = a.view(m, nb, 1, 1), step.view(m, nb, 1, 1)
    dev = p.device
    mask = (1 << bits) - 1
    k = 8 // bits
    for r0, r1, b0, b1, i0, i1 in _plan(m, nb, 8, N, _chunk_size(dev)):
        oc = o4[r0:r1, b0:b1, :, i0:i1]
        shape = (r1 - r0, b1 - b0, i1 - i0)
        cnt = shape[0] * shape[1] * shape[2]
        if 8 % bits == 0:
            u8 = _scratch.buffer("eager.bytes", cnt * bits, torch.uint8, dev).view(shape[0], shape[1], bits, shape[2])
            pc = p4[r0:r1, b0:b1, :, i0:i1]
            for r in range(k):  # the codes at bits [bits r, bits r + bits) of every byte row: planes r, r + k, ...
                if r == 0:
                    torch.bitwise_and(pc, mask, out=u8)
                else:
                    torch.bitwise_right_shift(pc, bits * r, out=u8)
                    if r < k - 1:
                        u8.bitwise_and_(mask)
                oc[:, :, r::k].copy_(u8)
        else:
            w = _scratch.buffer("eager.word", cnt, torch.int64, dev).view(shape)
            tmp = _scratch.buffer("eager.wtmp", cnt, torch.int64, dev).view(shape)
            w.copy_(p4[r0:r1, b0:b1, 0, i0:i1])
            for q in range(1, bits):
                tmp.copy_(p4[r0:r1, b0:b1, q, i0:i1])
                w.bitwise_or_(tmp.bitwise_left_shift_(8 * q))
            for j in range(8):
                torch.bitwise_right_shift(w, bits * j, out=tmp)
                oc[:, :, j].copy_(tmp.bitwise_and_(mask))
        oc.mul_(s4[r0:r1, b0:b1]).add_(a4[r0:r1, b0:b1])  # two roundings, as the compiled kernel


def _affine_chunks(codes, a, step, out) -> None:
    """out (m, nb, B) = codes * step + a, chunk by chunk (the codes convert to fp32
    exactly, then one rounding for the product and one for the sum)."""
    m, nb, B = out.shape
    c4, o4 = codes.unsqueeze(2), out.unsqueeze(2)
    a4, s4 = a.view(m, nb, 1, 1), step.view(m, nb, 1, 1)
    for r0, r1, b0, b1, i0, i1 in _plan(m, nb, 1, B, _chunk_size(out.device)):
        oc = o4[r0:r1, b0:b1, :, i0:i1]
        oc.copy_(c4[r0:r1, b0:b1, :, i0:i1])
        oc.mul_(s4[r0:r1, b0:b1]).add_(a4[r0:r1, b0:b1])


# --------------------------------------------------------------------------------------
# quant's rounding as two compiled loops, when a block splits into rows of C elements
# (C a power of two from 256 to 4096): the block's [min, max] (one read of the input),
# then the rounding of the rows, whose element indices are the row's first index (a
# scalar) plus a lane ramp 0..C-1 loaded from a small tensor. Inductor writes a vector
# of consecutive indices (`Vectorized<int32_t>::arange`) as 16 scalar inserts, about 35
# instructions per 16 elements, which was as much work as the hash itself; the loaded
# ramp costs one load from L1 cache. The same codes and scales as `scale_and_round`'s
# one-loop form (the integer hash is exact, the float steps are the same IEEE ops).
# --------------------------------------------------------------------------------------

_LANES_MIN, _LANES_MAX = 256, 4096
#: whether quant's 8-bit lane kernels take the calls they fit: ``None`` decides by the CPU
#: (:func:`lanes_pay`); ``True`` or ``False`` forces it (the tests use ``True``)
LANES: bool | None = None
#: calls of fewer elements keep the one-loop kernels: a second compiled call costs about
#: 50 us, more than the lane form saves there (equal at 2**18 elements, 30-40 % faster
#: 8-bit encodes at 2**24)
LANES_MIN_NUMEL = 1 << 18
_RAMPS: dict = {}


def lane_width(B: int) -> int:
    """Row length C for the lane kernels of blocks of B elements (the largest power of
    two up to 4096 dividing B), or 0 when it would be below 256 (short rows pay a
    horizontal reduction each: the one-loop kernel is used)."""
    C = min(B & -B, _LANES_MAX)
    return C if C >= _LANES_MIN else 0


def lanes_pay() -> bool:
    """Whether quant's 8-bit lane kernels serve the compiled calls they fit, on this CPU.

    They pay where inductor's vector code is 512 bits wide (AVX-512): a vector of 16
    consecutive int32 indices is then 16 scalar inserts, which the loaded ramp avoids;
    on an Intel Xeon they made the 8-bit encode of 16M values 30-40 % faster. With
    256-bit vectors (AVX2; measured on an AMD EPYC, one thread, 16M values) the one-loop
    kernel was the faster one: the 8-bit encode took 39 ms against 163 ms in lane form.
    So at 8 bits the lane kernels are used with 512-bit vectors only. Both forms give
    the same bytes, so the choice never changes a payload. (At 2 and 4 bits the lane
    kernels serve every CPU: there the one-call planar encode was only 14 % faster on
    that AMD EPYC, 64 against 74 ms, and it allocates a column word of half the
    payload's size at every call.) :data:`LANES` overrides it.
    """
    if LANES is not None:
        return bool(LANES)
    return _vector_bits() >= 512


@functools.lru_cache(maxsize=1)
def _vector_bits() -> int:
    """Width in bits of the vector code inductor writes for this CPU (0: none). Asked only
    once a kernel compiles, when inductor has made the same check (it caches it)."""
    try:
        from torch._inductor import cpu_vec_isa

        return int(cpu_vec_isa.pick_vec_isa().bit_width())
    except Exception:  # an inductor without this helper, or no usable vector ISA
        return 0


def _ramp(C: int, device) -> torch.Tensor:
    r = _RAMPS.get(device)
    if r is None:
        r = _RAMPS[device] = torch.arange(_LANES_MAX, dtype=torch.int32, device=device)
    return r[:C]


def _make_minmax(levels: int):
    def quant_minmax(x):
        """Offset a (the block's min), range R and inverse step s of blocks x (m, nb, B)."""
        return _scales(x, float(levels), 0)

    return quant_minmax


def _make_round_lanes(levels: int, dtype=None):
    def quant_round_lanes(x4, a, s, s2, base, ramp, out4):
        """Round blocks x4 (m, nb, R, C) into the codes ``out4``; returns a 0-d int32 that is
        positive iff some element is a tie (a, s: (m, nb, 1, 1); ramp: 0..C-1 int32).

        Written without comparisons (a comparison becomes a mask register, which inductor's
        vector code turns into a vector and back, three instructions): with D = F - u as in
        _round_half, g = frac(t) - u * 2**-24 is D * 2**-24 exactly (power-of-two scalings
        commute with rounding here), so ceil(g) is 1 iff D > 0 ("up") and 0 otherwise
        (-1 < g <= 0); and a tie, 0 < D < 1, is up == 1 with trunc(D) == 0, i.e.
        min(up, 1 - trunc(D)) == 1 (it is <= 0 for every other element).
        """
        m, nb, R, C = x4.shape
        dev = x4.device
        i = base.view(-1, 1, 1, 1) + (torch.arange(nb, dtype=torch.int32, device=dev) * (R * C)).view(1, nb, 1, 1) \
            + (torch.arange(R, dtype=torch.int32, device=dev) * C).view(1, 1, R, 1) + ramp.view(1, 1, 1, C)
        u = R_.hash24(i, 0, s2.view(-1, 1, 1, 1))
        t = (x4 - a) * s  # <= L without a clamp: see _scaled
        f = t.floor()
        g = (t - f) - u.to(torch.float32) * 2.0**-24  # a literal: a float global becomes a tensor input
        up = g.ceil()
        out4.copy_((f + up).to(torch.int32))
        tie = torch.minimum(up.to(torch.int32), 1 - (g * (1 << 24)).to(torch.int32))
        return tie.amax(dim=-1).amax()

    return quant_round_lanes




def scale_and_round(x, keys, seeds, start: int, L: float, mode: int, out):
    """Block scales and stochastic rounding for quant (mode 0) and ternary (mode 2).

    ``start``: index of x[:, 0, 0] in its row. Returns (a, R, s): offset, range and
    inverse step per block, (m, nb, 1) each.
    """
    m, nb, B = x.shape
    C = lane_width(B) if mode == 0 and x.numel() >= LANES_MIN_NUMEL else 0
    if C:
        kr = _variant("quant_round_lanes", _make_round_lanes, (int(L), out.dtype))
        compiled = _want_compiled(kr, x.numel(), x.device)
        if compiled and not lanes_pay():
            # on this CPU the one-loop kernel is the faster form: it compiles now, as the pair would have
            _follow(_variant("scale_and_round", _make_fused, (mode, int(L), out.dtype)), kr)
        elif compiled:
            km = _variant("quant_minmax", _make_minmax, (int(L),))
            _follow(km, kr)  # the pair compiles together (auto's decision is kr's)
            a, R, s = run(km, x.numel(), x)
            s2, base = _seed_args(seeds, start)
            flag = run(kr, x.numel(), x.view(m, nb, B // C, C), a.view(m, nb, 1, 1), s.view(m, nb, 1, 1),
                       s2, base, _ramp(C, x.device), out.view(m, nb, B // C, C))
            if int(flag) > 0:  # rare: locate the ties with a second pass and resolve them
                resolve_ties(out, _ties(x, a, s, seeds, start, L, mode, out), x, a, s, keys, start, float(L), mode)
            return a, R, s
    k = _variant("scale_and_round", _make_fused, (mode, int(L), out.dtype))
    if _want_compiled(k, x.numel(), x.device):
        s2, base = _seed_args(seeds, start)
        a, R, s, flags = run(k, x.numel(), x, s2, base, out)
        if flags.dim() == 0:  # whether there is a tie: locate them, if any, with a second pass
            if float(flags) != 0:
                resolve_ties(out, _ties(x, a, s, seeds, start, L, mode, out), x, a, s, keys, start, float(L), mode)
        elif bool(flags.any()):
            resolve_ties(out, flags.bool(), x, a, s, keys, start, float(L), mode)
    else:
        a, R, s = _scales(x, float(L), mode)
        _round_into(x, a, s, keys, seeds, start, float(L), mode, out)
    return a, R, s


def stochastic_round(x, a, s, keys, seeds, start: int, L: float, mode: int, out) -> None:
    """Round nb blocks x (m, nb, B) into the integer codes ``out`` (m, nb, B).

    ``start``: index of x[:, 0, 0] in its row (names the digits of every element).
    """
    m, nb, B = x.shape
    k = _variant("stochastic_round", _make_sr, (mode, int(L), out.dtype))
    if _want_compiled(k, x.numel(), x.device):
        s2, base = _seed_args(seeds, start)
        flags = run(k, x.numel(), x, a, s, s2, base, out)
        if bool(flags.any()):
            resolve_ties(out, flags.bool(), x, a, s, keys, start, float(L), mode)
    else:
        _round_into(x, a, s, keys, seeds, start, float(L), mode, out)


# --------------------------------------------------------------------------------------
# quant with 1..7 bits, blocks of a multiple of 8 elements: rounding and packing in
# one pass (encode), unpacking and the affine map in one pass (decode). Codes of a
# block of B = 8 N elements are packed in planes (bitpack.pack_planes): code j * N + i
# is bits [b j, b j + b) of the 8b-bit word i, whose byte q is byte q * N + i of the
# block's codes. Each step reads and writes contiguous runs, so it vectorises.
# --------------------------------------------------------------------------------------


def _closure_variant(name: str, factory, key) -> Kernel:
    """A Kernel whose function comes from ``factory(*key)`` under its own code object
    (torch.compile caches per code object: one cache and one graph per variant)."""
    f = factory(*key)
    tag = "_" + "_".join(str(p).replace(".", "_").replace("torch_", "") for p in key)
    code = f.__code__.replace(co_name=f.__name__ + tag)
    g = types.FunctionType(code, f.__globals__, code.co_name, f.__defaults__, f.__closure__)
    return Kernel(name + tag, g)


def _make_planar_encode(bits: int):
    wide = torch.int32 if bits <= 4 else torch.int64

    def quant_planar_encode(x4, s2, base, out4):
        """x4 (m, nb, 8, N) -> out4 (m, nb, bits, N) uint8; returns a, R, s (m, nb, 1), a 0-d
        int32 that is positive iff some element is a tie, and the words."""
        L = float((1 << bits) - 1)
        m, nb, _, N = x4.shape
        a = x4.amin(dim=(2, 3)).view(m, nb, 1)
        R = x4.amax(dim=(2, 3)).view(m, nb, 1) - a
        s = safe_inverse(L, R)
        dev = x4.device
        e0 = base + (torch.arange(nb, dtype=torch.int32, device=dev) * (8 * N)).view(1, nb, 1) \
            + torch.arange(N, dtype=torch.int32, device=dev).view(1, 1, N)
        word = tie = None
        for j in range(8):  # the comparison-free rounding and tie flag of quant_round_lanes
            u = R_.hash24(e0 + j * N, 0, s2)
            t = (x4[:, :, j] - a) * s
            f = t.floor()
            g = (t - f) - u.to(torch.float32) * 2.0**-24
            up = g.ceil()
            c = (f + up).to(wide) << (bits * j)
            word = c if word is None else word | c
            tj = torch.minimum(up.to(torch.int32), 1 - (g * (1 << 24)).to(torch.int32))
            tie = tj if tie is None else torch.maximum(tie, tj)
        # `word` is returned, so it is computed once into a buffer (n / 8 words) and the
        # planes are cut from it (one pointwise write of all planes, not one per plane:
        # writing plane by plane makes inductor blend each plane into the old contents)
        shifts = (torch.arange(bits, dtype=wide, device=dev) * 8).view(1, 1, bits, 1)
        out4.copy_(((word.unsqueeze(2) >> shifts) & 0xFF).to(torch.uint8))
        return a, R, s, tie.amax(), word

    return quant_planar_encode


#: widths whose planar encode takes the lane kernels (min/max, then one call per byte row).
#: Their codes never span two bytes; at 1 bit the byte row's 8 codes made inductor split
#: the call into loops over buffers of the input's size (slower than the one-call encode),
#: and 3, 5, 6 and 7 bits have codes across bytes
PLANAR_LANES_BITS = (2, 4)


def _make_planar_lanes(bits: int):
    k = 8 // bits  # codes per byte (no code spans two bytes)

    def quant_planar_lanes(x5, a, s, s2, base, ramp, out4):
        """Round and pack the codes of one byte row: x5 (m, nb, k, R, C), k = 8 // bits, the
        k planes whose codes share a byte, into out4 (m, nb, R, C) uint8; returns a 0-d
        int32 that is positive iff some element is a tie (a, s: (m, nb, 1, 1); base: the
        hash input of the row's first plane's first element; ramp: 0..C-1 int32).

        Byte q of column i holds the codes of planes q k .. q k + k - 1, plane q k + r at
        bits [bits r, bits r + bits): each byte is a function of its own k values, so every
        value is read once and every byte written once, with no column word in between.
        One call per byte row q (``bits`` calls): with the byte rows as a dimension of one
        call, inductor split the rounding, the tie flag and the store into three loops
        over different index shapes and kept the rounding digits in two buffers of the
        input's size; one byte row has quant_round_lanes' shape and fuses like it, one
        loop. Rounding and tie flag are quant_round_lanes' comparison-free ones.
        """
        m, nb, _, R, C = x5.shape
        N = R * C  # columns of a block (8 N values)
        dev = x5.device
        i = base.view(-1, 1, 1, 1) + (torch.arange(nb, dtype=torch.int32, device=dev) * (8 * N)).view(1, nb, 1, 1) \
            + (torch.arange(R, dtype=torch.int32, device=dev) * C).view(1, 1, R, 1) + ramp.view(1, 1, 1, C)
        s2 = s2.view(-1, 1, 1, 1)
        byte = tie = None
        for r in range(k):
            u = R_.hash24(i + r * N, 0, s2)
            t = (x5[:, :, r] - a) * s  # <= L without a clamp: see _scaled
            f = t.floor()
            g = (t - f) - u.to(torch.float32) * 2.0**-24
            up = g.ceil()
            c = (f + up).to(torch.int32)
            byte = c if byte is None else byte | (c << (bits * r))
            tr = torch.minimum(up.to(torch.int32), 1 - (g * (1 << 24)).to(torch.int32))
            tie = tr if tie is None else torch.maximum(tie, tr)
        out4.copy_(byte.to(torch.uint8))
        return tie.amax(dim=-1).amax()

    return quant_planar_lanes


def _make_planar_decode(bits: int):
    mask = (1 << bits) - 1
    straddle = any((bits * j) % 8 + bits > 8 for j in range(8))  # some code spans two bytes

    def quant_planar_decode(p4, a, step, qlo, qhi, sh, out4):
        """p4 (m, nb, bits, N) uint8 -> out4 (m, nb, 8, N) = code * step + a.

        Code j of a column is bits [bits j, bits j + bits) of its word: it lies in byte
        qlo[j] = bits j // 8 from bit sh[j] = bits j % 8, and runs into byte qhi[j] =
        qlo[j] + 1 when sh[j] + bits > 8. Each plane reads only those one or two bytes of
        the column (a gather along the byte dimension: one contiguous load each), where
        assembling the whole word for every plane read all ``bits`` bytes eight times.
        """
        w = p4[:, :, qlo].to(torch.int32)
        if straddle:
            w = w | (p4[:, :, qhi].to(torch.int32) << 8)
        codes = (w >> sh.view(1, 1, 8, 1)) & mask
        out4.copy_(codes.to(torch.float32) * step.unsqueeze(3) + a.unsqueeze(3))

    return quant_planar_decode


_DECODE_TABLES: dict = {}


def _decode_tables(bits: int, device):
    """(qlo, qhi, sh) of quant_planar_decode for ``bits``, kept per device."""
    t = _DECODE_TABLES.get((bits, device))
    if t is None:
        qlo = torch.tensor([(bits * j) // 8 for j in range(8)], device=device)
        t = _DECODE_TABLES[(bits, device)] = (
            qlo, torch.clamp(qlo + 1, max=bits - 1),
            torch.tensor([(bits * j) % 8 for j in range(8)], dtype=torch.int32, device=device))
    return t


_PLANAR: dict = {}


def _planar(kind: str, bits: int) -> Kernel:
    k = _PLANAR.get((kind, bits))
    if k is None:
        factory = _make_planar_encode if kind == "encode" else _make_planar_decode
        k = _PLANAR[(kind, bits)] = _closure_variant("quant_planar_" + kind, factory, (bits,))
    return k


def planar_wanted(bits: int, B: int, numel: int, device) -> bool:
    """Whether quant's one-pass planar kernels serve a group of blocks of B elements."""
    return 1 <= bits < 8 and B % 8 == 0 and _want_compiled(_planar("encode", bits), numel, device)


def quant_planar_encode(x, keys, seeds, start: int, bits: int, out):
    """Blocks x (m, nb, 8N) -> packed codes out (m, nb, bits * N); returns (a, R, s).

    At 2 and 4 bits, for calls of ``LANES_MIN_NUMEL`` values or more whose columns split
    into lane rows (N a multiple of 256): 1. the blocks' min, range and inverse step
    (``quant_minmax``); 2. the rounding and packing of each byte row (``quant_planar_lanes``,
    ``bits`` calls). Otherwise one call does both (``quant_planar_encode``). 3. If some
    element is a tie, the group is rounded again with the ties resolved. Both forms give
    the same bytes.
    """
    m, nb, B = x.shape
    N = B // 8
    s2, base = _seed_args(seeds, start)
    k = _planar("encode", bits)
    C = lane_width(N) if bits in PLANAR_LANES_BITS and x.numel() >= LANES_MIN_NUMEL else 0
    if C:
        # 2 and 4 bits, columns that split into lane rows: the blocks' min/max (as at 8
        # bits), then rounding and packing, one call per byte row
        L = (1 << bits) - 1
        km = _variant("quant_minmax", _make_minmax, (L,))
        kl = _variant("quant_planar_lanes", _make_planar_lanes, (bits,))
        _follow(km, k)  # the pair follows the planar encode's decision
        _follow(kl, k)
        a, R, s = run(km, x.numel(), x)
        kk = 8 // bits
        x6 = x.view(m, nb, bits, kk, N // C, C)
        o5 = out.view(m, nb, bits, N // C, C)
        a4, s4, ramp = a.view(m, nb, 1, 1), s.view(m, nb, 1, 1), _ramp(C, x.device)
        tie = max(int(run(kl, x.numel() // bits, x6[:, :, q], a4, s4, s2, _seed_args(seeds, start + q * kk * N)[1],
                          ramp, o5[:, :, q])) for q in range(bits))
    else:
        # one call: the planes share each column's index vector (inductor's vector arange)
        a, R, s, tie, _ = run(k, x.numel(), x.view(m, nb, 8, N), s2, base, out.view(m, nb, bits, N))
    if int(tie) > 0:  # rare: redo the group with ties resolved (exactly the same codes otherwise)
        from .bitpack import pack_planes

        codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
        tie = _sr_eager(x, a, s, block_digits(seeds, nb, B, start), float((1 << bits) - 1), 0, codes)
        resolve_ties(codes, tie, x, a, s, keys, start, float((1 << bits) - 1), 0)
        pack_planes(codes, bits, out)
    return a, R, s


def quant_planar_decode(p, a, step, bits: int, out) -> None:
    """Packed codes p (m, nb, bits * N) -> out (m, nb, 8N) fp32 = code * step + a."""
    m, nb, nby = p.shape
    N = nby // bits
    run(_planar("decode", bits), out.numel(), p.view(m, nb, bits, N), a, step, *_decode_tables(bits, p.device),
        out.view(m, nb, 8, N))


def resolve_ties(codes, tie, x, a, s, keys, start: int, L: float, mode: int) -> None:
    """Finish the rounding of the elements flagged in ``tie`` (in place in ``codes``)."""
    idx = tie.nonzero()
    if idx.numel() == 0:
        return
    r, b, k = idx.unbind(1)
    B = x.shape[2]
    codes[r, b, k] = tie_levels(x[r, b, k], a[r, b, 0], s[r, b, 0], keys[r], b * B + k + start, L,
                                mode).to(codes.dtype)


def tie_levels(xs, a, s, keys, i, L: float, mode: int) -> torch.Tensor:
    """Levels (fp32) of tie elements: values ``xs`` with their block's offset ``a`` and
    inverse step ``s``, their row's key and their index ``i`` in the row (1-D each)."""
    t = _scaled(xs, a, s, L, mode)
    f = t.floor()
    F = (t - f) * _TWO24
    # a tie means the first digit equals floor(F): only F's fraction is still open
    rem = (F - F.floor()).to(torch.float64)  # in (0, 1): the bits of frac(t) beyond the first 24
    up = torch.zeros_like(rem, dtype=torch.bool)
    open_ = torch.ones_like(up)
    level = 0
    while bool(open_.any()):
        seeds = R.stream_seeds(keys, R.STREAM_TIE + level)
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
    return lvl


# --------------------------------------------------------------------------------------
# Affine decode: out = codes * step + a (two roundings, no fused multiply-add).
# --------------------------------------------------------------------------------------


def _affine_compiled(codes, a, step, out):
    out.copy_(codes.to(torch.float32) * step + a)


def _affine_eager(codes, a, step, out):
    _affine_chunks(codes, a, step, out)


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
    # summed in int32: the sum modulo 2**32 is what is kept
    return (words * w).sum(dim=1, dtype=torch.int32).to(torch.int64) & 0xFFFFFFFF


_CHECKSUM_CHUNK = 1 << 14  # words per chunk off the CPU: no temporary of the payload's size


def checksum(words, w):
    """The payload rows' integrity sums: ``sum_j w[j] * words[:, j]`` modulo 2**32, int64 (m,).

    On the CPU one integer matrix-vector product (``torch.mv`` on int32: the products
    and their sum wrap modulo 2**32, and integer sums do not depend on their order, so
    every form gives the same bits). It reads each word once and writes nothing of the
    payload's size, with no scratch buffer to share between threads: on one core of an
    AMD EPYC it ran at about memcpy's time over the same bytes, 2-4x faster than the
    compiled elementwise product and sum, which is why this kernel is never compiled
    (``experiments/quant_parts.py`` times it). On one core of an Intel Xeon the
    compiled product and sum is the faster, at 0.6-0.9 of its time
    (``experiments/bench_checksum.py``). On other devices, the product and sum chunk by
    chunk."""
    if words.device.type == "cpu":
        return torch.mv(words, w).to(torch.int64) & 0xFFFFFFFF
    m, n = words.shape
    if n <= _CHECKSUM_CHUNK:
        return _checksum(words, w)
    acc = torch.zeros(m, dtype=torch.int64, device=words.device)
    for a in range(0, n, _CHECKSUM_CHUNK):
        b = min(n, a + _CHECKSUM_CHUNK)
        acc += (words[:, a:b] * w[a:b]).sum(dim=1, dtype=torch.int32)
    return acc & 0xFFFFFFFF


# --------------------------------------------------------------------------------------
# The parts a micro-benchmark times or watches on its own, under public names
# (gossip.compress.kernels exports them); each is the function the encoders call.
# --------------------------------------------------------------------------------------

def variant(name: str, factory, key) -> Kernel:
    """The kernel ``name`` specialised for ``key``: ``factory(*key)``, made once per
    process, with a compiled form of its own."""
    return _variant(name, factory, key)


def make_minmax(levels: int):
    """The 4-bit encoder's first compiled call: each block's offset, range and inverse
    step for ``levels`` levels (a new function: compile it, or run it through a
    ``variant``)."""
    return _make_minmax(levels)


def make_planar_lanes(bits: int):
    """The planar encoder's rounding and packing of one byte row, the row split into
    lanes, at ``bits`` bits (a new function, as ``make_minmax``)."""
    return _make_planar_lanes(bits)


def scales(x, L: float, mode: int):
    """Per block: offset a, range R and inverse step s, each (m, nb, 1), for ``L``
    levels in quantizer mode ``mode`` (0 affine, 1 signed, 2 ternary)."""
    return _scales(x, L, mode)


def seed_args(seeds: torch.Tensor, start: int):
    """The compiled kernels' seed arguments for rows with ``seeds`` whose first element
    has index ``start``: the seed's high half, and the first hash input."""
    return _seed_args(seeds, start)


def ramp(C: int, device) -> torch.Tensor:
    """The lane offsets 0, 1, ... (int32) that the lane kernels add to a row's first index."""
    return _ramp(C, device)


def element_index(x, base):
    """The index of every element of blocks ``x`` in its row, from ``base`` (int32), as
    the stochastic rounding hashes it."""
    return _index(x, base)


def round_half(x, a, s, u, L: float, mode: int):
    """Stochastic rounding's codes and tie flags from the elements' first digits ``u``
    (the offset ``a`` and inverse step ``s`` of ``scales``)."""
    return _round_half(x, a, s, u, L, mode)


def checksum_expression(words, w):
    """The checksums of the rows of ``words`` (int32) with weights ``w``, as one
    expression that torch.compile takes whole; ``checksum`` is what the wire uses."""
    return _checksum(words, w)


@contextlib.contextmanager
def watch_compiled():
    """Within the block, the names of the kernels whose calls take the compiled form, in
    the order of the calls: a list, yielded, that grows as they run."""
    global _want_compiled
    real, seen = _want_compiled, []

    def spy(k: Kernel, numel: int, device: torch.device) -> bool:
        want = real(k, numel, device)
        if want:
            seen.append(k.name)
        return want

    _want_compiled = spy
    try:
        yield seen
    finally:
        _want_compiled = real


@contextlib.contextmanager
def lanes_forced(on: bool | None = True):
    """Within the block, ``LANES`` is ``on``: True takes the lane kernels on any CPU
    (``lanes_pay`` keeps them to 512-bit vector code), None asks the CPU again."""
    global LANES
    before, LANES = LANES, on
    try:
        yield
    finally:
        LANES = before


@contextlib.contextmanager
def one_loop():
    """Within the block no row splits into lanes (``lane_width`` answers 0): the
    encoders take their one-loop kernels."""
    global lane_width
    real = lane_width
    lane_width = lambda B: 0  # noqa: E731
    try:
        yield
    finally:
        lane_width = real
