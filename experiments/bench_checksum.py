"""The payload checksum on the CPU: the integer matrix-vector product against the forms it replaced.

    OMP_NUM_THREADS=1 python -m experiments run bench_checksum [--reps 7] [--json PATH]

Every payload row carries ``sum_j (2 j + 1) w_j mod 2**32`` over its 32-bit words
(``gossip.compress.wire``): the encoder writes it and the decoder checks it, so every
exchange pays it twice, and a simulation pays it over all n nodes' payloads at once.
On the CPU the kernel is one ``torch.mv`` of the int32 words with the int32 weights
(products and sum wrap modulo 2**32). This times it, one thread, against:

- ``compiled``: the element-wise product and int32 row sum handed to ``torch.compile``
  (dynamic shapes, as the kernel was compiled once its eager budget was spent);
- ``chunked``: the same product and sum in eager torch, 16 Ki columns of every row at a
  time through one scratch buffer (the kernel's earlier eager form);
- ``memcpy``: a copy of the same words, timed in the same run.

The shapes are payloads the project sends: one rank's 8-bit codes and its full-precision
values of 16M parameters, and a simulation's full-precision payloads of an MLP on 1,024
nodes and of the 1-D CNN on 256 nodes (``experiments/bench_sim.py``'s models), and a
small one. Minimum of ``--reps`` interleaved repeats; every form's result is checked
equal to the kernel's before timing.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from experiments._timing import min_interleaved

from gossip.compress import kernels as K
from experiments import _cli

#: (name, rows, 32-bit words per row), the 8-word header included
SHAPES = [
    ("rank, quant:bits=8 of 16M values", 1, (1 << 22) + 8 + 2 * ((1 << 24) // 4096)),
    ("rank, identity of 16M values", 1, (1 << 24) + 8),
    ("simulation, mlp x 1024 nodes", 1024, 78_858 + 8),
    ("simulation, cnn1d x 256 nodes", 256, 124_810 + 8),
    ("small, 16 x 1,000 words", 16, 1000),
]


def _chunked(words: torch.Tensor, w: torch.Tensor, chunk: int = 1 << 14) -> torch.Tensor:
    """The earlier eager form: product and int32 sum, ``chunk`` columns of every row at a time."""
    m, n = words.shape
    buf = torch.empty(m * min(n, chunk), dtype=torch.int32)
    acc = torch.zeros(m, dtype=torch.int64)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        prod = torch.mul(words[:, a:b], w[a:b], out=buf[: m * (b - a)].view(m, b - a))
        acc += prod.sum(dim=1, dtype=torch.int32)
    return acc & 0xFFFFFFFF



def measure(shapes, reps: int) -> list[dict]:
    compiled = torch.compile(K.checksum_expression, dynamic=True, fullgraph=True)
    rows = []
    for name, m, n in shapes:
        g = torch.Generator().manual_seed(m * n)
        words = torch.randint(-(1 << 31), 1 << 31, (m, n), dtype=torch.int32, generator=g)
        w = K.checksum_weights(n, words.device)
        dst = torch.empty_like(words)
        fns = {"memcpy": lambda: dst.copy_(words), "mv": lambda: K.checksum(words, w),
               "compiled": lambda: compiled(words, w), "chunked": lambda: _chunked(words, w)}
        want = K.checksum(words, w)
        with torch.no_grad():
            for k in ("compiled", "chunked"):
                if not torch.equal(fns[k](), want):
                    raise SystemExit(f"bench_checksum: the {k} form gives other sums than the kernel for {name}")
            t = min_interleaved(fns, reps)
        rows.append({"payload": name, "rows": m, "words": n, "mb": 4 * m * n / 1e6,
                     **{f"{k}_ms": 1e3 * v for k, v in t.items()},
                     "mv_over_memcpy": t["mv"] / t["memcpy"],
                     "compiled_over_mv": t["compiled"] / t["mv"], "chunked_over_mv": t["chunked"] / t["mv"]})
        r = rows[-1]
        print(f"{name:36s} {r['mb']:8.1f} MB  memcpy {r['memcpy_ms']:8.2f}  mv {r['mv_ms']:8.2f} "
              f"({r['mv_over_memcpy']:.2f} of memcpy's time)  compiled {r['compiled_ms']:8.2f} "
              f"({r['compiled_over_mv']:.2f}x mv)  chunked {r['chunked_ms']:8.2f} ({r['chunked_over_mv']:.2f}x mv)",
              flush=True)
    return rows


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run bench_checksum``."""
    p.add_argument("--reps", type=int, default=7, help="interleaved repeats; the minimum is kept (default 7)")
    p.add_argument("--small", action="store_true", help="tiny shapes only (a smoke run)")
    p.add_argument("--json", metavar="PATH", help="also write the figures, with their provenance, as JSON")


def main(argv: list[str] | None = None) -> int:
    p, args = _cli.parse(argv, options, __doc__, "bench_checksum")
    if args.reps < 1:
        p.error(f"--reps must be at least 1, got {args.reps}")
    from experiments import _provenance

    prov = _provenance.start(["gossip/compress/_kernels.py", "gossip/compress/wire.py",
                              "experiments/bench_checksum.py", "experiments/_timing.py"],
                             argv=None if argv is None else ["experiments/bench_checksum.py", *argv])
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, 1 thread, minimum of {args.reps} interleaved repeats; load average (1 min) "
          f"{load:.2f}" + ("  WARNING: above 0.3, figures are not the machine's own" if load > 0.3 else ""))
    shapes = [("small, 4 x 300 words", 4, 300), ("small, 1 x 5,000 words", 1, 5000)] if args.small else SHAPES
    rows = measure(shapes, args.reps)
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f}")
    if args.json:
        _provenance.write(args.json, {"reps": args.reps, "stat": "min", "threads": 1, "rows": rows}, prov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
