#!/usr/bin/env python3
"""The race: bytes and time (modelled, or measured on shaped links) to a target test accuracy, per method.

    python -m experiments run race --out runs/race                       # MNIST-1D CNN, 4 nodes
    python -m experiments run race --nodes 16 --bandwidth 10mbit,100mbit --latency 5ms --out runs/race16
    python -m experiments run race --methods allreduce,localsgd --epochs 1 --data synthetic --out runs/race-smoke
    sudo python -m experiments run race --mode netns --bandwidth 100mbit,10mbit --out runs/race-netns

Two modes: ``--mode simulated`` (the default) models the time, ``--mode netns``
measures it on real shaped links (below).

Simulated-time mode. Every method trains the same model on the
same data with the same recipe, all ``--nodes`` nodes simulated in one process
(``gossip.train --simulate N``), one run directory per method under ``--out``. From
each run's per-node metrics it reads, at every evaluation (each epoch's end): the test
accuracy, the bytes the node has sent, and the compute and compression time it has
spent on this machine; from the run's last checkpoint, the communication calls per
step by kind. The wall-clock time at a bandwidth B and one-way latency L is then
modelled as ``gossip.tools.crossover`` does for one step, summed over the steps so far:

    T = compute + codec + overhead * 8 * bytes / B + L * (message rounds)

(a ring all-reduce is 2(n - 1) rounds, an all-gather n - 1, each leg of a sharded
exchange n - 1, a neighbour exchange 1); compute is the forward and backward passes
and the local optimizer's step (runs made before the step was charged to compute
leave it out: MuLoCo's Muon step, 90 % of its computation on the 1-D CNN, was not in
its modelled time).
Compute, compression and communication are not overlapped; each node has its own
link of rate B.

Real mode (``--mode netns``, needs root). Each method runs as ``--nodes`` torchrun
ranks, one per network namespace of ``experiments/vcluster.py``'s virtual cluster, each
host's link shaped with tc (tbf/htb) to the bandwidth in both directions; one cluster
per bandwidth, the methods one after the other. From rank 0's metrics it reads, at every
evaluation, the wall-clock time since the training started (after start-up and data
loading), the bytes the rank sent and the compute and codec time it spent; the time to
target is the time of the first evaluation at or above ``--target``. By default a run is
stopped there (time to target is the headline); ``--to-end`` runs every method to its
last epoch. Next to each measured time it prints and records the simulated mode's model
of the same run: the formula above fed with that run's own bytes and measured compute
and codec time, and the model's error. No latency is shaped (this mode takes
``--latency 0`` only). The load average is recorded at the start and end of every run.

Output in ``--out``: ``race.json`` (every method's curve and figures, each evaluation's
modelled time per bandwidth in ``time_s``, the load average at the start and end, the
provenance record of ``experiments/_provenance.py``; with ``--results PATH`` also
written to PATH once the race is done, e.g. ``experiments/results/race_modelled.json``,
which ``make results-tables`` renders into docs/race.md), ``race.md``
(method, bytes to target, time to target at each bandwidth, final accuracy) and, with
matplotlib, ``race.png`` (test accuracy against modelled time, one panel per
bandwidth). The run directories are ordinary ones: ``gossip.tools.analysis.load_runs(out)``
reads them. In netns mode they are ``<method>@<bandwidth>`` (``:`` written ``-``), the
torchrun agents' outputs go to ``cluster/`` under ``--out``, ``race.json`` holds each
run's curve (measured and modelled time per evaluation) under
``results[method]["runs"][bandwidth]`` and is rewritten after every run, ``race.md`` has
one row per run, and ``race.png`` shows accuracy against measured time (solid) and
against the modelled time of the same run (dashed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from experiments import _cli, _provenance  # noqa: E402
from experiments import tables
from experiments.training import train_in_process  # the one in-process run helper of the experiments
from gossip import checkpoint, rundir  # noqa: E402
from gossip.tools import crossover  # noqa: E402
from gossip.train.evaluation import PRIMARY  # noqa: E402



def _metric(rec: dict) -> str:
    """The task's figure in an eval record (the data set declared the task; its records say which)."""
    return PRIMARY["lm"][0] if PRIMARY["lm"][0] in rec else PRIMARY["classification"][0]


def _reached(p: dict, target: float) -> bool:
    higher = p["metric"] == PRIMARY["classification"][0]
    return p["score"] >= target if higher else p["score"] <= target


