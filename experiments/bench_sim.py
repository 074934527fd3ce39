"""The in-process simulation at scale: nodes x steps per second, loop path vs vectorized.

    python -m experiments run bench_sim [--json PATH] [--quick] [--nodes 16,256,1024,16384]
                                    [--models logreg,mlp,cnn1d] [--steps K] [--device cpu|cuda]

For each model and node count, both paths of ``gossip.train --simulate N`` are built
as the CLI builds them (``gossip.train.loop.Run``: D-PSGD on a ring, SGD with momentum 0.9,
batch 32, one thread) on a data set of 40 features and 10 classes with 131,072
training samples (more where N x 32 x 4 needs more: every node gets at least four
batches; the runs span as many epochs as the timed steps need), then stepped
alternately, one step of each path in turn, so that a change of the machine's load
hits both alike. Each path's step time is the minimum over the
timed steps (after one warm-up step); nodes x steps per second is N over it, and the
ratio is vectorized over loop. A path whose N copies would not fit in memory is
refused by the run's own memory check and reported as such; a loop path slower than
``--loop-budget`` seconds per step is timed on two steps only, and so is the
vectorized path then (the minimum of more steps would favour it on a noisy machine).

Each row on the CPU also gives the step's roofline (:func:`roofline`): the shortest
vectorized step one thread of this machine allows, all nodes' matrix products at the
thread's measured matmul peak plus the ``(n, d)`` passes no vectorized D-PSGD step
avoids at the measured memcpy speed; the ratio to the loop that it would give; and the
fraction of it reached (that shortest step over the measured vectorized step).

Then, for ``--epoch-nodes`` (1024) nodes and each model, one whole epoch of the
vectorized path as the CLI runs it (``Run.train``: set-up, steps, the epoch's
evaluation, the final checkpoint): the share of the wall time spent outside the steps.

The results JSON records the command, the commit, the machine (CPU, cores, memcpy
GB/s), the load average before and after, and every row; docs/simulation.md's table
is rendered from it. The machine must be quiet (load < 0.3) for the figures to count.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from experiments import _provenance
from experiments import tables

from gossip import comm as gcomm
from gossip import data
from gossip.train import assembly, loop
from gossip.train.config import parse_args
from experiments import _cli

FEATURES, CLASSES, BATCH = 40, 10, 32
MIN_TRAIN = 131_072

#: reads or writes of the ``(n, d)`` float32 values that a vectorized step of D-PSGD
#: with SGD and momentum cannot avoid (docs/simulation.md, "Roofline"): the weights
#: read by the forward and again by the backward, the gradient written (2 + 1); the
#: local update and the mixing's update of X in one pass (gradient, momentum and X
#: read; momentum and X written: u is never stored, each block's weighted sum is used
#: in cache); the encoding's copy (read X, write the payloads; the finiteness check
#: and the checksum read the copy while it is in cache), the neighbours' rows read (2
#: on a ring). The simulation's own untouched payloads are not checksummed again.
ROOFLINE_READS_WRITES = 3 + 5 + 2 + 2


def dataset(n: int, seed: int = 0) -> data.Dataset:
    """A classification problem: Gaussian inputs (1, 40), labels from a fixed linear map."""
    g = torch.Generator().manual_seed(seed)
    n_train = max(MIN_TRAIN, 4 * BATCH * n)
    w = torch.randn(FEATURES, CLASSES, generator=g)
    x = torch.randn(n_train + 2048, 1, FEATURES, generator=g)
    y = (x.flatten(1) @ w + 0.5 * torch.randn(n_train + 2048, CLASSES, generator=g)).argmax(1)
    return data.Dataset(name="bench", x_train=x[:n_train].contiguous(), y_train=y[:n_train].contiguous(),
                        x_test=x[n_train:].contiguous(), y_test=y[n_train:].contiguous(), num_classes=CLASSES,
                        input_shape=(1, FEATURES))


def build(n: int, model: str, mode: str, ds: data.Dataset, out: Path, device: str, epochs: int = 1) -> loop.Run:
    argv = ["--simulate", str(n), "--simulate-mode", mode, "--algo", "dpsgd", "--topology", "ring",
            "--model", model, "--data", "synthetic", "--batch-size", str(BATCH), "--epochs", str(epochs),
            "--lr", "0.05", "--log-every", "1000000", "--no-progress", "--device", device, "--out", str(out)]
    cfg = parse_args(argv)
    env = assembly.Env(world_size=n, distributed=False, rank=0)
    topo = assembly.build_topology(cfg, n)
    dev = assembly.choose_device(cfg, env)
    comm = gcomm.SimulatedCommunicator(topo, world_size=n, device=dev)
    return loop.Run(cfg, env, topo, dev, ds, comm)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed_step(run: loop.Run, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    run.step()
    _sync(device)
    return time.perf_counter() - t0


def bench_pair(n: int, model: str, steps: int, device: str, loop_budget: float, loop_max: int | None = None) -> dict:
    ds = dataset(n)
    row: dict = {"model": model, "nodes": n}
    runs: dict[str, loop.Run] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("loop", "vectorized"):
            if mode == "loop" and loop_max is not None and n > loop_max:
                row["loop_error"] = f"not run (--loop-max-nodes {loop_max})"
                continue
            t0 = time.perf_counter()
            try:
                # as many epochs as steps: every requested step is timed, however few
                # batches an epoch holds (four per node at the largest node counts)
                runs[mode] = build(n, model, mode, ds, Path(tmp) / mode, device, epochs=steps + 1)
            except loop.RunError as e:
                row[f"{mode}_error"] = str(e)
                continue
            row[f"{mode}_setup_s"] = time.perf_counter() - t0
            row[f"{mode}_warmup_s"] = _timed_step(runs[mode], device)  # first step: first calls
        row["params"] = next(iter(runs.values())).dim if runs else None
        times: dict[str, list[float]] = {m: [] for m in runs}
        capped = False
        for k in range(steps):  # interleaved: one step of each path in turn
            for mode, r in runs.items():
                if mode == "loop" and k > 0 and min(times["loop"]) > loop_budget and len(times["loop"]) >= 2:
                    capped = True
                    continue
                if mode != "loop" and capped:
                    # the minimum of as many steps as the loop path's: a minimum over more
                    # steps is lower on a noisy machine, which would favour this path
                    continue
                times[mode].append(_timed_step(r, device))
        for mode, ts in times.items():
            if ts:
                row[f"{mode}_step_s"] = min(ts)
                row[f"{mode}_steps_timed"] = len(ts)
                row[f"{mode}_node_steps_per_s"] = n / min(ts)
        if row.get("loop_step_s") and row.get("vectorized_step_s"):
            row["ratio"] = row["loop_step_s"] / row["vectorized_step_s"]
        for r in runs.values():
            r.log.close()
    return row


def bench_epoch(n: int, model: str, device: str) -> dict:
    """One whole epoch as the CLI runs it; the share of the wall time outside the steps."""
    ds = dataset(n)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        run = build(n, model, "vectorized", ds, Path(tmp) / "run", device)
        setup = time.perf_counter() - t0
        inside = [0.0]
        step = run.step

        def timed() -> None:
            inside[0] += _timed_step_fn(step, device)

        run.step = timed  # type: ignore[method-assign]
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):
            t1 = time.perf_counter()
            run.train()
            total = setup + time.perf_counter() - t1
    return {"model": model, "nodes": n, "steps": run.progress.step, "setup_s": setup, "steps_s": inside[0],
            "total_s": total, "outside_share": 1.0 - inside[0] / total}


def _timed_step_fn(fn, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def node_step_flops(model: str, batch: int = BATCH) -> tuple[int, int]:
    """FLOPs of one node's forward and backward on one batch of bench_sim's data,
    counting the linear layers' and convolutions' multiply-adds (2 FLOPs each): the
    forward, the weight gradient and the input gradient (none for the first layer,
    which reads the data); and the model's parameter count."""
    from gossip import models as gmodels

    net = gmodels.build_model(model, input_shape=(1, FEATURES), num_classes=CLASSES, seed=0)
    macs: list[int] = []

    def hook(mod, inputs, out) -> None:
        if isinstance(mod, torch.nn.Linear):
            macs.append(out.numel() * mod.in_features)
        elif isinstance(mod, torch.nn.Conv1d):
            macs.append(out.numel() * mod.in_channels * mod.kernel_size[0] // mod.groups)
    handles = [m.register_forward_hook(hook) for m in net.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d))]
    with torch.no_grad():
        net(torch.zeros(batch, 1, FEATURES))
    for h in handles:
        h.remove()
    flops = sum(2 * m * (2 if i == 0 else 3) for i, m in enumerate(macs))
    return flops, sum(p.numel() for p in net.parameters())


