"""What a compressor's first call costs in a fresh process: compiling, on an empty or a
warm inductor cache.

    OMP_NUM_THREADS=1 python -m experiments run cold_start quant:bits=8 quant:bits=4 identity \\
        --caches empty,warm --results experiments/results/cold_start.json
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) OMP_NUM_THREADS=1 python -m experiments run cold_start quant:bits=8
    python -m experiments run cold_start --numel 1048576 quant:bits=8      # a smaller model

For each spec: the time of the first ``encode`` + ``decode`` of one row of ``--numel``
values (default 2**23: a model of 8M parameters) and of the second one, one thread,
and whether the first call ran compiled kernels. ``GOSSIP_COMPRESS_BACKEND=compile``
shows what compiling at once costs.

Without ``--caches`` the process measures itself, with the inductor cache it was given.
``--caches empty,warm`` measures in child processes on a fresh cache folder of their
own: ``empty``, the default backend (auto) on the empty folder (no kernel compiles in
the first call); then ``GOSSIP_COMPRESS_BACKEND=compile`` on it (what compiling at once
costs with an empty cache, and what fills it); then ``warm``, auto again on the filled
folder, where a kernel held by the cache compiles in its first call
(gossip/compress/_kernels.py, "What the compile cache holds").

The target: the first encode+decode of an 8M-parameter model (the first step's
compression) under :data:`FIRST_CALL_TARGET_S` seconds with an empty cache.
``--results`` writes the times with their provenance (experiments/_provenance.py);
``python -m experiments.render`` turns them into the table in docs/compress.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import gossip.compress as gc
from experiments import _cli
from experiments import tables
from gossip.compress import kernels

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


def measure(specs: list[str], numel: int) -> list[dict]:
    """First and second encode+decode of each spec in this process, one thread; and
    whether the first call ran compiled kernels (kernels verified by then)."""
    x = torch.randn(1, numel, generator=torch.Generator().manual_seed(0))
    keys = torch.tensor([1])
    rows = []
    for spec in specs:
        c = gc.build(spec)
        times, compiled = [], []
        for i in range(2):
            # which kernels the first call runs compiled
            with kernels.watch_compiled() if i == 0 else contextlib.nullcontext([]) as seen:
                t0 = time.perf_counter()
                c.decode(c.encode(x, keys), numel)
                times.append(time.perf_counter() - t0)
            compiled += seen
        print(f"{spec:24s} first encode+decode {times[0]:7.2f} s (compiled: {'yes' if compiled else 'no'}), "
              f"second {times[1]:.3f} s", flush=True)
        rows.append({"compressor": spec, "first_s": times[0], "second_s": times[1], "compiled_first": bool(compiled)})
    return rows


#: ``--caches``: (row label, backend, cache folder) of each child process, in order
_STEPS = {"empty": [("empty", "auto", "fresh")],
          "warm": [("empty", "compile", "fresh"), ("warm", "auto", "same")]}


def _children(specs: list[str], numel: int, caches: list[str]) -> list[dict]:
    """The measurement in child processes on a fresh inductor cache folder (see the module)."""
    folder = tempfile.mkdtemp(prefix="cold-start-inductor-")
    steps = [st for c in caches for st in _STEPS[c]]
    rows = []
    try:
        for label, backend, _ in steps:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=folder, GOSSIP_COMPRESS_BACKEND=backend,
                       OMP_NUM_THREADS="1")
            for v in ("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "TORCH_COMPILE_FORCE_DISABLE_CACHES",
                      "TORCHINDUCTOR_FX_GRAPH_CACHE"):
                env.pop(v, None)
            print(f"-- inductor cache {label}, backend {backend}", flush=True)
            r = subprocess.run([*_cli.module_command("cold_start"), *specs, "--numel", str(numel), "--child"],
                               env=_cli.module_env(env), stdout=subprocess.PIPE, text=True, check=True)
            out = r.stdout.strip().splitlines()
            print("\n".join(out[:-1]), flush=True)
            for row in json.loads(out[-1]):
                rows.append({**row, "cache": label, "backend": backend})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run cold_start``."""
    p.add_argument("specs", nargs="+", help="compressor specs, e.g. quant:bits=8")
    p.add_argument("--numel", type=int, default=1 << 23, help="values in the row (default 2**23)")
    p.add_argument("--caches", metavar="LIST",
                   help="measure in child processes on a fresh inductor cache folder: empty, warm or empty,warm "
                        "(warm: first filled by a process with GOSSIP_COMPRESS_BACKEND=compile)")
    p.add_argument("--results", "--json", dest="results", metavar="PATH",
                   help="also write the times, with their provenance, as JSON (experiments/results/cold_start.json)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def main(argv=None) -> int:
    p, args = _cli.parse(argv, options, __doc__, "cold_start")
    if args.numel < 1:
        p.error(f"--numel must be positive, got {args.numel}")
    caches = [c.strip() for c in args.caches.split(",")] if args.caches else []
    if any(c not in _STEPS for c in caches) or len(set(caches)) != len(caches):
        p.error(f"--caches takes empty, warm or empty,warm, got {args.caches!r}")
    for spec in args.specs:  # every spec checked before anything is timed
        try:
            gc.build(spec)
        except ValueError as e:
            p.error(str(e))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the caller's count is restored below (main may be called from Python)
    try:
        if args.child:
            print(json.dumps(measure(args.specs, args.numel)))
            return 0
        from experiments import _provenance

        cache = "per row" if caches else _cache_state()  # before anything here compiles
        prov = _provenance.start(SOURCES, argv=None if argv is None else ["experiments/cold_start.py", *argv])
        print(f"torch {torch.__version__}, 1 thread, {args.numel} values, backend {kernels.get_backend()}, "
              f"inductor cache {cache} at the start, load average (1 min) {os.getloadavg()[0]:.2f}")
        rows = _children(args.specs, args.numel, caches) if caches else measure(args.specs, args.numel)
    finally:
        torch.set_num_threads(threads)
    res = {"numel": args.numel, "threads": 1, "backend": kernels.get_backend(),
           "inductor_cache": cache, "torch": torch.__version__, "target_first_s": FIRST_CALL_TARGET_S,
           "rows": rows}
    if args.results:
        _provenance.write(args.results, res, prov)
    if caches:
        print()
        print(tables.cold_start_table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