def _point(r: dict) -> dict:
    """An evaluation's figure: its name, value, and the accuracy under its old key."""
    m = _metric(r)
    return {"metric": m, "score": r[m], m: r[m]}

#: the code a race's figures measure (for `python -m experiments.render --stale`): training
#: runs (experiments/_provenance.py's training_sources, run by experiments/training.py), the
#: time model, the netns cluster
SOURCES = _provenance.training_sources("gossip/tools/crossover.py", "experiments/race.py", "experiments/training.py",
                                       "experiments/_cli.py", "experiments/vcluster.py")

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
    "choco-top1": ["--algo", "choco", "--compressor", "topk:p=0.01"],
    "sgp": ["--algo", "sgp", "--topology", "onepeer-exp"],
}
#: the shared recipe (SGD methods; diloco's inner AdamW takes its own lr below): with 30
#: epochs it brings allreduce on 4 nodes to 94.9 % (seed 0); the demo's constant 0.05 for
#: 20 epochs ends at 93.2 % and cosine from 0.05 over 40 epochs at 91.9 % (it overfits)
RECIPE = ["--lr", "0.1", "--lr-schedule", "step", "--weight-decay", "1e-3", "--batch-size", "32"]
#: flags a method needs on top of the recipe (later flags win in gossip.train)
METHOD_RECIPE = {"diloco": ["--lr", "0.003"], "diloco:4": ["--lr", "0.003"]}


def _finish(a: argparse.Namespace) -> dict | None:
    """The run's provenance record (None where a caller built ``a`` without one)."""
    prov = getattr(a, "provenance", None)
    return prov.finish() if prov is not None else None


def _lr(a: argparse.Namespace) -> list[str]:
    """The flags that override the recipe's learning rate (after RECIPE, before METHOD_RECIPE)."""
    return [] if a.lr is None else ["--lr", repr(a.lr)]


def run_method(name: str, out: Path, nodes: int, common: list[str]) -> Path:
    run_dir = out / name.replace(":", "-")
    args = ["--simulate", str(nodes), *RECIPE, *common, *METHODS[name], *METHOD_RECIPE.get(name, []),
            "--log-every", "1", "--no-progress", "--overwrite", "--out", str(run_dir)]
    _provenance.record_config(args)  # what `python -m experiments verify` witnesses
    rc, err = train_in_process(args)
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
        points.append({"step": r["step"], "epoch": r["epoch"], **_point(r),
                       "bytes": t["bytes_sent"], "compute_s": t["compute_s"], "codec_s": t["compress_s"]})
    summary = rundir.read_json(rundir.summary_path(run_dir))
    last = checkpoint.latest_checkpoint(run_dir, num_ranks=1)
    ledger = checkpoint.load_checkpoint(last)["ledger"]
    steps = max(1, summary["steps"])
    calls = {op: v[0] / steps for op, v in ledger["ops"].items() if op != "control" and v[0]}
    metric = points[-1]["metric"] if points else "test_acc"
    return {"points": points, "calls_per_step": calls, "final_test_acc": summary["final_test_acc"],
            "metric": metric, "final_score": summary.get("final_" + metric),
            "steps": summary["steps"], "wire": summary["wire"], "world_size": summary["world_size"]}


def modelled_time(point: dict, calls: dict, n: int, bandwidth: float, latency: float,
                  overhead: float = crossover.LINK_OVERHEAD) -> float:
    rounds = point["step"] * sum(k * crossover.rounds_of(op, n) for op, k in calls.items())
    return point["compute_s"] + point["codec_s"] + overhead * 8.0 * point["bytes"] / bandwidth + latency * rounds


def to_target(c: dict, target: float, bandwidths: list[float], latency: float) -> dict:
    """Bytes and modelled time at the first evaluation reaching ``target`` (None: never)."""
    n = c["world_size"]
    for p in c["points"]:
        if _reached(p, target):
            return {"step": p["step"], "epoch": p["epoch"], "bytes": p["bytes"],
                    "time_s": [modelled_time(p, c["calls_per_step"], n, b, latency) for b in bandwidths]}
    return {"step": None, "epoch": None, "bytes": None, "time_s": [None for _ in bandwidths]}


#: line colours: matplotlib's ten, then two more, so that up to twelve methods differ
COLORS = [f"C{i}" for i in range(10)] + ["black", "gold"]


