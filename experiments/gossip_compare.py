#!/usr/bin/env python3
"""Decentralized algorithms side by side on non-iid data: accuracy against bytes sent
and against simulated wall-clock time.

    python -m experiments run gossip_compare --out runs/gossip-compare          # MNIST-1D, 8 nodes, sorted shards
    python -m experiments run gossip_compare --methods dpsgd,choco-sign --epochs 1 --data synthetic --out runs/gc-smoke

D-PSGD, DCD-PSGD, ECD-PSGD, CHOCO-SGD and SGP train the same CNN on MNIST-1D, the
training set label-sorted and cut into contiguous shards (``--partition sorted``: each
of the 8 nodes sees one or two classes), all nodes simulated in one process
(``gossip.train --simulate 8``), one ordinary run directory per method under ``--out``.
Every method gets the same recipe (``RECIPE``) and the same seed; what sets them apart
is in ``METHODS``:

* ``dpsgd``: fp32 models on the ring.
* ``dcd:8``, ``ecd:8``: 8-bit unbiased stochastic quantization (``quant:bits=8``, the
  default of both; they refuse biased compressors), ring.
* ``choco-sign``, ``choco-top1``: CHOCO with scaled sign (its default compressor) and
  with top-1 %, both at the default consensus step gamma = 0.1, ring.
* ``sgp``: push-sum on the one-peer exponential graph (``--topology onepeer-exp``, its
  graph in Assran et al. 2019), no overlap: one message per node per step where the
  ring methods send two.

At every evaluation (each epoch's end) the script reads node 0's test accuracy, bytes
sent (the setup exchange of x_1 by dcd, ecd and choco included) and measured compute
and codec seconds, and models the wall-clock time at each
``--bandwidth`` exactly as ``experiments/race.py`` does (``gossip.tools.crossover``'s link
model: compute + codec + 1.05 * 8 * bytes / B + latency * message rounds; every node
has its own link, nothing overlapped). Nothing runs over a real shaped network.

Out: ``compare.json`` (every method's curve, each point's modelled time per bandwidth,
the load average at the start and the end, the provenance record of
``experiments/_provenance.py``; with ``--results PATH`` also written to PATH, e.g.
``experiments/results/gossip_compare.json``, which ``make results-tables`` renders into
docs/decentralized.md), ``compare.md`` (the table), and with
matplotlib ``compare.png`` (test accuracy against bytes sent per node and against the
modelled time at the first bandwidth). ``notebooks/decentralized.ipynb`` reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

from experiments import _cli
from experiments import tables
from experiments import _provenance
from experiments import race
from gossip import rundir  # noqa: E402
from gossip.tools import crossover  # noqa: E402

#: name -> the gossip.train flags that make the method (on top of the recipe)
METHODS: dict[str, list[str]] = {
    "dpsgd": ["--algo", "dpsgd", "--topology", "ring"],
    "dcd:8": ["--algo", "dcd", "--compressor", "quant:bits=8", "--topology", "ring"],
    "ecd:8": ["--algo", "ecd", "--compressor", "quant:bits=8", "--topology", "ring"],
    "choco-sign": ["--algo", "choco", "--compressor", "sign", "--topology", "ring"],
    "choco-top1": ["--algo", "choco", "--compressor", "topk:p=0.01", "--topology", "ring"],
    "sgp": ["--algo", "sgp", "--topology", "onepeer-exp"],
}
#: the shared recipe: experiments/race.py's (batch 32 per node, lr 0.1 with the step schedule,
#: weight decay 1e-3, gossip.train's default local SGD momentum 0.9), on sorted shards
RECIPE = ["--lr", "0.1", "--lr-schedule", "step", "--weight-decay", "1e-3", "--batch-size", "32",
          "--partition", "sorted"]


_train = race.train_in_process  # gossip.train in this process: its exit code and stderr


def run_method(name: str, out: Path, nodes: int, common: list[str]) -> Path:
    run_dir = out / name.replace(":", "-")
    args = ["--simulate", str(nodes), *RECIPE, *common, *METHODS[name],
            "--log-every", "1", "--no-progress", "--overwrite", "--out", str(run_dir)]
    _provenance.record_config(args)  # what `python -m experiments verify` witnesses
    rc, err = _train(args)
    if rc != 0:
        last = err.strip().splitlines()[-1] if err.strip() else ""
        raise SystemExit(f"gossip_compare: {name} failed (exit {rc}): {last}")
    return run_dir


def _setup_bytes(run_dir: Path) -> int:
    """Node 0's setup traffic (dcd, ecd and choco send x_1 once in full precision)."""
    recs = rundir.read_metrics(rundir.metrics_path(run_dir, 0))
    return next((int(r["setup_bytes_sent"]) for r in recs if r["kind"] == "train"), 0)


