#!/usr/bin/env python3
"""DDP step time with gossip's efsgd hook, overlapped and inline, against torch's all-reduce.

    sudo python -m experiments run bench_ddp_overlap --rate 100mbit --steps 20 --repeats 3

Two ranks, each in its own network namespace of ``experiments/vcluster.py`` (links
shaped with tc to ``--rate`` both ways), train the same DistributedDataParallel MLP
(``--width`` wide, ``--depth`` hidden layers, random data: only time is measured;
``--bucket-mb`` cuts it into several DDP buckets, so a bucket's exchange can overlap
the backward of the next ones) in four settings, interleaved ``--repeats`` times:

``efsgd_overlap``
    ``gossip.ddp`` hook, ``efsgd`` with ``quant:bits=8`` (the default sharded
    exchange, the default ``chunk_kb``, or ``--chunk-kb``): the hook posts the
    bucket's exchange and returns a future;
``efsgd_overlap_whole``
    the overlapped hook with ``chunk_kb=None``: each stage of a bucket's exchange
    posted as one collective, as before the hook cut them into chunks (the hook's
    default, ``chunk_kb="auto"``, measures the link and cuts each stage into chunks
    of a few times its bandwidth-delay product; see "Chunks" in ``gossip/ddp.py``);
``efsgd_inline``
    the same hook with ``overlap=False``: it waits for its exchange inside the hook;
``torch_equal_bytes``
    torch's own asynchronous all-reduce (a hook returning
    ``dist.all_reduce(...).get_future()``, as ``allreduce_hook`` does) of a quarter of
    each bucket: the bytes an 8-bit code puts on the wire, so the network cost is
    the efsgd hook's, and the difference is what the two-stage exchange costs;
``torch_fp32``
    DDP's default all-reduce of the fp32 gradients (4x the bytes).

Each run times ``--steps`` iterations (forward, backward, optimizer step) after
``--warmup`` ones; rank 0 reports the median and minimum step time, the bytes its
interface sent and which codec kernels the timed steps ran compiled. The ranks' kernel
backend is ``--kernels`` (default ``auto``, gossip's default: a kernel whose compiled
form is in inductor's compile cache compiles in the first warm-up step, as on a
machine that has trained before; with an empty cache the timed steps of a short run
are eager, as a long run's first few hundred steps are). Prints a table (minimum over repeats of the per-run medians,
and the ratios to ``efsgd_inline``) and writes ``--json`` (default
``OUT/results.json``) through ``experiments/_provenance.py`` (command, commit, date,
machine with its memcpy speed, load average before and after); ``make results-tables``
renders the committed ``experiments/results/bench_ddp_overlap.json`` into
docs/centralized.md. Needs root (network namespaces); run it on a quiet machine
(load average below 0.3): speed is measured, not asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

from experiments import _cli

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODES = ("efsgd_overlap", "efsgd_overlap_whole", "efsgd_inline", "torch_equal_bytes", "torch_fp32")
#: the code the step times measure: the hooks, the exchange they run, the codec
SOURCES = ["gossip/ddp.py", "gossip/runtime.py", "gossip/algorithms", "gossip/comm", "gossip/compress",
           "experiments/bench_ddp_overlap.py", "experiments/vcluster.py"]


# ------------------------------------------------------------------------ one rank
def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch import nn

    from gossip import comm as gcomm
    from gossip import ddp
    from gossip.compress import kernels

    torch.set_num_threads(1)
    gcomm.init_from_env(backend="gloo", timeout=600)
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(args.inputs, args.width), nn.ReLU()]
    for _ in range(args.depth):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    layers.append(nn.Linear(args.width, 10))
    net = nn.Sequential(*layers)
    model = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mode = args.worker
    state = None
    if mode.startswith("efsgd"):
        state = ddp.hook_state(model, "efsgd", compressor="quant:bits=8", optimizer=opt,
                               overlap=(mode != "efsgd_inline"),
                               chunk_kb=None if mode == "efsgd_overlap_whole" else args.chunk_kb)
        model.register_comm_hook(state, ddp.hook)
    elif mode == "torch_equal_bytes":
        world = dist.get_world_size()

        def quarter_allreduce(_, bucket):  # no annotations: DDP checks them against its classes
            buf = bucket.buffer()
            part = buf[: max(1, buf.numel() // 4)].div_(world)
            fut = dist.all_reduce(part, async_op=True).get_future()
            return fut.then(lambda _f: buf)

        model.register_comm_hook(None, quarter_allreduce)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.inputs, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    times, compiled = [], []
    for it in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        # which codec kernels the timed steps run compiled (the backend's choice)
        with kernels.watch_compiled() if it >= args.warmup else contextlib.nullcontext([]) as seen:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        compiled += seen
        times.append(time.perf_counter() - t0)
    ledger = state.ledger.bytes_sent if state is not None else None
    dist.barrier()
    gcomm.shutdown()
    if rank == 0:
        steps = times[args.warmup:]
        print(json.dumps({"mode": mode, "step_s": statistics.median(steps), "step_s_min": min(steps),
                          "ledger_bytes_sent": ledger,
                          **({"chunk_bytes": state.comm.chunk_bytes} if state is not None else {}),
                          **({"compiled_kernels": sorted(set(compiled))} if state is not None else {}),
                          "params": sum(p.numel() for p in net.parameters())}), flush=True)
    return 0


# ------------------------------------------------------------------------ the driver
def _chunk_kb(text: str) -> int | str:
    if text == "auto":
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected auto or a whole number of KiB >= 1, got {text!r}")


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run bench_ddp_overlap``."""
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--inputs", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--chunk-kb", type=_chunk_kb, default="auto",
                   help="chunk_kb of the efsgd_overlap and efsgd_inline settings: auto (the hook's default) or KiB")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    p.add_argument("--kernels", default="auto", choices=("eager", "auto", "compile"),
                   help="gossip.compress kernel backend of the ranks (default auto, gossip's own default: with "
                        "the kernels in the compile cache they compile in the first warm-up step; eager: none)")
    p.add_argument("--prefix", default="ddpov")
    p.add_argument("--out", default="runs/bench_ddp_overlap", help="directory for the ranks' logs")
    p.add_argument("--json", default=None, help="results file (default OUT/results.json)")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)  # one rank, inside the cluster