def line_style(i: int) -> dict:
    """Colour and marker of the i-th method's curve (markers differ after 12 methods)."""
    return {"color": COLORS[i % len(COLORS)], "marker": "." if i < len(COLORS) else "x"}


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
        for i, (name, r) in enumerate(results.items()):
            n = r["world_size"]
            xs = [modelled_time(p, r["calls_per_step"], n, b, latency) for p in r["points"]]
            ax.plot(xs, [p["score"] for p in r["points"]], label=name, **line_style(i))
        if target is not None:
            ax.axhline(target, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_xlabel("modelled wall-clock time (s)")
        ax.set_ylabel(tables.METRIC_WORDS[next((r["metric"] for r in results.values()), "test_acc")])
        ax.set_title(f"{label}, latency {latency * 1e3:g} ms")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True

# ---------------------------------------------------------------------------- netns mode
class _Reached(Exception):
    """Raised from the cluster's monitor to stop a run once rank 0 has reached the target."""


def _run_name(name: str, bw_label: str) -> str:
    return f"{name.replace(':', '-')}@{bw_label}"


def measured_curve(run_dir: Path, bandwidth: float) -> dict:
    """A real run's curve from rank 0's records: per evaluation the measured wall-clock
    time since training began (``time_s``), the bytes rank 0 sent, its compute and codec
    seconds, and the modelled time of the same point (``model_s``: the simulated mode's
    formula at ``bandwidth``, latency 0, fed with this run's own bytes and times)."""
    recs = rundir.read_metrics(rundir.metrics_path(run_dir, 0))
    train = {r["step"]: r for r in recs if r["kind"] == "train"}
    points = []
    for r in recs:
        if r["kind"] != "eval" or r["step"] not in train:
            continue
        t = train[r["step"]]
        pt = {"step": r["step"], "epoch": r["epoch"], **_point(r), "time_s": r["time"],
              "train_time_s": t["time"], "bytes": t["bytes_sent"], "compute_s": t["compute_s"],
              "codec_s": t["compress_s"], "comm_s": t["comm_s"], "warmup_s": t.get("warmup_s", 0.0)}
        pt["model_s"] = modelled_time(pt, {}, 1, bandwidth, 0.0)
        points.append(pt)
    return {"points": points}


def measured_to_target(points: list[dict], target: float) -> dict:
    for p in points:
        if _reached(p, target):
            return {"step": p["step"], "epoch": p["epoch"], "bytes": p["bytes"], "time_s": p["time_s"],
                    "model_s": p["model_s"], "model_error": p["model_s"] / p["time_s"] - 1.0,
                    # the model leaves the first step out (compilation, first calls, ranks' start-up skew)
                    "model_error_after_first_step": p["model_s"] / max(1e-9, p["time_s"] - p["warmup_s"]) - 1.0,
                    "compute_s": p["compute_s"] + p["codec_s"], "comm_s": p["comm_s"], "warmup_s": p["warmup_s"],
                    "link_model_s": p["model_s"] - p["compute_s"] - p["codec_s"]}
    return {"step": None, "epoch": None, "bytes": None, "time_s": None, "model_s": None, "model_error": None,
            "model_error_after_first_step": None, "compute_s": None, "comm_s": None, "warmup_s": None,
            "link_model_s": None}


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def run_netns_method(vc, name: str, bw_label: str, bandwidth: float, out: Path, common: list[str],
                     target: float, to_end: bool, timeout: float) -> dict:
    """One method as torchrun ranks on the (already shaped) cluster ``vc``; its record."""
    args = [*RECIPE, *common, *METHODS[name], *METHOD_RECIPE.get(name, [])]
    return run_netns_args(vc, args, out / _run_name(name, bw_label), bandwidth, target, to_end, timeout,
                          label=f"{name} @ {bw_label}", run_id="race")


def run_netns_args(vc, args: list[str], run_dir: Path, bandwidth: float, target: float, to_end: bool,
                   timeout: float, *, label: str, run_id: str, pythonpath: tuple[Path, ...] = ()) -> dict:
    """``gossip.train args`` as torchrun ranks on the (already shaped) cluster ``vc``,
    writing ``run_dir``, stopped at the first evaluation that reaches ``target`` unless
    ``to_end``; its record (:func:`netns_record`). ``pythonpath``: folders the ranks
    import from besides the repository (a data factory's module)."""
    cmd = ["-m", "gossip.train", *args, "--log-every", "1", "--no-progress", "--overwrite", "--out", str(run_dir)]
    _provenance.record_config(args, ranks=len(vc.hosts))  # witnessed as its simulation
    metrics = rundir.metrics_path(run_dir, 0)
    # an earlier run's files in run_dir would be read as this run's: its evaluations by the
    # monitor (which would stop this run at once, "at the target"), its curve by the record
    # of a run that failed before writing its own; the run replaces them (--overwrite) anyway
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    checked = [0.0]

    def monitor() -> None:  # about every 50 ms: read rank 0's evaluations once a second
        now = time.monotonic()
        if to_end or now - checked[0] < 1.0:
            return
        checked[0] = now
        if metrics.is_file() and any(r["kind"] == "eval" and _reached(_point(r), target)
                                     for r in rundir.read_metrics(metrics)):
            raise _Reached

    paths = [str(REPO), *(str(p) for p in pythonpath), os.environ.get("PYTHONPATH", "")]
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load = [_load()]
    t0 = time.perf_counter()
    stopped = ok = False
    out = run_dir.parent
    try:
        res = vc.run_torchrun(cmd, 1, env=env, timeout=timeout, outdir=out / "cluster" / run_dir.name,
                              cwd=str(REPO), run_id=f"{run_id}-{run_dir.name.replace('@', '-').replace('.', '-')}",
                              monitor=monitor)
        ok = res.ok
        if not ok:
            bad = res.failed[0]
            print(f"race: {label} failed (host {bad.rank}, exit {bad.returncode}"
                  f"{', timed out' if bad.timed_out else ''}): {res.tail(bad.rank, 1)}", file=sys.stderr, flush=True)
    except _Reached:  # the cluster stopped every rank on its way out
        stopped = ok = True
    wall = time.perf_counter() - t0
    _wait_for_namespaces(vc)
    load.append(_load())
    return netns_record(run_dir, bandwidth, target, ok=ok, stopped=stopped, date=started, load=load, wall=wall)


def _wait_for_namespaces(vc, grace: float = 20.0) -> None:
    """After a stopped run: wait until the workers torchrun started (in their own
    sessions) have left the hosts' namespaces, so the next run has the cores; kill the
    ones still there after ``grace`` seconds."""
    import signal
    import subprocess

    def pids() -> list[int]:
        found = []
        for h in vc.hosts:
            p = subprocess.run(["ip", "netns", "pids", h.netns], capture_output=True, text=True)
            found += [int(x) for x in p.stdout.split()]
        return found

    deadline = time.monotonic() + grace
    while (left := pids()) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in pids():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def netns_record(run_dir: Path, bandwidth: float, target: float, *, ok: bool, stopped: bool, date: str,
                 load: list[float], wall: float) -> dict:
    """What race.json keeps of one real run (its curve read from ``run_dir``).

    ``run_dir`` is kept as the run's folder name under ``--out``, so that a results file names no
    folder of the machine that ran it."""
    metrics = rundir.metrics_path(run_dir, 0)
    pts = measured_curve(run_dir, bandwidth)["points"] if metrics.is_file() else []
    summary = rundir.read_json(rundir.summary_path(run_dir)) if rundir.summary_path(run_dir).is_file() else None
    wire = rundir.wire_of(rundir.read_json(rundir.config_path(run_dir)), summary) \
        if rundir.config_path(run_dir).is_file() else {"label": "?"}
    return {
        "run_dir": run_dir.name, "ok": ok, "stopped_at_target": stopped, "date": date, "load_average": load,
        "launch_wall_s": wall, "points": pts, "to_target": measured_to_target(pts, target),
        "last_test_acc": pts[-1].get("test_acc") if pts else None, "last_epoch": pts[-1]["epoch"] if pts else None,
        "final_test_acc": summary["final_test_acc"] if summary else None, "wire": wire,
        "metric": pts[-1]["metric"] if pts else None, "last_score": pts[-1]["score"] if pts else None,
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.0%}"


def netns_plot(results: dict, bw_labels: list[str], path: Path, target: float | None = None) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(bw_labels), figsize=(6 * len(bw_labels), 4), squeeze=False)
    for ax, bw in zip(axes[0], bw_labels):
        for i, (name, r) in enumerate(results.items()):
            pts = r["runs"].get(bw, {}).get("points") or []
            if not pts:
                continue
            style = line_style(i)
            acc = [p["score"] for p in pts]
            ax.plot([p["time_s"] for p in pts], acc, label=name, **style)
            ax.plot([p["model_s"] for p in pts], acc, ls="--", lw=0.8, color=style["color"])
            ax.set_ylabel(tables.METRIC_WORDS[pts[-1]["metric"]])
        if target is not None:
            ax.axhline(target, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_xlabel("wall-clock time (s): measured (solid), modelled (dashed)")
        ax.set_title(f"{bw} per link (tc), torchrun ranks in network namespaces")
        ax.grid(alpha=0.3)
    for ax in axes[0]:  # the legend on the first panel with runs
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
            break
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_netns(out: Path, results: dict, a: argparse.Namespace, bw_labels: list[str], cmd: str,
                names: list[str]) -> tuple[str, bool]:
    """race.json, race.md and race.png of the netns mode (rewritten after every run).
    ``a``: the race's arguments (target, nodes, epochs, data, to_end)."""
    md = tables.race_netns_table(results, a.target, bw_labels)
    loads = [x for r in results.values() for run in r["runs"].values() for x in run["load_average"]]
    errs = [run["to_target"]["model_error"] for r in results.values() for run in r["runs"].values()
            if run["to_target"]["model_error"] is not None]
    note = (f"Made with `{cmd}` (measured: {a.nodes} torchrun ranks in network namespaces, tc-shaped links; "
            f"load average {min(loads):.1f} to {max(loads):.1f} over the runs, on {os.cpu_count()} cores)."
            if loads else f"Made with `{cmd}`.")
    errs1 = [run["to_target"]["model_error_after_first_step"] for r in results.values()
             for run in r["runs"].values() if run["to_target"]["model_error"] is not None]
    if errs:
        note += (f" Model error (modelled / measured - 1) at the target: median {sorted(errs)[len(errs) // 2]:+.0%}, "
                 f"range {min(errs):+.0%} to {max(errs):+.0%}; with the first step left out of the measured time: "
                 f"median {sorted(errs1)[len(errs1) // 2]:+.0%}, range {min(errs1):+.0%} to {max(errs1):+.0%}.")
    out.mkdir(parents=True, exist_ok=True)
    (out / "race.md").write_text(f"{md}\n\n{note}\n")
    (out / "race.json").write_text(json.dumps({
        "target": a.target, "nodes": a.nodes, "epochs": a.epochs, "data": a.data, "bandwidths": bw_labels,
        "latency_s": 0.0, "recipe": RECIPE, "methods": {k: METHODS[k] + METHOD_RECIPE.get(k, []) for k in names},
        "results": results, "mode": "netns", "stop_at_target": not a.to_end, "command": cmd,
        "cpu_count": os.cpu_count(), "provenance": _finish(a),
    }, indent=1))
    return md, netns_plot(results, bw_labels, out / "race.png", a.target)


def main_netns(a: argparse.Namespace, names: list[str], bw_labels: list[str], bandwidths: list[float],
               out: Path, cmd: str) -> int:
    from experiments import vcluster
    try:
        vcluster.check_rights()
    except vcluster.VClusterError as e:
        print(f"race: error: --mode netns {e}", file=sys.stderr)
        return 2
    common = ["--data", a.data, "--epochs", str(a.epochs), "--seed", str(a.seed), *_lr(a)]
    if a.model is not None:
        common += ["--model", a.model]
    common += shlex.split(a.train_flags)
    results: dict = {name: {"runs": {}} for name in names}
    for bw, bps in zip(bw_labels, bandwidths):
        try:
            with vcluster.VirtualCluster(a.nodes, rate=vcluster.parse_rate(bw), prefix=a.prefix) as vc:
                print(f"race: {vc.describe()}", flush=True)
                for name in names:
                    print(f"race: {name} @ {bw} ...", flush=True)
                    run = run_netns_method(vc, name, bw, bps, out, common, a.target, a.to_end, a.timeout)
                    results[name]["runs"][bw] = run
                    t = run["to_target"]
                    reached = ("target not reached" if t["time_s"] is None else
                               f"{a.target:.0%} at epoch {t['epoch']:.0f} after {t['time_s']:.1f} s measured, "
                               f"{t['model_s']:.1f} s modelled ({_pct(t['model_error'])}), "
                               f"{tables.fmt_bytes(t['bytes'])}/node")
                    print(f"race: {name} @ {bw}: {reached}; load {run['load_average'][0]:.1f} -> "
                          f"{run['load_average'][1]:.1f}", flush=True)
                    write_netns(out, results, a, bw_labels, cmd, names)
        except vcluster.VClusterError as e:
            print(f"race: error: {e}", file=sys.stderr)
            return 2
    md, drew = write_netns(out, results, a, bw_labels, cmd, names)
    _copy_results(out / "race.json", a.results)
    print(md)
    print(f"race: wrote {out / 'race.md'}, {out / 'race.json'}" + (f", {out / 'race.png'}" if drew else ""))
    return 0


def _copy_results(src: Path, dst: Path | None) -> None:
    """race.json, complete, at ``dst`` too (through a temporary file: an interrupted copy
    leaves the old results)."""
    if dst is None:
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    tmp.write_bytes(src.read_bytes())
    os.replace(tmp, dst)


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run race``."""
    _cli.add_methods(p, METHODS)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--data", default="mnist1d")
    p.add_argument("--model", default=None, help="gossip.train's --model (default: the data set's own)")
    p.add_argument("--train-flags", default="", metavar="FLAGS",
                   help="more gossip.train flags for every method, e.g. '--data-dir my.txt --model-opt layers=2' "
                        "(after the recipe's, so they win)")
    p.add_argument("--target", type=float, default=0.94,
                   help="test accuracy to reach (default 0.94); for a language model (--data text), the held-out "
                        "bits per byte to get down to, e.g. 3.0")
    p.add_argument("--bandwidth", default="10mbit,100mbit", help="link rates (default 10mbit,100mbit)")
    p.add_argument("--latency", default="0", help="one-way latency (default 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate for every method instead of the recipe's 0.1 (DiLoCo keeps its inner 0.003)")
    p.add_argument("--out", required=True, help="directory for the run directories and the results")
    p.add_argument("--mode", choices=("simulated", "netns"), default="simulated",
                   help="simulated: modelled time (default); netns: torchrun ranks on tc-shaped links (needs root)")
    p.add_argument("--to-end", action="store_true",
                   help="netns: run every method to its last epoch (default: stop a run once it reaches --target)")
    p.add_argument("--timeout", type=float, default=3600.0, help="netns: seconds allowed per run (default 3600)")
    p.add_argument("--prefix", default="race", help="netns: name prefix of the namespaces (default race)")
    p.add_argument("--results", type=Path, default=None,
                   help="when the race is done, also write race.json here (experiments/results/race*.json, "
                        "the figures docs/race.md renders)")


def main(argv: list[str] | None = None) -> int:
    p, a = _cli.parse(argv, options, __doc__, "race")
    names = _cli.methods(p, a.methods, METHODS)
    if a.lr is not None and not a.lr > 0:
        p.error(f"--lr must be > 0, got {a.lr:g}")
    try:
        bw_labels = [b.strip() for b in a.bandwidth.split(",")]
        bandwidths = [crossover.parse_rate(b) for b in bw_labels]
        latency = crossover.parse_time(a.latency)
    except crossover.CrossoverError as e:
        p.error(str(e))
    if a.mode == "netns" and latency != 0:
        p.error(f"--latency {a.latency}: the netns mode shapes the rate only (tbf/htb, no netem); give --latency 0")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    a.provenance = _provenance.start(SOURCES, argv=None if argv is None else ["experiments/race.py", *argv])
    cmd = a.provenance.command  # the portable form: no folder of this machine in a results file
    if a.mode == "netns":
        return main_netns(a, names, bw_labels, bandwidths, out, cmd)
    common = ["--data", a.data, "--epochs", str(a.epochs), "--seed", str(a.seed), *_lr(a)]
    if a.model is not None:
        common += ["--model", a.model]
    common += shlex.split(a.train_flags)
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
    md = tables.race_table(results, a.target, bw_labels)
    (out / "race.md").write_text(
        f"{md}\n\nMade with `{cmd}` (simulated time, {a.nodes} nodes; load average {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end, on {os.cpu_count()} cores).\n")
    (out / "race.json").write_text(json.dumps({
        "target": a.target, "nodes": a.nodes, "epochs": a.epochs, "data": a.data, "bandwidths": bw_labels,
        "latency_s": latency, "recipe": RECIPE, "methods": {k: METHODS[k] + METHOD_RECIPE.get(k, []) for k in names},
        "results": results, "mode": "simulated-time", "load_average": load, "cpu_count": os.cpu_count(),
        "lr": a.lr, "provenance": _finish(a),
    }, indent=1))
    _copy_results(out / "race.json", a.results)
    drew = plot(results, bandwidths, bw_labels, latency, out / "race.png", a.target)
    print(md)
    print(f"race: wrote {out / 'race.md'}, {out / 'race.json'}" + (f", {out / 'race.png'}" if drew else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
