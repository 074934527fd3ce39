"""What a compressor's first call costs in a fresh process: compiling, on an empty or a
warm inductor cache.

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) OMP_NUM_THREADS=1 python experiments/cold_start.py \\
        quant:bits=8 quant:bits=4 identity --results experiments/results/cold_start.json
    python experiments/cold_start.py --numel 1048576 quant:bits=8      # a smaller model

For each spec: the time of the first ``encode`` + ``decode`` of one row of ``--numel``
values (default 2**23: a model of 8M parameters) and of the second one, in this
process, one thread. With the ``auto`` backend no call compiles on its first call,
however large; ``GOSSIP_COMPRESS_BACKEND=compile`` shows what compiling at once costs.
Run it twice with the same ``TORCHINDUCTOR_CACHE_DIR`` to see a warm cache's first call.

The target: the first encode+decode of an 8M-parameter model (the first step's
compression) under :data:`FIRST_CALL_TARGET_S` seconds. ``--results``
writes the times with their provenance (experiments/_provenance.py);
``python -m experiments.render`` turns them into the table in docs/compress.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

import gossip.compress as gc
from gossip.compress import _kernels

#: the code these figures measure (for `python -m experiments.render --stale`)
SOURCES = ["gossip/compress", "experiments/cold_start.py"]
#: the first encode+decode of an 8M-parameter row must take less than this (seconds)
FIRST_CALL_TARGET_S = 5.0


def _cache_state() -> str:
    """The inductor cache this process starts with: 'empty' (a fresh folder), 'warm'
    (a folder with files), or "torch's default" (its folder under /tmp, state unknown)."""
    d = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not d:
        return "torch's default"
    p = Path(d)
    return "warm" if p.is_dir() and any(p.iterdir()) else "empty"


def table(res: dict) -> str:
    """The results as Markdown: each spec's first and second encode+decode against the
    target, under a line saying how the process started."""
    n = res["numel"]
    head = (f"| compressor ({n:,} values, {res['threads']} thread{'s' if res['threads'] != 1 else ''}) | "
            f"first encode+decode | second | first under {FIRST_CALL_TARGET_S:g} s |")
    lines = [head, "|---|---|---|---|"]
    for r in res["rows"]:
        ok = "yes" if r["first_s"] < FIRST_CALL_TARGET_S else "**no**"
        lines.append(f"| {r['compressor']} | {r['first_s']:.2f} s | {r['second_s']:.2f} s | {ok} |")
    return (f"Backend `{res['backend']}`, inductor cache {res['inductor_cache']} at the start, "
            f"torch {res['torch']}:\n\n" + "\n".join(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("specs", nargs="+", help="compressor specs, e.g. quant:bits=8")
    p.add_argument("--numel", type=int, default=1 << 23, help="values in the row (default 2**23)")
    p.add_argument("--results", "--json", dest="results", metavar="PATH",
                   help="also write the times, with their provenance, as JSON (experiments/results/cold_start.json)")
    args = p.parse_args(argv)
    if args.numel < 1:
        p.error(f"--numel must be positive, got {args.numel}")
    compressors = []
    for spec in args.specs:  # every spec checked before anything is timed
        try:
            compressors.append(gc.build(spec))
        except ValueError as e:
            p.error(str(e))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _provenance

    cache = _cache_state()  # before anything here compiles
    prov = _provenance.start(SOURCES, argv=None if argv is None else ["experiments/cold_start.py", *argv])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the caller's count is restored below (main may be called from Python)
    try:
        print(f"torch {torch.__version__}, 1 thread, {args.numel} values, backend {_kernels.get_backend()}, "
              f"inductor cache {cache} at the start, load average (1 min) {os.getloadavg()[0]:.2f}")
        x = torch.randn(1, args.numel, generator=torch.Generator().manual_seed(0))
        keys = torch.tensor([1])
        rows = []
        for spec, c in zip(args.specs, compressors):
            times = []
            for _ in range(2):
                t0 = time.perf_counter()
                c.decode(c.encode(x, keys), args.numel)
                times.append(time.perf_counter() - t0)
            print(f"{spec:24s} first encode+decode {times[0]:7.2f} s, second {times[1]:.3f} s")
            rows.append({"compressor": spec, "first_s": times[0], "second_s": times[1]})
    finally:
        torch.set_num_threads(threads)
    res = {"numel": args.numel, "threads": 1, "backend": _kernels.get_backend(),
           "inductor_cache": cache, "torch": torch.__version__, "target_first_s": FIRST_CALL_TARGET_S,
           "rows": rows}
    if args.results:
        _provenance.write(args.results, res, prov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
