"""Where the vectorized simulation's step time goes, kernel by kernel (one thread).

Three questions that ``bench_sim.py``'s ratios raise, answered in one run, each
candidate timed against its baseline in the same process (interleaved repeats,
minimum of each):

1. **mlp**: is the vectorized step's time in its batched matrix products? One step of
   ``--nodes`` nodes under ``torch.profiler`` (with FLOP counts): the matmuls' share
   of the step and their GFLOP/s, against this thread's peak (a 1024^3 float32
   matmul, timed in the same run).
2. **cnn1d**: ``vmap`` turns a convolution with per-node weights into one grouped
   convolution (``groups = n``). Forward and backward of each of the model's three
   convolutions, per node: one node's own convolution (the loop path) against the
   grouped one and the vectorized path's im2col + ``bmm`` kernel
   (``gossip.vectorized.batched_conv1d``) over ``--groups`` nodes, with the FLOP rates.
3. **logreg**: the batched cross-entropy of 1024 x 32 rows of 10 classes, torch's
   ``F.cross_entropy`` against the classes-major log-softmax the vectorized path
   uses (``gossip.vectorized.cross_entropy_rows``), forward and backward.

4. **evaluation**: ``gossip.vectorized.node_accuracies`` of 33 models (xbar's and the
   32 sampled nodes') over bench_sim's 2,048 test examples, ``node_chunk`` models per
   batched call, for each model (its figures do not depend on ``node_chunk``).

5. **anatomy and roofline** (``--anatomy model:nodes,...``): each path's step of
   bench_sim's set-up in parts (the forward and backward, the local update, the
   algorithm's step), and what one thread allows: all nodes' FLOPs at the matmul peak,
   one pass over the ``(n, d)`` values at the memcpy speed, and the ratios to the loop
   path those bounds leave.

Figures count only on a quiet machine (load average < 0.3): the run records the load
before and after. ``--json PATH`` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from experiments import bench_sim
from experiments._timing import min_interleaved

from gossip import vectorized  # noqa: E402
from experiments import _cli



def peak_gflops(repeats: int, size: int = 1024) -> float:
    """This thread's float32 matmul rate on a large square product (GFLOP/s)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    c = torch.empty(size, size)
    t = min_interleaved({"mm": lambda: torch.mm(a, b, out=c)}, repeats)["mm"]
    return 2 * size**3 / t / 1e9


_MATMULS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm")


def mlp_step(nodes: int, repeats: int) -> dict:
    """One vectorized mlp step under the profiler: the matmuls' time, FLOPs and share."""
    from torch.profiler import ProfilerActivity, profile

    ds = bench_sim.dataset(nodes)
    with tempfile.TemporaryDirectory() as tmp:
        run = bench_sim.build(nodes, "mlp", "vectorized", ds, Path(tmp) / "run", "cpu")
        try:
            run.step()  # first calls
            step = min_interleaved({"step": run.step}, repeats)["step"]
            with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
                run.step()
        finally:
            run.log.close()
    ops = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ops) / 1e6
    mm = [e for e in ops if e.key in _MATMULS]
    mm_s = sum(e.self_cpu_time_total for e in mm) / 1e6
    flops = sum(e.flops for e in mm)
    top = sorted(ops, key=lambda e: -e.self_cpu_time_total)[:6]
    return {"nodes": nodes, "step_s": step, "profiled_s": total, "matmul_s": mm_s, "matmul_share": mm_s / total,
            "matmul_gflop": flops / 1e9, "matmul_gflops": flops / mm_s / 1e9 if mm_s else None,
            "top_ops": [(e.key, e.self_cpu_time_total / 1e6) for e in top]}


#: the cnn1d's convolutions (bench_sim's data: 1 channel of length 40; batch 32)
_CONVS = (("conv1", 1, 64, 40, 1), ("conv2", 64, 64, 40, 2), ("conv3", 64, 64, 20, 2))