def peak_gflops(repeats: int = 5, size: int = 1024) -> float:
    """This thread's float32 matmul rate on a large square product (GFLOP/s)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    c = torch.empty(size, size)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e9


def roofline(model: str, nodes: int, peak: float, memcpy: float) -> dict:
    """The shortest vectorized step of bench_sim's set-up that one thread allows: all
    nodes' FLOPs (:func:`node_step_flops`) at the matmul peak ``peak`` (GFLOP/s), plus
    :data:`ROOFLINE_READS_WRITES` reads or writes of the ``(n, d)`` float32 values at
    the memcpy speed ``memcpy`` (GB/s copied: each copy a read and a write)."""
    flops, d = node_step_flops(model)
    matmul_s = nodes * flops / (peak * 1e9)
    passes_s = ROOFLINE_READS_WRITES / 2 * nodes * d * 4 / (memcpy * 1e9)
    return {"node_step_mflop": flops / 1e6, "matmul_at_peak_s": matmul_s, "passes_s": passes_s,
            "step_s": matmul_s + passes_s}


def add_roofline(row: dict, peak: float, memcpy: float) -> None:
    """The row's roofline: the shortest vectorized step, the loop-to-vectorized ratio it
    would give against the loop's measured step (``roofline_ratio``), and the fraction
    of it reached (``roofline_fraction``: the shortest step over the measured one, the
    measured ratio over the bound's)."""
    if not row.get("vectorized_step_s"):
        return
    r = roofline(row["model"], row["nodes"], peak, memcpy)
    row["roofline"] = r
    row["roofline_fraction"] = r["step_s"] / row["vectorized_step_s"]
    if row.get("loop_step_s"):
        row["roofline_ratio"] = row["loop_step_s"] / r["step_s"]


def memcpy_gbps() -> float:
    x = torch.empty(1 << 24)
    y = torch.empty_like(x)
    best = min(_timed_copy(x, y) for _ in range(5))
    return x.numel() * 4 / best / 1e9


def _timed_copy(x, y) -> float:
    t0 = time.perf_counter()
    y.copy_(x)
    return time.perf_counter() - t0


def _run_record(argv: list[str]) -> dict:
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
        except OSError:
            return ""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "command": " ".join(["python", "-m", "experiments.bench_sim", *map(_provenance.portable, argv)]),
        "commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain")),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
        "memcpy_gbps": memcpy_gbps(), "torch": torch.__version__,
    }


