"""What a compressor's first call costs in a fresh process: compiling, on an empty or a
warm inductor cache.

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python experiments/cold_start.py quant:bits=8 quant:bits=4 identity
    python experiments/cold_start.py --numel 1048576 quant:bits=8      # below auto's compile-at-once size

For each spec: the time of the first ``encode`` + ``decode`` of one row of ``--numel``
values (default 2**23: a model of 8M parameters) and of the second one, in this
process, one thread. With the ``auto`` backend no call compiles on its first call,
however large; ``GOSSIP_COMPRESS_BACKEND=compile`` shows what compiling at once costs. Run it twice with the same
``TORCHINDUCTOR_CACHE_DIR`` to see a warm cache's first call.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import gossip.compress as gc
from gossip.compress import _kernels


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("specs", nargs="+", help="compressor specs, e.g. quant:bits=8")
    p.add_argument("--numel", type=int, default=1 << 23)
    p.add_argument("--json", metavar="PATH", help="also write the times, with their provenance, as JSON")
    args = p.parse_args(argv)
    if args.numel < 1:
        p.error(f"--numel must be positive, got {args.numel}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _provenance

    prov = _provenance.start(["gossip/compress", "experiments/cold_start.py"],
                             argv=None if argv is None else ["experiments/cold_start.py", *argv])
    rows = []
    torch.set_num_threads(1)
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "(torch's default)")
    print(f"torch {torch.__version__}, 1 thread, {args.numel} values, backend {_kernels.get_backend()}, "
          f"inductor cache {cache}, load average (1 min) {os.getloadavg()[0]:.2f}")
    x = torch.randn(1, args.numel, generator=torch.Generator().manual_seed(0))
    keys = torch.tensor([1])
    for spec in args.specs:
        try:
            c = gc.build(spec)
        except ValueError as e:
            p.error(str(e))
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            c.decode(c.encode(x, keys), args.numel)
            times.append(time.perf_counter() - t0)
        print(f"{spec:24s} first encode+decode {times[0]:7.2f} s, second {times[1]:.3f} s")
        rows.append({"compressor": spec, "numel": args.numel, "backend": _kernels.get_backend(),
                     "first_s": times[0], "second_s": times[1],
                     "inductor_cache": "given" if "TORCHINDUCTOR_CACHE_DIR" in os.environ else "default"})
    if args.json:
        _provenance.write(args.json, rows, prov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
