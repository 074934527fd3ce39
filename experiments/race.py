#!/usr/bin/env python3
"""The race: bytes and (modelled) time to a target test accuracy, per method.

    python experiments/race.py --out runs/race                       # MNIST-1D CNN, 4 nodes
    python experiments/race.py --nodes 16 --bandwidth 10mbit,100mbit --latency 5ms --out runs/race16
    python experiments/race.py --methods allreduce,localsgd --epochs 1 --data synthetic --out runs/race-smoke

Simulated-time mode (the only one so far). Every method trains the same model on the
same data with the same recipe, all ``--nodes`` nodes simulated in one process
(``gossip.train --simulate N``), one run directory per method under ``--out``. From
each run's per-node metrics it reads, at every evaluation (each epoch's end): the test
accuracy, the bytes the node has sent, and the compute and compression time it has
spent on this machine; from the run's last checkpoint, the communication calls per
step by kind. The wall-clock time at a bandwidth B and one-way latency L is then
modelled as ``gossip.crossover`` does for one step, summed over the steps so far:

    T = compute + codec + overhead * 8 * bytes / B + L * (message rounds)

(a ring all-reduce is 2(n - 1) rounds, an all-gather n - 1, a neighbour exchange 1).
Compute, compression and communication are not overlapped; each node has its own
link of rate B. Nothing here runs over a real shaped network: the netns cluster
(``experiments/vcluster.py``) is not wired in.

Output in ``--out``: ``race.json`` (every method's curve and figures, each evaluation's
modelled time per bandwidth in ``time_s``, the load average at the start and end), ``race.md``
(method, bytes to target, time to target at each bandwidth, final accuracy) and, with
matplotlib, ``race.png`` (test accuracy against modelled time, one panel per
bandwidth). The run directories are ordinary ones: ``gossip.analysis.load_runs(out)``
reads them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gossip import checkpoint, crossover, rundir  # noqa: E402

#: name -> the gossip.train flags that make the method (on top of the recipe)
METHODS: dict[str, list[str]] = {
    "allreduce": ["--algo", "allreduce"],
    "dpsgd": ["--algo", "dpsgd"],
    "ecd:8": ["--algo", "ecd", "--bits", "8"],
    "dcd:4": ["--algo", "dcd", "--bits", "4"],
    "powersgd:2": ["--algo", "powersgd", "--algo-opt", "rank=2"],
    "efsgd-sign": ["--algo", "efsgd", "--compressor", "sign"],
    "localsgd": ["--algo", "localsgd"],
    "diloco": ["--algo", "diloco"],
    "diloco:4": ["--algo", "diloco", "--bits", "4", "--algo-opt", "error_feedback=true"],
}
#: the shared recipe (SGD methods; diloco's inner AdamW takes its own lr below): with 30
#: epochs it brings allreduce on 4 nodes to 94.6 % (seed 0); the demo's constant 0.05 for
#: 20 epochs ends at 93.2 % and cosine from 0.05 over 40 epochs at 91.9 % (it overfits)
RECIPE = ["--lr", "0.1", "--lr-schedule", "step", "--weight-decay", "1e-3", "--batch-size", "32"]
#: flags a method needs on top of the recipe (later flags win in gossip.train)
METHOD_RECIPE = {"diloco": ["--lr", "0.003"], "diloco:4": ["--lr", "0.003"]}


def _train(args: list[str]) -> tuple[int, str]:
    """gossip.train in this process; its exit code and stderr."""
    from gossip import train

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            rc = train.main(args)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return rc, err.getvalue()


def run_method(name: str, out: Path, nodes: int, common: list[str]) -> Path:
    run_dir = out / name.replace(":", "-")
    args = ["--simulate", str(nodes), *RECIPE, *common, *METHODS[name], *METHOD_RECIPE.get(name, []),
            "--log-every", "1", "--no-progress", "--overwrite", "--out", str(run_dir)]
    rc, err = _train(args)
    if rc != 0:
        raise SystemExit(f"race: {name} failed (exit {rc}): {err.strip().splitlines()[-1] if err.strip() else ''}")
    return run_dir


def curve(run_dir: Path) -> dict:
    """Per evaluation: step, test accuracy, node 0's cumulative bytes sent and compute and
    codec seconds; and the communication calls per step by kind."""
    recs = rundir.read_metrics(rundir.metrics_path(run_dir, 0))
    train = {r["step"]: r for r in recs if r["kind"] == "train"}
    points = []
    for r in recs:
        if r["kind"] != "eval":
            continue
        t = train[r["step"]]
        points.append({"step": r["step"], "epoch": r["epoch"], "test_acc": r["test_acc"],
                       "bytes": t["bytes_sent"], "compute_s": t["compute_s"], "codec_s": t["compress_s"]})
    summary = rundir.read_json(rundir.summary_path(run_dir))
    last = checkpoint.latest_checkpoint(run_dir, num_ranks=1)
    ledger = checkpoint.load_checkpoint(last)["ledger"]
    steps = max(1, summary["steps"])
    calls = {op: v[0] / steps for op, v in ledger["ops"].items() if op != "control" and v[0]}
    return {"points": points, "calls_per_step": calls, "final_test_acc": summary["final_test_acc"],
            "steps": summary["steps"], "wire": summary["wire"], "world_size": summary["world_size"]}


def modelled_time(point: dict, calls: dict, n: int, bandwidth: float, latency: float,
                  overhead: float = crossover.LINK_OVERHEAD) -> float:
    rounds = point["step"] * sum(k * crossover.rounds_of(op, n) for op, k in calls.items())
    return point["compute_s"] + point["codec_s"] + overhead * 8.0 * point["bytes"] / bandwidth + latency * rounds


def to_target(c: dict, target: float, bandwidths: list[float], latency: float) -> dict:
    """Bytes and modelled time at the first evaluation reaching ``target`` (None: never)."""
    n = c["world_size"]
    for p in c["points"]:
        if p["test_acc"] >= target:
            return {"step": p["step"], "epoch": p["epoch"], "bytes": p["bytes"],
                    "time_s": [modelled_time(p, c["calls_per_step"], n, b, latency) for b in bandwidths]}
    return {"step": None, "epoch": None, "bytes": None, "time_s": [None for _ in bandwidths]}


def _fmt_bytes(b: float | None) -> str:
    if b is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if b < 1024 or unit == "GB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return f"{b:.1f} GB"


def table(results: dict, target: float, bw_labels: list[str]) -> str:
    head = ["method", "wire", f"epoch to {target:.0%}", "bytes/node to target"] + \
        [f"time to target @ {b}" for b in bw_labels] + ["final acc"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        t = r["to_target"]
        times = ["-" if s is None else f"{s:.3g} s" for s in t["time_s"]]
        epoch = "not reached" if t["epoch"] is None else f"{t['epoch']:.0f}"
        lines.append("| " + " | ".join([name, r["wire"]["label"], epoch, _fmt_bytes(t["bytes"]), *times,
                                         f"{r['final_test_acc']:.2%}"]) + " |")
    return "\n".join(lines)


def plot(results: dict, bandwidths: list[float], bw_labels: list[str], latency: float, path: Path,
         target: float | None = None) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(bandwidths), figsize=(6 * len(bandwidths), 4), squeeze=False)
    for ax, b, label in zip(axes[0], bandwidths, bw_labels):
        for name, r in results.items():
            n = r["world_size"]
            xs = [modelled_time(p, r["calls_per_step"], n, b, latency) for p in r["points"]]
            ax.plot(xs, [p["test_acc"] for p in r["points"]], marker=".", label=name)
        if target is not None:
            ax.axhline(target, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_xlabel("modelled wall-clock time (s)")
        ax.set_ylabel("test accuracy")
        ax.set_title(f"{label}, latency {latency * 1e3:g} ms")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--data", default="mnist1d")
    p.add_argument("--target", type=float, default=0.94, help="test accuracy to reach (default 0.94)")
    p.add_argument("--bandwidth", default="10mbit,100mbit", help="link rates (default 10mbit,100mbit)")
    p.add_argument("--latency", default="0", help="one-way latency (default 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="directory for the run directories and the results")
    a = p.parse_args(argv)
    names = [m.strip() for m in a.methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        p.error(f"--methods: unknown {', '.join(unknown)}; known: {', '.join(METHODS)}")
    try:
        bw_labels = [b.strip() for b in a.bandwidth.split(",")]
        bandwidths = [crossover.parse_rate(b) for b in bw_labels]
        latency = crossover.parse_time(a.latency)
    except crossover.CrossoverError as e:
        p.error(str(e))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    common = ["--data", a.data, "--epochs", str(a.epochs), "--seed", str(a.seed)]
    results = {}
    load = [os.getloadavg()[0]]  # the compute times are measured on this machine: say how busy it was
    for name in names:
        print(f"race: {name} ...", flush=True)
        c = curve(run_method(name, out, a.nodes, common))
        c["to_target"] = to_target(c, a.target, bandwidths, latency)
        for pt in c["points"]:  # the modelled time of every evaluation, one per bandwidth
            pt["time_s"] = [modelled_time(pt, c["calls_per_step"], c["world_size"], b, latency) for b in bandwidths]
        results[name] = c
    load.append(os.getloadavg()[0])
    md = table(results, a.target, bw_labels)
    cmd = "python experiments/race.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "race.md").write_text(
        f"{md}\n\nMade with `{cmd}` (simulated time, {a.nodes} nodes; load average {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end, on {os.cpu_count()} cores).\n")
    (out / "race.json").write_text(json.dumps({
        "target": a.target, "nodes": a.nodes, "epochs": a.epochs, "data": a.data, "bandwidths": bw_labels,
        "latency_s": latency, "recipe": RECIPE, "methods": {k: METHODS[k] + METHOD_RECIPE.get(k, []) for k in names},
        "results": results, "mode": "simulated-time", "load_average": load, "cpu_count": os.cpu_count(),
    }, indent=1))
    drew = plot(results, bandwidths, bw_labels, latency, out / "race.png", a.target)
    print(md)
    print(f"race: wrote {out / 'race.md'}, {out / 'race.json'}" + (f", {out / 'race.png'}" if drew else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
