"""Throughput of every compressor against a plain memcpy, on one CPU thread.

    python -m experiments run bench_compress [--quick] [--json PATH] [--only SPEC,SPEC] [--backend compile]

For each compressor and size (1M and 16M fp32 elements; 1M only with --quick) it
reports encode and decode throughput in GB/s of fp32 input, the throughput of a
memcpy of the same tensor measured in the same run (``dst.copy_(src)`` into a
preallocated buffer), the ratios to it, the payload bytes per element (and its
ratio to fp32 and to the ideal size) and the relative error ||C(x) - x|| / ||x||
on a standard normal input. All times are medians (``--stat min`` for minima) of
repetitions interleaved with the memcpy, so that load changes hit both alike.
Encode and decode write into buffers allocated once (``encode(..., out=P)``,
``decode(..., out=Y)``), as a training loop does. The 1-minute load average is
printed before and after each size and a warning is given above 0.3 (the figures
of a loaded machine are not the machine's). The "cpu" ratio uses the thread's CPU
time instead of wall time, which other processes disturb less.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import gossip.compress as gc
from experiments import _cli

if __package__:  # imported as experiments.bench_compress
    from . import _provenance
else:  # run as a script, or imported with experiments/ on the path (bench_step)
    from experiments import _provenance

#: the code these figures measure (for `python -m experiments.render --stale`)
SOURCES = ["gossip/compress", "experiments/bench_compress.py"]

SPECS = [
    "quant:bits=8", "quant:bits=4", "quant:bits=8,block=4096", "qsgd:levels=16,block=512", "ternary",
    "randk:p=0.1", "sign", "blocksign:block=65536", "topk:p=0.01", "randomk:p=0.01",
    "randomblock:p=0.01", "identity", "fp16",
]


def _median_time(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench(spec: str, numel: int, reps: int, stat=statistics.median) -> dict:
    c = gc.build(spec)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, numel, generator=g)
    keys = torch.tensor([12345], dtype=torch.int64)
    dst = torch.empty_like(x)
    dst.copy_(x)  # fault its pages in
    # warm-up (compiles the fast path on first use) and the error
    P = c.encode(x, keys)
    y = c.decode(P, numel)
    rel = float((y - x).norm() / x.norm())
    c.encode(x, keys, out=P)
    c.decode(P, numel, out=y)
    times = {k: ([], []) for k in ("copy", "enc", "dec")}
    fns = {"copy": lambda: dst.copy_(x), "enc": lambda: c.encode(x, keys, out=P),
           "dec": lambda: c.decode(P, numel, out=y)}
    for _ in range(reps):  # interleaved, so that load changes hit all three alike
        for k, fn in fns.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            times[k][1].append(time.thread_time() - c0)
            times[k][0].append(time.perf_counter() - t0)
    tc, te, td = (stat(times[k][0]) for k in ("copy", "enc", "dec"))
    cc, ce, cd = (stat(times[k][1]) for k in ("copy", "enc", "dec"))
    nbytes = 4.0 * numel
    mem = nbytes / tc / 1e9
    bpe = c.payload_nbytes(numel) / numel
    ideal = c.ideal_nbytes(numel) / numel
    return {
        "compressor": c.spec,
        "numel": numel,
        "encode_gbps": nbytes / te / 1e9,
        "decode_gbps": nbytes / td / 1e9,
        "memcpy_gbps": mem,
        "encode_ratio": nbytes / te / 1e9 / mem,
        "decode_ratio": nbytes / td / 1e9 / mem,
        "roundtrip_ratio": nbytes / (te + td) / 1e9 / mem,
        "roundtrip_ratio_cpu": cc / (ce + cd) if ce + cd > 0 else float("nan"),
        "load_avg": os.getloadavg()[0],
        "encode_ms": te * 1e3,
        "decode_ms": td * 1e3,
        "memcpy_ms": tc * 1e3,
        "bytes_per_element": bpe,
        "ideal_bytes_per_element": ideal,
        "ratio_to_fp32": bpe / 4.0,
        "ratio_to_ideal": bpe / ideal,
        "rel_error": rel,
    }


def _table(rows: list[dict]) -> str:
    head = (f"{'compressor':<26}{'numel':>10}{'enc GB/s':>10}{'dec GB/s':>10}{'memcpy':>9}"
            f"{'enc/mem':>9}{'dec/mem':>9}{'rt/mem':>8}{'cpu':>7}{'load':>6}{'B/elem':>9}{'/fp32':>7}{'/ideal':>8}{'rel err':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['compressor']:<26}{r['numel']:>10}{r['encode_gbps']:>10.3f}{r['decode_gbps']:>10.3f}"
            f"{r['memcpy_gbps']:>9.2f}{r['encode_ratio']:>9.3f}{r['decode_ratio']:>9.3f}"
            f"{r['roundtrip_ratio']:>8.3f}{r['roundtrip_ratio_cpu']:>7.3f}{r['load_avg']:>6.2f}{r['bytes_per_element']:>9.4f}{r['ratio_to_fp32']:>7.3f}"
            f"{r['ratio_to_ideal']:>8.4f}{r['rel_error']:>9.4f}"
        )
    return "\n".join(lines)


LOAD_WARN = 0.3


def _load_check(when: str) -> float:
    load = os.getloadavg()[0]
    msg = f"load average (1 min) {when}: {load:.2f}"
    if load > LOAD_WARN:
        msg += f"  WARNING: above {LOAD_WARN}; other processes share the machine, figures are not its own"
    print(msg, file=sys.stderr if load > LOAD_WARN else sys.stdout, flush=True)
    return load


def options(ap: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run bench_compress``."""
    ap.add_argument("--quick", action="store_true", help="1M elements only")
    ap.add_argument("--numel", type=int, default=0, help="one size only (elements per row)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as a JSON list")
    ap.add_argument("--only", metavar="SPECS", help="comma-free list of specs separated by ';'")
    ap.add_argument("--backend", choices=("auto", "compile", "eager"), default="compile",
                    help="kernel backend (default: compile, the steady state of a run: auto runs a kernel eagerly "
                         "until it has processed 2**30 elements, more than this benchmark's repetitions, unless "
                         "inductor's cache already holds it, so auto here would time the eager start of a run or, "
                         "with a warm cache, the compiled kernels)")
    ap.add_argument("--reps", type=int, default=0, help="timed repetitions (default 21 at 1M, 7 at 16M)")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="statistic of the repetitions (default median; min shows the unloaded speed)")