def conv_per_node(groups: list[int], repeats: int, batch: int = bench_sim.BATCH) -> list[dict]:
    """Forward and backward per node: a node's own convolution against the grouped one."""
    rows = []
    for name, cin, cout, length, stride in _CONVS:
        fns, per = {}, {}

        def make(g: int):
            x = torch.randn(batch, g * cin, length, requires_grad=cin > 1)  # conv1 reads the data
            w = torch.randn(g * cout, cin, 5, requires_grad=True)

            def f() -> None:
                x.grad = w.grad = None
                F.conv1d(x, w, stride=stride, padding=2, groups=g).sum().backward()
            return f
        def make_bmm(g: int):
            # the vectorized path's kernel: im2col and one bmm per node (gossip.vectorized.batched_conv1d)
            x = torch.randn(g, batch, cin, length, requires_grad=cin > 1)
            w = torch.randn(g, cout, cin, 5, requires_grad=True)

            def f() -> None:
                x.grad = w.grad = None
                vectorized.batched_conv1d(x, w, None, stride, 2).sum().backward()
            return f
        for g in (1, *groups):
            fns[g], per[g] = make(g), g
        for g in groups:
            fns[f"bmm{g}"] = make_bmm(g)
        best = min_interleaved(fns, repeats)
        lout = (length - 1) // stride + 1
        flops = 2 * batch * lout * cout * cin * 5 * (3 if cin > 1 else 2)  # forward, grad weight, grad input
        row = {"layer": name, "own_ms": 1e3 * best[1], "own_gflops": flops / best[1] / 1e9}
        for g in groups:
            row[f"grouped_{g}_ms_per_node"] = 1e3 * best[g] / g
            row[f"bmm_{g}_ms_per_node"] = 1e3 * best[f"bmm{g}"] / g
            row[f"bmm_{g}_gflops"] = flops * g / best[f"bmm{g}"] / 1e9
        rows.append(row)
    return rows


def node_step_flops(model: str, batch: int = bench_sim.BATCH) -> tuple[int, int]:
    """FLOPs of one node's forward and backward on one batch, and the model's parameter
    count (:func:`experiments.bench_sim.node_step_flops`, whose roofline this one shares)."""
    return bench_sim.node_step_flops(model, batch)


def anatomy(model: str, nodes: int, steps: int) -> dict:
    """One step of each path (bench_sim's set-up) in parts, the minimum of each over
    ``steps`` steps after a warm-up: the whole step; ``local_update``, the runtime's
    step before the algorithm's (the local optimizer, and the loop path's copy and
    restore of X); ``algorithm``, the algorithm's step (its encoding, exchange, mixing
    and update of X, the same code on both paths); ``compute`` the rest (the batches,
    the forward and backward passes)."""
    ds = bench_sim.dataset(nodes)
    out: dict = {"model": model, "nodes": nodes}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("loop", "vectorized"):
            run = bench_sim.build(nodes, model, mode, ds, Path(tmp) / mode, "cpu")
            parts: dict[str, float] = {}

            def timed(name: str, fn):
                def wrapper(*a, **k):
                    t = time.perf_counter()
                    try:
                        return fn(*a, **k)
                    finally:
                        parts[name] = parts.get(name, 0.0) + time.perf_counter() - t
                return wrapper
            run.gopt.algorithm.step = timed("algorithm", run.gopt.algorithm.step)
            run.gopt.step = timed("runtime_step", run.gopt.step)
            best: dict[str, float] = {}
            try:
                run.step()  # first calls
                for _ in range(steps):
                    parts.clear()
                    t = time.perf_counter()
                    run.step()
                    parts["step"] = time.perf_counter() - t
                    parts["local_update"] = parts["runtime_step"] - parts["algorithm"]
                    parts["compute"] = parts["step"] - parts["runtime_step"]
                    for k, v in parts.items():
                        best[k] = min(best.get(k, float("inf")), v)
            finally:
                run.log.close()
            out[mode] = {k: best[k] for k in ("step", "compute", "local_update", "algorithm")}
            if mode == "vectorized":
                out["kernels"] = run.gopt.kernels
    return out