def plot(results: dict, bw_label: str, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, r in results.items():
        acc = [p["test_acc"] for p in r["points"]]
        axes[0].plot([p["bytes"] / 2**20 for p in r["points"]], acc, marker=".", label=name)
        axes[1].plot([p["time_s"][0] for p in r["points"]], acc, marker=".", label=name)
    axes[0].set(xscale="log", xlabel="MB sent per node (2^20 bytes)", ylabel="test accuracy (averaged model)",
                title="accuracy against bytes sent")
    axes[1].set(xscale="log", xlabel=f"simulated wall-clock time at {bw_label} (s)", ylabel="test accuracy",
                title=f"accuracy against simulated time, {bw_label}")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run gossip_compare``."""
    _cli.add_methods(p, METHODS)
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--data", default="mnist1d")
    p.add_argument("--bandwidth", default="10mbit", help="link rates; the first one is plotted (default 10mbit)")
    p.add_argument("--latency", default="0", help="one-way latency (default 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="directory for the run directories and the results")
    p.add_argument("--results", default=None,
                   help="also write compare.json here (experiments/results/gossip_compare.json: docs/decentralized.md's table)")


def main(argv: list[str] | None = None) -> int:
    p, a = _cli.parse(argv, options, __doc__, "gossip_compare")
    names = _cli.methods(p, a.methods, METHODS)
    if a.nodes < 2 or a.epochs < 1:
        p.error(f"need --nodes >= 2 and --epochs >= 1, got --nodes {a.nodes} --epochs {a.epochs}")
    prov = _provenance.start(_provenance.training_sources(  # training runs, the race's time model and curves
        "gossip/tools/crossover.py", "experiments/gossip_compare.py", "experiments/race.py", "experiments/_cli.py"),
                             argv=None if argv is None else ["experiments/gossip_compare.py", *argv])
    try:
        bw_labels = [b.strip() for b in a.bandwidth.split(",") if b.strip()]
        bandwidths = [crossover.parse_rate(b) for b in bw_labels]
        latency = crossover.parse_time(a.latency)
    except crossover.CrossoverError as e:
        p.error(str(e))
    if not bandwidths:
        p.error("--bandwidth is empty; e.g. --bandwidth 10mbit")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    common = ["--data", a.data, "--epochs", str(a.epochs), "--seed", str(a.seed)]
    results = {}
    load = [os.getloadavg()[0]]  # compute times are measured on this machine: say how busy it was
    for name in names:
        print(f"gossip_compare: {name} ...", flush=True)
        run_dir = run_method(name, out, a.nodes, common)
        c = race.curve(run_dir)
        c["setup_bytes"] = _setup_bytes(run_dir)
        for pt in c["points"]:  # the starting exchange of dcd, ecd and choco counts too
            pt["bytes"] += c["setup_bytes"]
            pt["time_s"] = [race.modelled_time(pt, c["calls_per_step"], c["world_size"], b, latency)
                            for b in bandwidths]
        c["topology"] = METHODS[name][METHODS[name].index("--topology") + 1]
        last = c["points"][-1] if c["points"] else None
        c["bytes_per_step"] = (last["bytes"] - c["setup_bytes"]) / last["step"] if last else None
        c["run_dir"] = run_dir.name
        results[name] = c
    load.append(os.getloadavg()[0])
    md = tables.gossip_compare_table(results, bw_labels)
    cmd = "python -m experiments.gossip_compare " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "compare.md").write_text(
        f"{md}\n\nMade with `{cmd}` (simulated time, {a.nodes} nodes, sorted shards, {a.epochs} epochs; "
        f"load average {load[0]:.1f} at the start, {load[1]:.1f} at the end, on {os.cpu_count()} cores).\n")
    record = json.dumps({
        "nodes": a.nodes, "epochs": a.epochs, "data": a.data, "partition": "sorted", "bandwidths": bw_labels,
        "latency_s": latency, "recipe": RECIPE, "methods": {k: METHODS[k] for k in names},
        "results": results, "mode": "simulated-time", "load_average": load, "cpu_count": os.cpu_count(),
        "provenance": prov.finish(),
    }, indent=1) + "\n"
    for path in [out / "compare.json"] + ([Path(a.results)] if a.results else []):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(record)
    drew = plot(results, bw_labels[0], out / "compare.png")
    print(md)
    print(f"gossip_compare: wrote {out / 'compare.md'}, {out / 'compare.json'}" + (f", {out / 'compare.png'}" if drew else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