def main(argv=None) -> int:
    ap, args = _cli.parse(argv, options, __doc__, "bench_compress")
    prov = _provenance.start(SOURCES, argv=None if argv is None else ["experiments/bench_compress.py", *argv])
    torch.set_num_threads(1)
    gc.set_backend(args.backend)
    specs = [s.strip() for s in args.only.split(";")] if args.only else SPECS
    for s in specs:
        try:
            gc.build(s)
        except ValueError as e:
            print(f"bench_compress: {e}", file=sys.stderr)
            return 2
    sizes = [1 << 20] if args.quick else [1 << 20, 1 << 24]
    if args.numel:
        sizes = [args.numel]
    rows = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, backend {args.backend}; {args.stat}s",
          flush=True)
    for n in sizes:
        _load_check(f"before {n} elements")
        for s in specs:
            stat = min if args.stat == "min" else statistics.median
            rows.append(bench(s, n, args.reps or (21 if n <= 1 << 20 else 7), stat))
            print(_table(rows[-1:]).splitlines()[-1] if len(rows) > 1 else _table(rows), flush=True)
    _load_check("at the end")
    print()
    print(_table(rows))
    for n in sizes:
        mem = statistics.median(r["memcpy_gbps"] for r in rows if r["numel"] == n)
        print(f"memcpy at {n} elements: {mem:.2f} GB/s (median over the compressors' runs)")
    if args.json:
        _provenance.write(args.json, rows, prov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
