"""Benchmark one PowerSGD step: ours against PyTorch's ``powerSGD_hook``, same run.

    python -m experiments run bench_powersgd [--json PATH] [--steps N] [--warmup N] [--rank R]

World 2 on loopback gloo (real processes, one thread each), the parameter tensors of a
ResNet-18 (ImageNet head, 11.7M values), rank 2 by default, error feedback and warm
start on, momentum 0 (the hook does not do momentum). Both are fed the same gradients
and the same initial Q. The two are interleaved step by step, and which of them runs
first alternates, so a change of load hits both alike; after ``--warmup`` untimed
steps the median wall time of one step over ``--steps`` steps is reported for each,
with their ratio and the largest relative difference between the aggregated results
(per step, ||ours - hook|| / ||hook||). The machine may be loaded: quote the ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


from experiments import _provenance
from gossip import algorithms, comm  # noqa: E402
from experiments import _cli

#: the code these figures measure (for `python -m experiments.render --stale`)
SOURCES = ["gossip/algorithms", "gossip/comm", "gossip/ddp.py", "experiments/bench_powersgd.py"]

WORLD = 2


def resnet18_shapes(num_classes: int = 1000) -> list[tuple[int, ...]]:
    """Parameter shapes of torchvision's ResNet-18, in ``parameters()`` order."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for b in range(2):
            s = stride if b == 0 else 1
            shapes += [(cout, cin, 3, 3), (cout,), (cout,), (cout, cout, 3, 3), (cout,), (cout,)]
            if b == 0 and (s != 1 or cin != cout):
                shapes += [(cout, cin, 1, 1), (cout,), (cout,)]
            cin = cout
    shapes += [(num_classes, 512), (num_classes,)]
    return shapes


class _Bucket:
    """What powerSGD_hook reads of a DDP GradBucket."""

    def __init__(self, flat, shapes):
        self._buf, self._shapes = flat, shapes

    def buffer(self):
        return self._buf

    def index(self):
        return 0

    def is_last(self):
        return True

    def gradients(self):
        out, off = [], 0
        for sh in self._shapes:
            n = math.prod(sh)
            out.append(self._buf[off : off + n].view(sh))
            off += n
        return out


def _hook_q0(seed, shapes, rank, rate=2.0):
    """The hook's first Q: drawn for the compressed matrices grouped by matrix shape
    (first-seen order), laid out here in parameter order."""
    rng = np.random.RandomState(seed)
    mats = []
    for i, sh in enumerate(shapes):
        if len(sh) < 2:
            continue
        n, k = sh[0], math.prod(sh[1:])
        r = min(n, k, rank)
        if (n + k) * r * rate < n * k:
            mats.append((i, (n, k), r))
    groups = {}
    for i, nk, r in mats:
        groups.setdefault(nk, []).append((i, r))
    drawn = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(rng.randint(1_000_000_000))
        for (n, k), members in groups.items():
            for i, r in members:
                drawn[i] = torch.randn(1, k, r).reshape(-1)
    return torch.cat([drawn[i] for i, _, _ in mats])


def _worker(rank_id, store_path, steps, warmup, rank, out_path):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph

    torch.set_num_threads(1)
    __import__("torch.distributed.nn.functional")  # before the group: see gossip.comm.distributed._preload_before_init
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank_id, world_size=WORLD)
    shapes = resnet18_shapes()
    d = sum(math.prod(s) for s in shapes)
    g = torch.Generator().manual_seed(rank_id)
    base = torch.randn(d, generator=torch.Generator().manual_seed(99))
    st = ph.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                          min_compression_rate=2, use_error_feedback=True, warm_start=True, random_seed=0)
    for _ in range(2):
        ph.powerSGD_hook(st, _Bucket(torch.zeros(d), shapes)).wait()
    c = comm.DistCommunicator(timeout=300)
    alg = algorithms.build("powersgd", c, rank=rank, momentum=0.0)
    alg.setup(torch.zeros(1, d), algorithms.ParamLayout(tuple(shapes)))
    sd = alg.state_dict()
    sd["q"] = _hook_q0(0, shapes, rank).unsqueeze(0)
    alg.load_state_dict(sd)
    def ours(grad):
        G = grad.clone().unsqueeze(0)  # the copy is made outside the timed region
        dist.barrier()
        t0 = time.perf_counter()
        alg.reduce_gradients(G)
        return time.perf_counter() - t0, G[0]

    def hook(grad):
        bucket = _Bucket(grad.clone(), shapes)
        dist.barrier()
        t0 = time.perf_counter()
        res = ph.powerSGD_hook(st, bucket).wait()
        return time.perf_counter() - t0, res

    t_ours, t_hook, rel = [], [], []
    for i in range(warmup + steps):
        grad = base + 0.5 * torch.randn(d, generator=g)
        if i % 2 == 0:
            (to, a), (th, b) = ours(grad), hook(grad)
        else:
            (th, b), (to, a) = hook(grad), ours(grad)
        rel.append(float((a - b).norm() / b.norm()))
        if i >= warmup:
            t_ours.append(to)
            t_hook.append(th)
    if rank_id == 0:
        ours, hook = statistics.median(t_ours), statistics.median(t_hook)
        with open(out_path, "w") as f:
            json.dump({"rank": rank, "params": d, "ours_step_s": ours, "torch_hook_step_s": hook,
                       "ratio": ours / hook, "max_rel_diff": max(rel)}, f)
    dist.destroy_process_group()


def options(ap: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run bench_powersgd``."""
    ap.add_argument("--json", help="write the figures to this JSON file")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    ap.add_argument("--rank", type=int, default=2)


def main(argv=None) -> int:
    ap, args = _cli.parse(argv, options, __doc__, "bench_powersgd")
    if args.steps < 1 or args.warmup < 0 or args.rank < 1:
        ap.error("--steps and --rank must be >= 1, --warmup >= 0")
    prov = _provenance.start(SOURCES, argv=None if argv is None else ["experiments/bench_powersgd.py", *argv])
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), args.steps, args.warmup, args.rank, out), nprocs=WORLD)
        with open(out) as f:
            res = json.load(f)
    print(f"PowerSGD step, ResNet-18 shapes ({res['params']} values), world {WORLD} gloo, rank {res['rank']}, "
          f"median of {args.steps} interleaved steps")
    print(f"{'ours (s)':>10} {'hook (s)':>10} {'ratio':>7} {'max rel diff':>13}")
    print(f"{res['ours_step_s']:10.4f} {res['torch_hook_step_s']:10.4f} {res['ratio']:7.2f} {res['max_rel_diff']:13.2e}")
    if args.json:
        _provenance.write(args.json, res, prov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
