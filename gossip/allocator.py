"""Freed memory kept in the process for the next step, instead of handed back to the OS.

A training step on the CPU allocates the same large tensors every step: activations,
their gradients, the columns of a convolution. glibc's ``malloc`` serves each block
above its mmap threshold (128 KiB at first, at most 32 MiB) with a fresh ``mmap``
and returns it to the OS at ``free``, so every step pays the page faults of writing
those blocks for the first time again. The vectorized simulation allocates blocks of
tens to hundreds of MB per layer: at 256 nodes of the 1-D CNN a step spent about a
quarter of its time in those faults (``experiments/bench_sim.py``, with and without).

:func:`keep_freed_memory` asks glibc (``mallopt``) to serve every block from its heap
(``M_MMAP_MAX`` 0) and never to trim the freed top of the heap (``M_TRIM_THRESHOLD`` -1),
which is what jemalloc and tcmalloc do by default, and what PyTorch's CPU
performance guide reaches for them for. The process's resident set then stays at its
peak rather than shrinking between steps; the peak itself is the same live memory,
plus what fragmentation the heap adds (a few per cent in the runs measured).

``python -m gossip.train`` calls it at its start (every rank, every mode). It leaves the
allocator alone where the user chose one: glibc's own tuning variables
(``MALLOC_MMAP_MAX_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TOP_PAD_``, or ``glibc.malloc`` tunables in ``GLIBC_TUNABLES``) or another
allocator preloaded (``LD_PRELOAD``). To run with glibc's defaults, set one of them to
its default, e.g. ``MALLOC_TRIM_THRESHOLD_=131072``. Elsewhere than glibc (macOS, musl)
it does nothing. No value a run computes depends on it: only where blocks live.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

__all__ = ["keep_freed_memory"]

#: mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4

#: mallopt's value for "never trim" (man 3 mallopt)
NEVER = -1

#: environment variables through which a user tunes glibc's malloc: set, they win
USER_TUNING = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")

_done: str | None = None


def _user_choice(environ) -> str | None:
    """Why the user's own allocator settings stand, or None where there are none."""
    for name in USER_TUNING:
        if name in environ:
            return f"{name} is set"
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc"
    if environ.get("LD_PRELOAD", "").strip():
        return "LD_PRELOAD is set (another allocator may be loaded)"
    return None


def keep_freed_memory(environ=None) -> str:
    """Ask glibc's malloc to keep freed memory for reuse (see the module's text); once
    per process. Returns what was done, in words: ``"kept"`` where glibc took both
    settings, else why the allocator was left alone."""
    global _done
    if _done is not None:
        return _done
    environ = os.environ if environ is None else environ
    why = _user_choice(environ)
    if why is not None:
        _done = f"left alone: {why}"
        return _done
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        _done = "left alone: not glibc"
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        _done = "left alone: mallopt not found"
        return _done
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the trim threshold first: were mmap off and trimming on, a freed block at the top
    # of the heap would go back to the OS at once
    ok = mallopt(M_TRIM_THRESHOLD, NEVER) == 1
    ok = ok and mallopt(M_MMAP_MAX, 0) == 1
    _done = "kept" if ok else "left alone: mallopt refused the settings"
    return _done
