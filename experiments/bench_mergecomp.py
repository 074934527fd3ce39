"""Benchmark MergeComp (Wang et al. 2021, arXiv:2103.15195): layer-wise, whole-model and searched partitions.

    python -m experiments run bench_mergecomp [--json PATH] [--steps N] [--quick]

World 4 on loopback gloo (real processes, one thread each). Two models with many
tensors: ResNet-20 (gossip.models, 65 tensors, CIFAR-10 shapes) and a ResNet-50-shaped
network (ResNet-50's 161 parameter tensors: bottlenecks 3-4-6-3 with downsampling, at
a quarter of its width, 32x32 inputs). Four compressors (fp16, blocksign, topk 1%,
quant 8 bits), all inside dist-EF-SGD (``gossip.schedule.MergeComp``). For each, in
the same world and in turn:

* ``auto``: the search of Alg. 2 (Y = 2) runs first, then the chosen partition is timed;
* ``layer``: one group per tensor (the layer-wise baseline of Wang et al. 2021 (arXiv:2103.15195));
* ``whole``: one group for the whole model (no overlap).

Reported per row: the median iteration time (forward, backward with the hooks'
compression and posting, waiting, decoding, optimizer step), its split into compute /
compress / communicate (the ledger's phases: compress is encoding and decoding,
communicate the time the step waits for collectives not yet done), the scaling factor
T_n / (n T_1) = iter(1 worker, plain SGD) / iter (Wang et al. 2021, arXiv:2103.15195, Sec. 3.1; T_1 measured in
the same run on rank 0 while the others wait), and the iteration time the fitted cost
model (auto's profile) predicts for that partition, with its relative error.
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
from gossip import comm
from gossip.models import build_model
from gossip.runtime import GossipOptimizer
from gossip.algorithms.mergecomp import MergeComp, MergeCompConfig
from gossip.schedule import Partition
from experiments import _cli

WORLD = 4
BATCH = 8
COMPRESSORS = ["fp16", "blocksign", "topk:p=0.01", "quant:bits=8"]
MODES = ["auto", "layer", "whole"]


class _Bottleneck(nn.Module):
    def __init__(self, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        cout = 4 * mid
        self.c1, self.b1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.c2, self.b2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
        self.c3, self.b3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.b1(self.c1(x)))
        out = F.relu(self.b2(self.c2(out)))
        out = self.b3(self.c3(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


def resnet50_shaped(width: int = 16, num_classes: int = 10) -> nn.Module:
    """ResNet-50's layout (161 parameter tensors) with ``width`` channels after the stem."""
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    cin = width
    for i, blocks in enumerate((3, 4, 6, 3)):
        mid = width * 2**i
        for b in range(blocks):
            layers.append(_Bottleneck(cin, mid, 2 if (b == 0 and i > 0) else 1))
            cin = 4 * mid
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


def _models():
    def resnet20():
        return build_model("resnet20", input_shape=(3, 32, 32), num_classes=10, seed=0)

    def resnet50():
        torch.manual_seed(0)
        return resnet50_shaped()

    return [("resnet20", resnet20), ("resnet50-shaped", resnet50)]


def _step(model, gopt, alg, c, x, y):
    gopt.zero_grad()
    with c.ledger.phase("compute"):
        F.cross_entropy(model(x), y).backward()
    gopt.step()  # hands the algorithm the optimizer's lr
    c.ledger.step()


def _plain_iter(make, x, y, steps: int) -> float:
    """T_1: one worker, plain SGD, no communication."""
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for s in range(steps + 2):
        t = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if s >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def _worker(rank: int, store_path: str, steps: int, models: list[str], comps: list[str], out_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    __import__("torch.distributed.nn.functional")  # before the group: see gossip.comm.distributed._preload_before_init
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    rows = []
    try:
        for model_name, make in _models():
            if model_name not in models:
                continue
            g = torch.Generator().manual_seed(rank)
            x = torch.randn(BATCH, 3, 32, 32, generator=g)
            y = torch.randint(0, 10, (BATCH,), generator=g)
            dist.barrier()
            t1 = torch.tensor([_plain_iter(make, x, y, steps) if rank == 0 else 0.0], dtype=torch.float64)
            dist.broadcast(t1, 0)
            for spec in comps:
                cost_model = None
                for mode in MODES:
                    model = make()
                    shapes = tuple(tuple(p.shape) for p in model.parameters())
                    c = comm.DistCommunicator(None, timeout=600)
                    alg = MergeComp(MergeCompConfig(compressor=spec, merge=mode), c)  # layout: GossipOptimizer
                    gopt = GossipOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.01), alg)
                    searched = 0
                    while alg.report()["phase"] != "done" or searched == 0:  # the search, and step 1
                        _step(model, gopt, alg, c, x, y)
                        searched += 1
                    if mode == "auto":
                        cost_model = alg.cost_model
                    times, splits = [], []
                    for s in range(steps + 2):
                        dist.barrier()
                        snap = c.ledger.snapshot()
                        t = time.perf_counter()
                        _step(model, gopt, alg, c, x, y)
                        dt = time.perf_counter() - t
                        if s >= 2:
                            times.append(dt)
                            splits.append(c.ledger.since(snap))
                    med = lambda *ks: statistics.median(sum(sp["time"].get(k, 0.0) for k in ks) for sp in splits)  # noqa: E731
                    it = statistics.median(times)
                    pred = cost_model.predict(alg.partition) if cost_model is not None else float("nan")
                    rows.append({
                        "model": model_name, "tensors": len(shapes), "params": gopt.flat.dim,
                        "compressor": spec, "mode": mode, "groups": alg.partition.groups,
                        "sizes": list(alg.partition.sizes) if alg.partition.groups <= 4 else None,
                        "search_steps": searched,
                        "iter_s": it, "compute_s": med("compute"), "compress_s": med("compress"),
                        "comm_s": med("communicate", "wait"),  # posting and waiting for the peers
                        "bytes_per_step": statistics.median(sp["bytes"]["sent"] for sp in splits),
                        "t1_s": float(t1[0]), "scaling_factor": float(t1[0]) / it,
                        "predicted_s": pred, "model_error": pred / it - 1.0,
                        "cost_model": cost_model.to_dict() if (cost_model is not None and mode == "auto") else None,
                    })
                    alg.detach()
                    del gopt, alg, model
                    if rank == 0:
                        r = rows[-1]
                        print(f"  {model_name:15s} {spec:13s} {mode:5s} groups {r['groups']:3d} "
                              f"iter {r['iter_s'] * 1e3:7.1f} ms (predicted {pred * 1e3:7.1f} ms)", flush=True)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(rows, fh)


