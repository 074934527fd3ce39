"""Benchmark one training step of each decentralized algorithm, and the simulator.

    python -m experiments run bench_step [--json PATH] [--steps N] [--quick]

Part 1: world 4 on loopback gloo (real processes, torch.distributed), a model of about
1M parameters, each algorithm measured in the same run: median step time split into
compute (forward + backward), compress (encode + decode, nothing else), communicate
(posting the messages) and wait (blocked until the neighbours' payloads have arrived:
a late peer or a transfer still under way); bytes sent per node per step; the ratio
of each to ``allreduce``.

Then, per compressor, the step's compress time next to what the same encodes and
decodes cost standalone (``bench_compress.bench`` at the model's size, one thread,
run by every rank at once right after the algorithm's steps, so under the same
sharing of the cores as the steps): one encode plus one decode per neighbour (and one
more for the node's own payload where the algorithm decodes it: dcd, ecd), and the
ratio of the two. A ratio near 1 means the runtime adds nothing to the codec's own
cost.

Part 2: the in-process simulation's steps per second for n = 16, 256 and 1024 nodes on
a logistic-regression problem with d = 100 (ring), with ``dpsgd`` and ``dcd`` at 8 bits.
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

import topologies
from experiments import _provenance
from experiments._benchlib import markdown_table, run_spawned_world
from experiments.bench_compress import bench as bench_codec
from gossip import algorithms, comm
from gossip.runtime import GossipOptimizer
from experiments import _cli

WORLD = 4
ALGOS = [
    ("allreduce", None),
    ("dpsgd", None),
    ("naive", "quant:bits=8"),
    ("dcd", "quant:bits=8"),
    ("ecd", "quant:bits=8"),
    ("dcd", "quant:bits=4"),
    ("ecd", "quant:bits=4"),
]


def _model() -> nn.Module:
    # 784*1024 + 1024 + 1024*256 + 256 + 256*10 + 10 = 1,068,810 parameters
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10))


def _worker(rank: int, store_path: str, steps: int, warmup: int, out_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    __import__("torch.distributed.nn.functional")  # before the group: see gossip.comm.distributed._preload_before_init
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    topo = topologies.build("ring", WORLD)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(32, 784, generator=g)
    y = torch.randint(0, 10, (32,), generator=g)
    rows = []
    try:
        for name, spec in ALGOS:
            c = comm.DistCommunicator(topo if name != "allreduce" else None, timeout=120)
            torch.manual_seed(0)
            model = _model()
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            extra = {"compressor": spec} if spec else {}
            gopt = GossipOptimizer(model, opt, algorithms.build(name, c, **extra))
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
            med = lambda k: statistics.median(sp["time"].get(k, 0.0) for sp in splits)
            # the codec alone, at the same size, in every rank at once (same core sharing)
            dist.barrier()
            codec = (bench_codec(spec or "identity", gopt.flat.dim, max(3, steps // 2)) if name != "allreduce"
                     else {"encode_ms": 0.0, "decode_ms": 0.0})
            rows.append({
                "algo": name,
                "compressor": spec or "none (fp32)",
                "world_size": WORLD,
                "params": gopt.flat.dim,
                "step_s": statistics.median(times),
                "compute_s": med("compute"),
                "compress_s": med("compress"),
                "comm_s": med("communicate"),
                "wait_s": med("wait"),
                "codec_encode_s": codec["encode_ms"] / 1e3,
                "codec_decode_s": codec["decode_ms"] / 1e3,
                "bytes_sent_per_step": statistics.median(sp["bytes"]["sent"] for sp in splits),
            })
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(rows, fh)


def bench_distributed(steps: int, warmup: int) -> list[dict]:
    rows = run_spawned_world(_worker, WORLD, steps, warmup)
    base = next(r for r in rows if r["algo"] == "allreduce")
    for r in rows:
        r["step_ratio_to_allreduce"] = r["step_s"] / base["step_s"]
        r["bytes_ratio_to_allreduce"] = r["bytes_sent_per_step"] / base["bytes_sent_per_step"]
    return rows


#: decodes per step beyond the neighbours' (one per neighbour): the node's own payload
_OWN_DECODE = {"dcd": 1, "ecd": 1}


def bench_standalone(rows: list[dict]) -> list[dict]:
    """Per compressed algorithm: its compress time per step against the same encodes
    and decodes timed standalone (bench_compress, in the ranks) at the model's size."""
    deg = int(topologies.build("ring", WORLD).degrees[0])
    out = []
    for r in rows:
        if r["algo"] == "allreduce":
            continue
        spec = "identity" if r["compressor"] == "none (fp32)" else r["compressor"]
        decodes = deg + _OWN_DECODE.get(r["algo"], 0)
        ref = r["codec_encode_s"] + decodes * r["codec_decode_s"]
        out.append({"algo": r["algo"], "compressor": spec, "params": r["params"],
                    "compress_s": r["compress_s"], "standalone_s": ref, "decodes": decodes,
                    "ratio": r["compress_s"] / ref if ref > 0 else float("nan")})
    return out


