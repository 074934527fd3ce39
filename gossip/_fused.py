"""A fused CPU kernel for the simulation's D-PSGD step: the SGD update and the mixing
of a row in one pass over its values.

The vectorized simulation (:mod:`gossip.vectorized`) steps every node's model as a
row of one ``(n, d)`` matrix. Done with torch's element-wise operations, a D-PSGD
step with momentum reads and writes the rows of the parameters, the gradient, the
momentum, the update ``u`` and the weighted sum in ten passes; several of those
streams go through memory, and the step is bound by memory bandwidth there. This
kernel makes one pass per row: it reads the gradient, the momentum, the parameters
and the row's weighted sum, and writes the momentum and the parameters; ``u`` is
never stored.

It computes the same bits as torch's operations, element for element, because it
performs the same IEEE operations in the same order: each product and each sum
rounds on its own (the source is built with ``-ffp-contract=off``), and where torch's
CPU kernel computes ``a + alpha * b`` (``add`` with an ``alpha``) as one fused
multiply-add, so does ``fmaf`` here. Whether torch's build does so on this machine is
not assumed: :mod:`gossip.vectorized` compares the kernel with torch's operations on a
probe of every kind of segment before it uses it, and keeps torch's operations where
they differ.

The source is compiled at first use with the C compiler torch's inductor uses
(``$CC``, else ``cc``), for this machine's CPU, into ``$GOSSIP_CACHE/kernels`` (the
data sets' cache folder, ``~/.cache/gossip`` by default), keyed by the source, the
compiler and the CPU, and loaded with ``ctypes``. No compiler, a failed build or
``GOSSIP_FUSED=0``: :func:`library` returns None and callers keep torch's operations,
which give the same bits more slowly.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

__all__ = ["SOURCE", "library", "why_unavailable"]

#: kinds of a segment (a parameter tensor's columns of a row)
HAS_GRAD, HAS_MOMENTUM, FIRST, NESTEROV, DECAY = 1, 2, 4, 8, 16

SOURCE = r"""
#include <stdint.h>
#include <math.h>

enum { HAS_GRAD = 1, HAS_MOMENTUM = 2, FIRST = 4, NESTEROV = 8, DECAY = 16 };

/* The SGD step of torch.optim.SGD and D-PSGD's update of the rows [r0, r1) of X:
 *   d = g (+ wd x);  buf = d (first step) or buf = mom buf + (1 - damp) d;
 *   d = buf (or d + mom buf, Nesterov);  u = (x + (-lr) d) - x;
 *   x = ((x ws) + mixed) + u.
 * A segment is one tensor's k columns from column o: seg[3 s] = o, k, kind;
 * ptr[2 s] = its gradient rows (n, k), ptr[2 s + 1] = its momentum rows (n, k) or 0;
 * par[4 s] = -lr, wd, mom, 1 - damp. A segment without a gradient has u = 0.
 * mixed's and ws's row r is their row r - r0. Every operation rounds once, as torch's
 * do; fmaf where torch computes a + alpha b. */
void gossip_sgd_mix(float *X, int64_t x_stride, int64_t r0, int64_t r1,
                    const float *mixed, int64_t m_stride, const float *ws,
                    int64_t nseg, const int64_t *seg, const int64_t *ptr, const float *par)
{
    for (int64_t r = r0; r < r1; r++) {
        float *restrict x = X + r * x_stride;
        const float *restrict mx = mixed + (r - r0) * m_stride;
        const float w = ws[r - r0];
        for (int64_t s = 0; s < nseg; s++) {
            const int64_t o = seg[3 * s], k = seg[3 * s + 1], kind = seg[3 * s + 2];
            float *restrict xo = x + o;
            const float *restrict mo = mx + o;
            if (!(kind & HAS_GRAD)) {
                for (int64_t j = 0; j < k; j++)
                    xo[j] = ((xo[j] * w) + mo[j]) + 0.0f;
                continue;
            }
            const float *restrict g = (const float *)(intptr_t)ptr[2 * s] + r * k;
            float *restrict b = ptr[2 * s + 1] ? (float *)(intptr_t)ptr[2 * s + 1] + r * k : 0;
            const float nlr = par[4 * s], wd = par[4 * s + 1], mom = par[4 * s + 2], damp1 = par[4 * s + 3];
            if (kind == (HAS_GRAD | HAS_MOMENTUM)) {  /* the common case, a loop of its own */
                for (int64_t j = 0; j < k; j++) {
                    const float xj = xo[j];
                    const float bn = fmaf(g[j], damp1, b[j] * mom);
                    b[j] = bn;
                    const float u = fmaf(bn, nlr, xj) - xj;
                    xo[j] = ((xj * w) + mo[j]) + u;
                }
                continue;
            }
            for (int64_t j = 0; j < k; j++) {
                const float xj = xo[j];
                float d = g[j];
                if (kind & DECAY)
                    d = fmaf(xj, wd, d);
                if (kind & HAS_MOMENTUM) {
                    const float bn = (kind & FIRST) ? d : fmaf(d, damp1, b[j] * mom);
                    b[j] = bn;
                    d = (kind & NESTEROV) ? fmaf(bn, mom, d) : bn;
                }
                const float u = fmaf(d, nlr, xj) - xj;
                xo[j] = ((xj * w) + mo[j]) + u;
            }
        }
    }
}
"""

_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]

_why: str | None = None


def why_unavailable() -> str | None:
    """Why :func:`library` returned None (None if it has not, or was not asked)."""
    return _why


def _cache_dir() -> Path:
    from gossip.data.datasets import default_cache_dir

    return default_cache_dir() / "kernels"


def _cpu_key() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
        lines = [ln for ln in info if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return "\n".join(lines) or platform.processor() or platform.machine()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None where it cannot be (see
    :func:`why_unavailable`), with a one-line warning where a build was tried."""
    global _why
    if os.environ.get("GOSSIP_FUSED", "1") == "0":
        _why = "GOSSIP_FUSED=0"
        return None
    if platform.system() != "Linux":
        _why = f"the fused kernel is built on Linux only, not {platform.system()}"
        return None
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        _why = f"no C compiler ({cc!r} not found)"
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256("\0".join([SOURCE, cc, version, " ".join(_FLAGS), _cpu_key()]).encode()).hexdigest()[:20]
        folder = _cache_dir()
        so = folder / f"sgd_mix-{key}.so"
        if not so.exists():
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                src = Path(tmp) / "sgd_mix.c"
                src.write_text(SOURCE)
                out = Path(tmp) / so.name
                done = subprocess.run([cc, *_FLAGS, str(src), "-o", str(out), "-lm"],
                                      capture_output=True, text=True, timeout=120)
                if done.returncode != 0:
                    raise RuntimeError(f"{cc} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
                os.replace(out, so)  # atomic: a concurrent build of the same key writes the same file
        lib = ctypes.CDLL(str(so))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _why = f"the fused kernel could not be built or loaded: {e}"
        warnings.warn(f"gossip: {_why}; the simulation uses torch's operations (the same results, slower)",
                      RuntimeWarning, stacklevel=2)
        return None
    fn = lib.gossip_sgd_mix
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, i64, ptr, ptr, ptr]
    fn.restype = None
    _why = None
    return lib