COLS = ["model", "tensors", "compressor", "mode", "groups", "iter_s", "compute_s", "compress_s", "comm_s",
        "scaling_factor", "predicted_s", "model_error"]
JSON_KEYS = ["model", "tensors", "compressor", "mode", "groups", "iter_s", "compress_s", "comm_s",
             "scaling_factor", "compute_s", "params", "bytes_per_step", "predicted_s", "model_error",
             "search_steps", "sizes", "cost_model"]


def verdicts(rows: list[dict]) -> list[str]:
    """The issue's targets, checked on the measured rows."""
    out = []
    by = {(r["model"], r["compressor"], r["mode"]): r for r in rows}
    for (model, spec, mode), r in by.items():
        if mode != "auto":
            continue
        lay, whole = by[(model, spec, "layer")], by[(model, spec, "whole")]
        best = min(lay["iter_s"], whole["iter_s"])
        same = " (auto chose that same partition: the gap is run-to-run noise)" if r["groups"] in (
            lay["groups"] if lay["iter_s"] <= whole["iter_s"] else whole["groups"],) else ""
        ok = "yes" if r["iter_s"] <= best else "NO"
        line = (f"{model} {spec}: auto {r['iter_s'] * 1e3:.1f} ms vs best of layer/whole {best * 1e3:.1f} ms "
                f"(ratio {r['iter_s'] / best:.3f}, no worse: {ok}{same})")
        if r["compress_s"] > 0:
            line += f"; compression overhead layer/auto = {lay['compress_s'] / r['compress_s']:.1f}x"
        out.append(line)
    return out


#: the code these figures measure (for `python -m experiments.render --stale`)
SOURCES = ["gossip/algorithms", "gossip/schedule", "gossip/comm", "gossip/compress", "gossip/runtime.py",
           "experiments/bench_mergecomp.py"]


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run bench_mergecomp``."""
    p.add_argument("--json", metavar="PATH", help="also write the results as a JSON list")
    p.add_argument("--steps", type=int, default=10, help="timed steps per cell after the search (default 10)")
    p.add_argument("--quick", action="store_true", help="3 timed steps, ResNet-20 with fp16 and topk only")


def main(argv: list[str] | None = None) -> int:
    p, a = _cli.parse(argv, options, __doc__, "bench_mergecomp")
    models = [m for m, _ in _models()]
    comps = list(COMPRESSORS)
    if a.quick:
        a.steps, models, comps = 3, ["resnet20"], ["fp16", "topk:p=0.01"]
    prov = _provenance.start(SOURCES, argv=None if argv is None else ["experiments/bench_mergecomp.py", *argv])
    print(f"torch {torch.__version__}, {WORLD} ranks on loopback gloo, 1 thread each, batch {BATCH}", flush=True)
    rows = run_spawned_world(_worker, WORLD, a.steps, models, comps)
    print(markdown_table(rows, COLS))
    print()
    for r in rows:
        if r["cost_model"]:
            cm = r["cost_model"]
            print(f"cost model {r['model']} {r['compressor']}: h(x) = {cm['h']['base'] * 1e3:.3f} ms + "
                  f"{cm['h']['per_value'] * 1e9:.3f} ns/value, g(x) = {cm['g']['base'] * 1e3:.3f} ms + "
                  f"{cm['g']['per_value'] * 1e9:.3f} ns/value; chosen {r['sizes']} after {r['search_steps']} steps")
    print()
    for line in verdicts(rows):
        print(line)
    if a.json:
        _provenance.write(a.json, [{k: r[k] for k in JSON_KEYS} for r in rows], prov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