def roofline(model: str, nodes: int, peak: float, memcpy_gbps: float, parts: dict) -> dict:
    """What one thread of this machine allows the vectorized step: the FLOPs of all
    nodes' forward and backward at the measured matmul peak, and one pass over the
    ``(n, d)`` float32 values (read and written once, as a copy) at the measured memcpy
    speed; the ratio bound if the vectorized step did its FLOPs at the peak plus
    ``passes`` such passes while the loop path kept its measured time."""
    flops, d = node_step_flops(model)
    matmul_s = nodes * flops / (peak * 1e9)
    pass_s = nodes * d * 4 / (memcpy_gbps * 1e9)
    loop_s = parts["loop"]["step"]
    return {"model": model, "nodes": nodes, "params": d, "node_step_mflop": flops / 1e6,
            "matmul_at_peak_s": matmul_s, "pass_bytes": nodes * d * 4, "pass_s": pass_s,
            "loop_step_s": loop_s, "algorithm_s": parts["vectorized"]["algorithm"],
            "bound_compute_only": loop_s / matmul_s,
            "bound_with_algorithm": loop_s / (matmul_s + parts["vectorized"]["algorithm"]),
            **{f"bound_{k}_passes": loop_s / (matmul_s + k * pass_s) for k in (4, 8)}}


def cross_entropy(nodes: int, repeats: int, batch: int = bench_sim.BATCH, classes: int = 10) -> dict:
    z = torch.randn(nodes * batch, classes, requires_grad=True)
    y = torch.randint(0, classes, (nodes * batch,))

    def run(fn):
        def f() -> None:
            z.grad = None
            fn(z, y).sum().backward()
        return f
    best = min_interleaved({"torch": run(lambda a, b: F.cross_entropy(a, b, reduction="none")),
                             "classes_major": run(vectorized.cross_entropy_rows)}, repeats)
    return {"rows": nodes * batch, "torch_ms": 1e3 * best["torch"], "classes_major_ms": 1e3 * best["classes_major"],
            "ratio": best["torch"] / best["classes_major"]}


def evaluation(chunks: list[int], repeats: int, models: tuple[str, ...] = ("logreg", "mlp", "cnn1d"),
               rows: int = vectorized.EVAL_NODES + 1) -> list[dict]:
    """Seconds of node_accuracies over ``rows`` models per ``node_chunk``, per model."""
    from gossip import algorithms, models as gmodels
    from gossip.comm import SimulatedCommunicator
    from topologies import ring

    ds = bench_sim.dataset(rows)
    out = []
    for name in models:
        model = gmodels.build_model(name, input_shape=(1, bench_sim.FEATURES), num_classes=bench_sim.CLASSES, seed=0)
        algo = algorithms.build("dpsgd", SimulatedCommunicator(ring(max(3, rows))))  # a ring has 3 nodes or more
        gopt = vectorized.VectorizedOptimizer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), algo)
        with torch.no_grad():
            gopt.flat.data.add_(0.01 * torch.randn(gopt.flat.data.shape, generator=torch.Generator().manual_seed(0)))
        X = gopt.flat.data[:rows]
        best = min_interleaved({c: (lambda c=c: vectorized.node_accuracies(gopt, ds.x_test, ds.y_test, X, node_chunk=c))
                                 for c in chunks}, repeats)
        out.append({"model": name, "models_evaluated": rows, **{f"node_chunk_{c}_s": best[c] for c in chunks}})
    return out


