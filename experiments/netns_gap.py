#!/usr/bin/env python3
"""Where the measured and the modelled times to target part: the evaluations' share.

    python -m experiments run netns_gap \\
        --netns-results experiments/results/benchmark_netns-mnist1d-n4.json \\
        --runs runs/bnet100 runs/bnet10 --json experiments/results/netns_gap-mnist1d-n4.json

``experiments/benchmark_netns.py`` measures the benchmark's methods as torchrun ranks on
tc-shaped links and finds the race's time model short of the measured times, the more
so the fewer bytes a method sends. This reads the run directories that measurement left
(``--runs``: its ``--out`` folders, one run directory per method and bandwidth) and
splits each measured time to target into the training and the evaluations.

The measured time is rank 0's wall clock at the evaluation that reached the target, so
it holds every evaluation before it and that one. Each evaluation of a torchrun run
averages the model over the ranks (``GossipOptimizer.average``: an all-reduce of the
full-precision parameters) and measures the consensus distance (a second such
all-reduce, and one of a scalar), besides computing the test metrics: traffic on the
shaped link that is none of the algorithm's and that neither the ledger nor the time
model counts. An evaluation's duration here is its record's time less the time of the
last training step before it (both on rank 0's clock). ``wire_s`` prices its two
all-reduces at the link rate (a ring all-reduce sends ``2 (n - 1) / n`` times the
payload from each node); the rest is its compute and the wait for the slowest rank.

Per run it records the measured time, the evaluations' total and median, the time less
the evaluations, and the errors of the same run's model and of the simulated trial's
model against both. Nothing is run: the figures come from the logs alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from experiments import _provenance  # noqa: E402
from experiments import tables
from gossip import rundir  # noqa: E402
from gossip.tools.crossover import LINK_OVERHEAD, CrossoverError, parse_rate  # noqa: E402
from experiments import _cli

#: the code these figures come from: this reader, the metrics reader and the link model
#: (the runs it reads carry their own provenance)
SOURCES = ["experiments/netns_gap.py", "gossip/tools/crossover.py", "gossip/rundir.py"]


class GapError(ValueError):
    """A bad argument, results file or run directory: one line."""


def _rows(run_dir: Path) -> list[dict]:
    try:
        return rundir.read_metrics(rundir.metrics_path(run_dir, 0))
    except (OSError, ValueError) as e:
        raise GapError(f"{run_dir}: cannot read rank 0's metrics ({e})") from None


def evaluations(rows: list[dict], until_step: int) -> list[dict]:
    """Every evaluation up to and including the one at ``until_step``: its step and its
    duration (its record's time less the last training step's before it)."""
    out, last = [], None
    for r in rows:
        if r.get("kind") == "train":
            last = r
        elif r.get("kind") == "eval":
            if last is None:
                raise GapError(f"an evaluation at step {r.get('step')} before any training step")
            out.append({"step": r["step"], "s": float(r["time"]) - float(last["time"])})
            if r["step"] == until_step:
                return out
    raise GapError(f"no evaluation at step {until_step} (the step the target was reached at)")


def allreduce_wire_s(params: int, world: int, rate_bps: float, count: int = 2) -> float:
    """Seconds ``count`` ring all-reduces of ``params`` float32 values take at ``rate_bps``."""
    return count * 2 * (world - 1) / world * 4 * params * 8 / rate_bps


def _rate(bandwidth: str) -> float:
    try:
        return parse_rate(bandwidth)
    except CrossoverError as e:
        raise GapError(str(e)) from None


def _find(run_dir: str, roots: list[Path]) -> Path:
    hits = [r / run_dir for r in roots if (r / run_dir / "metrics-rank0.jsonl").is_file()]
    if not hits:
        raise GapError(f"run directory {run_dir!r} (with metrics-rank0.jsonl) is in none of --runs: "
                       + ", ".join(str(r) for r in roots))
    return hits[0]


def analyse(netns: dict, roots: list[Path]) -> dict:
    """The split of every run of a benchmark_netns results file that reached its target."""
    runs = []
    for method, by_bw in netns["runs"].items():
        for bw, rec in by_bw.items():
            tt = rec.get("to_target") or {}
            if tt.get("time_s") is None:
                continue
            d = _find(rec["run_dir"], roots)
            try:
                cfg = json.loads((d / "config.json").read_text())
            except (OSError, ValueError) as e:
                raise GapError(f"{d / 'config.json'}: cannot read it ({e})") from None
            evs = evaluations(_rows(d), tt["step"])
            total = sum(e["s"] for e in evs)
            t, model, sim = float(tt["time_s"]), float(tt["model_s"]), rec.get("simulated_time_s")
            less = t - total
            rate = _rate(bw)
            # what the simulated trial's model charged besides the link: its compute and codec time
            sim_compute = None if sim is None or rec.get("simulated_bytes") is None else \
                sim - LINK_OVERHEAD * 8.0 * float(rec["simulated_bytes"]) / rate
            runs.append({
                "method": method, "bandwidth": bw, "run_dir": rec["run_dir"], "step": tt["step"],
                "epoch": tt["epoch"], "bytes": tt["bytes"], "measured_s": t,
                "evaluations": len(evs), "eval_s": total, "eval_share": total / t,
                "eval_median_s": statistics.median(e["s"] for e in evs),
                "eval_wire_s": allreduce_wire_s(int(cfg["params"]), int(cfg["world_size"]), rate),
                "compute_s": float(tt["compute_s"]),  # compute and codec, rank 0's
                "simulated_compute_s": sim_compute,
                "measured_less_eval_s": less, "model_s": model,
                "model_error": model / t - 1.0, "model_error_less_eval": model / less - 1.0,
                "simulated_s": sim,
                "simulated_error": None if sim is None else sim / t - 1.0,
                "simulated_error_less_eval": None if sim is None else sim / less - 1.0,
                "params": int(cfg["params"]), "world_size": int(cfg["world_size"]),
            })
    if not runs:
        raise GapError("no run of the results file reached its target: nothing to split")
    runs.sort(key=lambda r: (_rate(r["bandwidth"]), r["measured_less_eval_s"]))
    return {"workload": netns.get("workload"), "nodes": netns.get("nodes"), "seed": netns.get("seed"),
            "target": netns.get("target"), "netns_sessions": netns.get("sessions"), "runs": runs}


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run netns_gap``."""
    p.add_argument("--netns-results", required=True, type=Path,
                   help="a results file of experiments/benchmark_netns.py")
    p.add_argument("--runs", required=True, type=Path, nargs="+",
                   help="the folders its runs wrote (benchmark_netns.py --out), one or more")
    p.add_argument("--json", type=Path, default=None, help="write the results here (with provenance)")


def main(argv: list[str] | None = None) -> int:
    p, a = _cli.parse(argv, options, __doc__, "netns_gap")
    try:
        try:
            netns = json.loads(a.netns_results.read_text())
        except (OSError, ValueError) as e:
            raise GapError(f"--netns-results {a.netns_results}: cannot read it ({e})") from None
        netns = netns.get("results", netns)
        if not isinstance(netns, dict) or not isinstance(netns.get("runs"), dict):
            raise GapError(f"--netns-results {a.netns_results}: not a results file of benchmark_netns.py "
                           "(no 'runs')")
        prov = _provenance.start(SOURCES, argv=None if argv is None else ["experiments/netns_gap.py", *argv])
        res = analyse(netns, a.runs)
    except GapError as e:
        print(f"netns_gap: {e}", file=sys.stderr)
        return 2
    print(tables.netns_gap_table(res))
    if a.json is not None:
        _provenance.write(a.json, res, prov)
        print(f"netns_gap: wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