def bench_simulation(sizes: list[int], steps: int, dim: int = 100) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    for n in sizes:
        g = torch.Generator().manual_seed(0)
        w_true = torch.randn(dim, generator=g)
        A = torch.randn(n, 32, dim, generator=g)
        yb = (A @ w_true > 0).float()
        for name, spec in [("dpsgd", None), ("dcd", "quant:bits=8")]:
            c = comm.SimulatedCommunicator(topologies.build("ring", n))
            alg = algorithms.build(name, c, **({"compressor": spec} if spec else {}))
            X = torch.zeros(n, dim)
            alg.setup(X)

            def one_step() -> None:
                z = torch.einsum("npd,nd->np", A, X)
                G = torch.einsum("np,npd->nd", torch.sigmoid(z) - yb, A) / A.shape[1]
                alg.step(X, -0.1 * G)

            for _ in range(5):
                one_step()
            t = time.perf_counter()
            for _ in range(steps):
                one_step()
            dt = time.perf_counter() - t
            rows.append({"algo": name if spec is None else f"{name}:8", "nodes": n, "dim": dim, "steps_per_s": steps / dt})
    return rows


#: the code these figures measure (for `python -m experiments.render --stale`)
SOURCES = ["gossip/algorithms", "gossip/comm", "gossip/compress", "gossip/runtime.py", "topologies", "experiments/bench_step.py",
           "experiments/bench_compress.py", "experiments/_benchlib.py"]


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run bench_step``."""
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--steps", type=int, default=20, help="timed steps per algorithm (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--sim-steps", type=int, default=100, help="timed simulation steps (default 100)")
    p.add_argument("--quick", action="store_true", help="fewer steps, for a fast look")


def main(argv: list[str] | None = None) -> int:
    p, a = _cli.parse(argv, options, __doc__, "bench_step")
    if a.quick:
        a.steps, a.warmup, a.sim_steps = 5, 1, 20
    prov = _provenance.start(SOURCES, argv=None if argv is None else ["experiments/bench_step.py", *argv])
    print(f"torch {torch.__version__}, {WORLD} ranks on loopback gloo, 1 thread each", flush=True)
    steps = bench_distributed(a.steps, a.warmup)
    print(markdown_table(steps, ["algo", "compressor", "step_s", "compute_s", "compress_s", "comm_s", "wait_s",
                         "bytes_sent_per_step", "step_ratio_to_allreduce", "bytes_ratio_to_allreduce"]))
    codec = bench_standalone(steps)
    print()
    print("compress per step in the run vs the same encodes/decodes standalone (bench_compress, 1 thread):")
    print(markdown_table(codec, ["algo", "compressor", "params", "decodes", "compress_s", "standalone_s", "ratio"]))
    sim = bench_simulation([16, 256, 1024], a.sim_steps)
    print()
    print(markdown_table(sim, ["algo", "nodes", "dim", "steps_per_s"]))
    if a.json:
        _provenance.write(a.json, {"steps": steps, "codec": codec, "simulation": sim}, prov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