RESULTS = Path(__file__).resolve().parent / "results"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "simulation.md"


def scale_data(seed: int) -> data.Dataset:
    """``--data bench_sim:scale_data``: the bench's data set, large enough for 16,384
    nodes of four batches of 32 (``experiments`` on PYTHONPATH)."""
    return dataset(16_384, seed)


def update_docs() -> None:
    """Re-render docs/simulation.md's tables (every marked table, as ``make results-tables``)."""
    from experiments import render as _render

    _render.render_all(write=True)


def options(ap: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run bench_sim``."""
    ap.add_argument("--nodes", default="16,256,1024,16384")
    ap.add_argument("--models", default="logreg,mlp,cnn1d")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per path (after one warm-up)")
    ap.add_argument("--loop-budget", type=float, default=2.0, help="seconds per loop step above which it is timed twice only")
    ap.add_argument("--loop-max-nodes", type=int, default=None, help="run the loop path up to this many nodes only")
    ap.add_argument("--epoch-nodes", type=int, default=1024, help="nodes of the one-epoch run (0: skip it)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="16 and 64 nodes, logreg and mlp, 2 steps (a smoke test)")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    ap.add_argument("--update-docs", action="store_true",
                    help="only re-render the docs' tables from experiments/results/*.json (make results-tables)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap, a = _cli.parse(argv, options, __doc__, "bench_sim")
    if a.update_docs:
        update_docs()
        return 0
    torch.set_num_threads(a.threads)
    nodes = [int(v) for v in a.nodes.split(",")]
    models = a.models.split(",")
    if a.quick:
        nodes, models, a.steps, a.epoch_nodes = [16, 64], ["logreg", "mlp"], 2, 64
    load0 = os.getloadavg()[0]
    print(f"load average (1 min) before: {load0:.2f}" + ("  WARNING: above 0.3, figures are not the machine's own"
                                                         if load0 > 0.3 else ""), flush=True)
    rows, epochs = [], []
    prov = _run_record(argv)
    record = _provenance.start(_provenance.training_sources("experiments/bench_sim.py"), argv=["experiments/bench_sim.py", *argv],
                               measure_memcpy=False)
    record.machine["memcpy_gbps"] = prov["memcpy_gbps"]
    if a.device == "cuda":
        prov["gpu"] = torch.cuda.get_device_name(0)
    else:  # the roofline's compute bound: this thread's matmul rate
        prov["matmul_peak_gflops"] = peak_gflops()

    def save() -> None:  # after every row: a run cut short keeps what it measured
        if a.json:
            record.load_after = []  # finish() takes the load of this save, the latest
            peak_now = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps({
                **prov, "load_avg_before": load0, "load_avg_after": os.getloadavg()[0], "peak_rss_gib": peak_now,
                "device": a.device, "batch_size": BATCH, "algo": "dpsgd", "topology": "ring",
                "rows": rows, "epoch": epochs, "provenance": record.finish()}, indent=1) + "\n")

    for model in models:
        for n in nodes:
            # cnn1d and mlp at 16,384 nodes: both paths' copies are refused by the memory check, or run
            try:
                row = bench_pair(n, model, a.steps, a.device, a.loop_budget, a.loop_max_nodes)
            except torch.OutOfMemoryError as e:  # a GPU too small for N copies: say so, go on
                row = {"model": model, "nodes": n, "error": f"out of memory: {str(e).splitlines()[0][:120]}"}
                if a.device == "cuda":
                    torch.cuda.empty_cache()
            row["load_avg"] = os.getloadavg()[0]
            if a.device == "cpu":
                add_roofline(row, prov["matmul_peak_gflops"], prov["memcpy_gbps"])
            rows.append(row)
            save()
            print(tables.bench_sim_table([row]).splitlines()[-1], flush=True)
    if a.epoch_nodes:
        for model in models:
            e = bench_epoch(a.epoch_nodes, model, a.device)
            e["load_avg"] = os.getloadavg()[0]
            epochs.append(e)
            save()
            print(f"one epoch, {model}, {e['nodes']} nodes, vectorized: {e['steps']} steps, total {e['total_s']:.2f} s, "
                  f"steps {e['steps_s']:.2f} s, set-up {e['setup_s']:.2f} s: {e['outside_share']:.0%} outside the steps",
                  flush=True)
    load1 = os.getloadavg()[0]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    save()
    print()
    print(tables.bench_sim_table(rows))
    print(f"\nload average (1 min) before {load0:.2f}, after {load1:.2f}; peak RSS {peak:.2f} GiB")
    if a.json:
        print(f"results: {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
