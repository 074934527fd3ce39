"""Benchmark one training step of every centralized (compressed all-reduce) algorithm.

    python -m experiments run bench_centralized [--json PATH] [--steps N] [--quick]

World 4 on loopback gloo (real processes, torch.distributed over a FileStore, one
thread each), two models: ResNet-20 (gossip.models, CIFAR-10 shapes, ~0.27M
parameters) and an MLP of ~11M parameters. Every algorithm runs in the same world in
turn: median step time split into compute (forward + backward + the algorithm's
local arithmetic), compress and communicate (the ledger's phases), bytes sent per
worker per step (ledger) and the compression ratio against full-precision ring
all-reduce of the same model (``allreduce``'s bytes / the algorithm's bytes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from experiments import _provenance
from experiments._benchlib import markdown_table, run_spawned_world
from gossip import algorithms, comm
from gossip.models import build_model
from gossip.runtime import GossipOptimizer
from experiments import _cli

WORLD = 4
ALGOS = [
    ("allreduce", None, {}),
    ("efsgd", "sign", {}),
    ("efblocksgd", None, {}),
    ("efblocksgdm", None, {}),
    ("signsgd", None, {}),
    ("signum", None, {}),
    ("powersgd", None, {"rank": 2}),
    ("efmomentum", "topk:p=0.01", {}),
    ("efmomentum", "randomblock:p=0.01", {}),
    ("sketched", None, {"p": 0.01}),
    ("truetopk", None, {"p": 0.01}),
    ("localtopk", None, {"p": 0.01}),
]
BATCH = 16


def _models():
    def resnet20():
        return build_model("resnet20", input_shape=(3, 32, 32), num_classes=10, seed=0), (3, 32, 32)

    def mlp():
        # 3072*2560 + 2560 + 2560*1280 + 1280 + 1280*10 + 10 = 11,157,770 parameters
        torch.manual_seed(0)
        m = nn.Sequential(nn.Flatten(), nn.Linear(3072, 2560), nn.ReLU(), nn.Linear(2560, 1280),
                          nn.ReLU(), nn.Linear(1280, 10))
        return m, (3, 32, 32)

    return [("resnet20", resnet20), ("mlp11m", mlp)]


def _options(name, spec, extra, model):
    """The algorithm's options; the tensors' shapes reach it through GossipOptimizer's layout."""
    opts = dict(extra)
    if spec is not None:
        opts["compressor"] = spec
    return opts


def _worker(rank: int, store_path: str, steps: int, warmup: int, out_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    __import__("torch.distributed.nn.functional")  # before the group: see gossip.comm.distributed._preload_before_init
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    rows = []
    try:
        for model_name, make in _models():
            g = torch.Generator().manual_seed(rank)
            for name, spec, extra in ALGOS:
                model, shape = make()
                x = torch.randn(BATCH, *shape, generator=g)
                y = torch.randint(0, 10, (BATCH,), generator=g)
                c = comm.DistCommunicator(None, timeout=300)
                opt = torch.optim.SGD(model.parameters(), lr=0.01)
                algo = algorithms.build(name, c, **_options(name, spec, extra, model))
                gopt = GossipOptimizer(model, opt, algo)
                times, splits = [], []
                for s in range(warmup + steps):
                    dist.barrier()
                    snap = c.ledger.snapshot()
                    t = time.perf_counter()
                    gopt.zero_grad()
                    with c.ledger.phase("compute"):
                        F.cross_entropy(model(x), y).backward()
                    gopt.step()
                    c.ledger.step()
                    dt = time.perf_counter() - t
                    if s >= warmup:
                        times.append(dt)
                        splits.append(c.ledger.since(snap))
                med = lambda *ks: statistics.median(sum(sp["time"].get(k, 0.0) for k in ks) for sp in splits)  # noqa: E731
                rows.append({
                    "algo": name,
                    "compressor": spec or ", ".join(f"{k}={v}" for k, v in extra.items()) or "-",
                    "model": model_name,
                    "params": gopt.flat.dim,
                    "step_s": statistics.median(times),
                    "compute_s": med("compute"),
                    "compress_s": med("compress"),
                    "comm_s": med("communicate", "wait"),  # posting and waiting for the peers
                    "bytes_per_step": statistics.median(sp["bytes"]["sent"] for sp in splits),
                })
                del gopt, algo, opt, model
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(rows, fh)


def bench(steps: int, warmup: int) -> list[dict]:
    rows = run_spawned_world(_worker, WORLD, steps, warmup)
    for r in rows:
        base = next(b for b in rows if b["algo"] == "allreduce" and b["model"] == r["model"])
        r["compression_ratio"] = base["bytes_per_step"] / r["bytes_per_step"] if r["bytes_per_step"] else float("inf")
    return rows


COLS = ["algo", "compressor", "model", "params", "step_s", "compute_s", "compress_s", "comm_s",
        "bytes_per_step", "compression_ratio"]


#: the code these figures measure (for `python -m experiments.render --stale`)
SOURCES = ["gossip/algorithms", "gossip/comm", "gossip/compress", "gossip/models.py", "gossip/runtime.py",
           "experiments/bench_centralized.py"]


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run bench_centralized``."""
    p.add_argument("--json", metavar="PATH", help="also write the results as a JSON list")
    p.add_argument("--steps", type=int, default=10, help="timed steps per algorithm (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--quick", action="store_true", help="3 timed steps after 1 warm-up, for a fast look")


def main(argv: list[str] | None = None) -> int:
    p, a = _cli.parse(argv, options, __doc__, "bench_centralized")
    if a.quick:
        a.steps, a.warmup = 3, 1
    prov = _provenance.start(SOURCES, argv=None if argv is None else ["experiments/bench_centralized.py", *argv])
    print(f"torch {torch.__version__}, {WORLD} ranks on loopback gloo, 1 thread each, batch {BATCH}", flush=True)
    rows = bench(a.steps, a.warmup)
    print(markdown_table(rows, COLS))
    if a.json:
        _provenance.write(a.json, [{k: r[k] for k in COLS} for r in rows], prov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