def main(argv: list[str] | None = None) -> int:
    p, args = _cli.parse(argv, options, __doc__, "bench_ddp_overlap")
    if args.worker:
        return _worker(args)
    from experiments import _provenance

    modes = _cli.methods(p, args.modes, MODES, flag="--modes")
    if min(args.steps, args.repeats) < 1 or args.warmup < 0:
        p.error(f"need --steps >= 1, --repeats >= 1 and --warmup >= 0, got --steps {args.steps} "
                f"--repeats {args.repeats} --warmup {args.warmup}")

    from experiments.vcluster import VirtualCluster

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GOSSIP_COMPRESS_BACKEND": args.kernels,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    passthrough = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--width", str(args.width),
                   "--depth", str(args.depth), "--inputs", str(args.inputs), "--batch", str(args.batch),
                   "--bucket-mb", str(args.bucket_mb), "--chunk-kb", str(args.chunk_kb)]
    prov = _provenance.start(SOURCES, argv=None if argv is None else ["experiments/bench_ddp_overlap.py", *argv])
    rows = []
    with VirtualCluster(2, rate=args.rate, prefix=args.prefix) as vc:
        for rep in range(args.repeats):
            for mode in modes:
                cmd = [*_cli.module_command("bench_ddp_overlap"), "--worker", mode, *passthrough]
                res = vc.run(cmd, env=env, timeout=900, outdir=out / f"{mode}-{rep}")
                if not res.ok:
                    print(f"{mode} repeat {rep} failed: {res.tail(res.failed[0].rank)}", file=sys.stderr)
                    return 1
                line = [ln for ln in res.ranks[0].stdout.read_text().splitlines() if ln.startswith("{")][-1]
                row = {**json.loads(line), "repeat": rep, "rank0_tx_bytes": res.ranks[0].tx_bytes,
                       "load": os.getloadavg()[0]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    from experiments import render

    best = {m: min(r["step_s"] for r in rows if r["mode"] == m) for m in modes}
    results = {"rate": args.rate, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
               "width": args.width, "depth": args.depth, "inputs": args.inputs, "batch": args.batch,
               "bucket_mb": args.bucket_mb, "chunk_kb": args.chunk_kb, "kernels": args.kernels, "ranks": 2, "modes": modes,
               "params": rows[0]["params"], "best_step_s": best, "rows": rows}
    path = _provenance.write(args.json or out / "results.json", results, prov)
    print(f"\nload average before {prov.load_before[0]:.2f}, after {prov.load_after[0]:.2f} "
          f"(speed figures count below {_provenance.QUIET_LOAD})")
    print(render.TABLES["bench_ddp_overlap"].render(results))
    print(f"bench_ddp_overlap: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