def options(ap: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run sim_kernels``."""
    ap.add_argument("--nodes", type=int, default=1024, help="nodes of the mlp step and of the cross-entropy rows")
    ap.add_argument("--groups", default="64,256", help="node counts of the grouped convolutions")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--eval-models", type=int, default=vectorized.EVAL_NODES + 1,
                    help="models of the evaluation timing (the CLI's: xbar and 32 sampled nodes)")
    ap.add_argument("--anatomy", default="mlp:1024,cnn1d:256",
                    help="model:nodes pairs whose step is timed in parts on both paths, with the roofline ('' skips)")
    ap.add_argument("--json", metavar="PATH")


def main(argv: list[str] | None = None) -> int:
    ap, a = _cli.parse(argv, options, __doc__, "sim_kernels")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        load0 = os.getloadavg()[0]
        print(f"load average (1 min) before: {load0:.2f}" + ("  WARNING: above 0.3, figures are indicative only"
                                                             if load0 > 0.3 else ""), flush=True)
        groups = [int(g) for g in a.groups.split(",")]
        peak = peak_gflops(a.repeats)
        print(f"one-thread float32 matmul peak (1024^3): {peak:.1f} GFLOP/s", flush=True)
        mlp = mlp_step(a.nodes, max(2, a.repeats // 2))
        print(f"mlp, {a.nodes} nodes: step {mlp['step_s']:.3f} s; matmuls {mlp['matmul_s']:.3f} s "
              f"({mlp['matmul_share']:.0%} of the profiled step), {mlp['matmul_gflop']:.2f} GFLOP at "
              f"{mlp['matmul_gflops'] or 0:.1f} GFLOP/s ({(mlp['matmul_gflops'] or 0) / peak:.0%} of the peak); top ops: "
              + ", ".join(f"{k} {s * 1e3:.0f} ms" for k, s in mlp["top_ops"]), flush=True)
        convs = conv_per_node(groups, a.repeats)
        for r in convs:
            print(f"cnn1d {r['layer']}: own {r['own_ms']:.3f} ms ({r['own_gflops']:.1f} GFLOP/s); per node, grouped / bmm: "
                  + ", ".join(f"{g} nodes {r[f'grouped_{g}_ms_per_node']:.3f} / {r[f'bmm_{g}_ms_per_node']:.3f} ms "
                              f"({r[f'bmm_{g}_gflops']:.1f} GFLOP/s)" for g in groups), flush=True)
        ce = cross_entropy(a.nodes, a.repeats)
        print(f"cross-entropy, {ce['rows']} rows x 10 classes, forward and backward: torch {ce['torch_ms']:.2f} ms, "
              f"classes-major {ce['classes_major_ms']:.2f} ms ({ce['ratio']:.1f}x)", flush=True)
        evals = evaluation([1, 4, 16], max(1, a.repeats // 2), rows=a.eval_models)
        for r in evals:
            print(f"evaluation of {r['models_evaluated']} {r['model']} models, node_chunk 1 / 4 / 16: "
                  + " / ".join(f"{r[f'node_chunk_{c}_s']:.2f}" for c in (1, 4, 16)) + " s", flush=True)
        memcpy = bench_sim.memcpy_gbps()
        parts, bounds = [], []
        for spec in a.anatomy.split(",") if a.anatomy else []:
            model, nodes = spec.split(":")
            p = anatomy(model, int(nodes), max(2, a.repeats // 2))
            parts.append(p)
            print(f"{model}, {nodes} nodes, step in parts (loop / vectorized, {p['kernels']} kernels): "
                  + ", ".join(f"{k} {1e3 * p['loop'][k]:.0f} / {1e3 * p['vectorized'][k]:.0f} ms"
                              for k in ("step", "compute", "local_update", "algorithm")), flush=True)
            b = roofline(model, int(nodes), peak, memcpy, p)
            bounds.append(b)
            print(f"  roofline: {b['node_step_mflop']:.1f} MFLOP per node-step, all nodes' at the peak "
                  f"{1e3 * b['matmul_at_peak_s']:.0f} ms; one pass over (n, d) ({b['pass_bytes'] / 2**20:.0f} MiB) at "
                  f"memcpy {memcpy:.1f} GB/s {1e3 * b['pass_s']:.0f} ms; ratio bounds against the loop's "
                  f"{1e3 * b['loop_step_s']:.0f} ms: matmuls at the peak alone {b['bound_compute_only']:.1f}x, plus the "
                  f"algorithm's measured step {b['bound_with_algorithm']:.1f}x, plus 4 / 8 passes "
                  f"{b['bound_4_passes']:.1f}x / {b['bound_8_passes']:.1f}x", flush=True)
        load1 = os.getloadavg()[0]
        print(f"load average (1 min) before {load0:.2f}, after {load1:.2f}")
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps({
                "command": " ".join(["python", "-m", "experiments.sim_kernels", *(argv if argv is not None else sys.argv[1:])]),
                "cpu_threads": 1, "load_avg_before": load0, "load_avg_after": load1, "peak_gflops": peak,
                "memcpy_gbps": memcpy, "mlp": mlp, "conv": convs, "cross_entropy": ce, "evaluation": evals,
                "anatomy": parts, "roofline": bounds}, indent=1) + "\n")
    finally:
        torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
