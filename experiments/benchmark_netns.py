#!/usr/bin/env python3
"""The benchmark's methods measured on shaped links: torchrun ranks in network namespaces.

    sudo python -m experiments run benchmark_netns --results experiments/results/benchmark.json \\
        --out runs/bench-netns --bandwidth 10mbit,100mbit \\
        --netns-results experiments/results/benchmark_netns.json
    python -m experiments.benchmark report --results experiments/results/benchmark.json \\
        --netns experiments/results/benchmark_netns.json --md docs/benchmark.md

The benchmark (``experiments/benchmark.py``) models every method's time to target per
link from simulated runs. This measures it, as the race's netns mode does
(``experiments/race.py``): each method runs as ``--nodes`` torchrun ranks, one per
network namespace of ``experiments/vcluster.py``'s virtual cluster, each host's link
shaped with tc to the bandwidth; one cluster per bandwidth, the methods one after the
other. A method runs exactly as its benchmark trial of ``--seed`` did (the same
``gossip.train`` arguments, so its tuned learning rate and the workload's data and
recipe), less ``--simulate``. It is stopped at the first evaluation that reaches the
workload's target (``--to-end``: every epoch).

For each run it records the measured wall time to target (after start-up), the time
the race's model gives for the same run (its own bytes and measured compute and codec
time), and the benchmark's modelled time of the simulated trial at the same link with
no added latency; ``benchmark.py report --netns FILE`` adds the table to the report.
Needs root (network namespaces and tc), as the race's netns mode does. No latency is
shaped: the cluster shapes the rate only. Run it on a quiet machine: the times are
wall-clock, and the ranks share its cores.

A method whose simulated trial did not reach the target at a link (that bandwidth, no
latency) is not measured there: stopped at the target, it would run to its last epoch
and give no time to target (``--also-unreached`` measures it anyway). The report lists
those it skipped. Interrupted (Ctrl-C, SIGTERM), it tears the cluster down and writes
the results file with the runs that finished, which ``--resume`` then keeps.

In parts: ``--resume FILE`` takes the runs of an earlier results file of this script
(the same workload, nodes, seed and stopping rule) and keeps those this run does not
measure again, so the methods can be measured a few at a time, each part in a quiet
window; the file then names every session it holds, and each run its own date and load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent

from experiments import benchmark
from experiments import race
from experiments import vcluster
from experiments import _provenance  # noqa: E402
from experiments import tables
from gossip.tools import crossover  # noqa: E402
from experiments import _cli

#: the code these figures measure: training runs, the race's netns runner, the cluster
SOURCES = _provenance.training_sources("gossip/tools/crossover.py", "experiments/race.py", "experiments/vcluster.py",
                                       "experiments/benchmark_netns.py", "experiments/bench_data.py")


class NetnsError(ValueError):
    """A bad argument or results file: one line."""


def rank_args(args: list[str]) -> list[str]:
    """A trial's ``gossip.train`` arguments as each torchrun rank takes them: without
    ``--simulate N`` (the ranks are the nodes) and without where it wrote (``--out``),
    or the flags the runner sets itself (``--log-every``, ``--no-progress``, ``--overwrite``)."""
    out, skip = [], 0
    for a in args:
        if skip:
            skip -= 1
            continue
        if a in ("--simulate", "--out", "--log-every"):
            skip = 1
            continue
        if a in ("--no-progress", "--overwrite"):
            continue
        out.append(a)
    return out


def plan_runs(results: dict, workload: str, nodes: int, seed: int, methods: list[str] | None) -> list[dict]:
    """The runs to make: per method (in the spec's order), its final trial of ``seed`` at
    ``nodes`` nodes, the rank arguments and the learning rate."""
    wls = results.get("workloads") or {}
    if workload not in wls:
        raise NetnsError(f"--workload {workload}: not in the results file (it has {', '.join(wls) or 'none'})")
    per_n = wls[workload]["nodes"]
    if str(nodes) not in per_n:
        raise NetnsError(f"--nodes {nodes}: the results file has no {workload} trials at {nodes} nodes "
                         f"(it has {', '.join(per_n) or 'none'})")
    selected = per_n[str(nodes)]["methods"]
    seeds = results["protocol"]["seeds"]
    if seed not in seeds:
        raise NetnsError(f"--seed {seed}: not one of the protocol's final seeds {seeds}")
    order = [m for m in (results.get("spec") or {}).get("methods", {}) if m in selected] or list(selected)
    names = order if methods is None else methods
    unknown = [m for m in names if m not in selected]
    if unknown:
        raise NetnsError(f"--methods: no finished tuning of {', '.join(unknown)} at {nodes} nodes on {workload}; "
                         f"accepted: {', '.join(order)}")
    by_key = {t["key"]: t for t in results.get("trials", [])}
    runs = []
    for name in names:
        r = selected[name]
        sd = (r.get("seeds") or {}).get(str(seed))
        trial = by_key.get(sd["trial"]) if sd else None
        if trial is None or trial.get("status") != "ok":
            if methods is not None:
                raise NetnsError(f"--methods {name}: its final run of seed {seed} at {nodes} nodes has not finished")
            continue  # not run yet: the report says which methods the table covers
        runs.append({"method": name, "lr": r["lr"], "trial": trial["key"], "args": rank_args(trial["args"]),
                     "wire": r.get("wire"), "simulated": sd["links"]})
    if not runs:
        raise NetnsError(f"no method has a finished final run of seed {seed} at {nodes} nodes on {workload}")
    return runs


def _run_name(method: str, bw: str) -> str:
    return f"{method.replace(':', '-')}@{bw}"


def record(run: dict, measured: dict, bw: str) -> dict:
    """What the results keep of one measured run, next to the simulated trial's model."""
    sim = run["simulated"].get(f"{bw}@0") or {}
    t = measured["to_target"]
    return {**measured, "lr": run["lr"], "trial": run["trial"], "args": run["args"],
            "simulated_time_s": sim.get("time_s"), "simulated_bytes": sim.get("bytes"),
            "simulated_error": (sim["time_s"] / t["time_s"] - 1.0)
            if sim.get("time_s") is not None and t["time_s"] else None}


def resumed(path: Path, res: dict) -> tuple[dict, list[dict]]:
    """The runs of an earlier results file of this script, and its sessions (its own
    provenance last), checked against this run's ``res``: the same workload, nodes,
    seed and stopping rule. Raises NetnsError (one line) otherwise."""
    try:
        old, prov = _provenance.read(path)
    except (OSError, ValueError) as e:
        raise NetnsError(f"--resume {path}: {e}") from None
    if not isinstance(old, dict) or not isinstance(old.get("runs"), dict):
        raise NetnsError(f"--resume {path}: not a results file of experiments/benchmark_netns.py")
    for key in ("workload", "nodes", "seed", "stop_at_target"):
        if old.get(key) != res[key]:
            raise NetnsError(f"--resume {path}: its {key} is {old.get(key)!r}, this run's {res[key]!r} "
                             "(only runs of the same workload, nodes, seed and stopping rule combine)")
    return old, [*old.get("sessions", []), prov]


def _merge(res: dict, earlier: dict, selected: list[str]) -> None:
    """Add what an ``earlier`` results file holds and this run did not measure to
    ``res`` (a method and bandwidth measured, or skipped as unreached, now replaces the
    earlier record), in the benchmark's method order; the bandwidths are the earlier
    ones, then this run's new ones."""
    now = {(m, bw) for m, per in res["runs"].items() for bw in per}
    now |= {(m, bw) for m, bws in res["unreached"].items() for bw in bws}
    for name, per in earlier["runs"].items():
        mine = res["runs"].setdefault(name, {})
        for bw, rec in per.items():
            if (name, bw) not in now:
                mine[bw] = rec
    for name, bws in (earlier.get("unreached") or {}).items():
        keep = [bw for bw in bws if (name, bw) not in now]
        if keep:
            res["unreached"][name] = [*res["unreached"].get(name, []), *keep]
    bws = list(dict.fromkeys([*(bw for per in earlier["runs"].values() for bw in per),
                              *(bw for b in (earlier.get("unreached") or {}).values() for bw in b)]))
    res["bandwidths"] = [*bws, *(bw for bw in res["bandwidths"] if bw not in bws)]
    order = {m: i for i, m in enumerate(selected)}
    res["runs"] = dict(sorted(res["runs"].items(), key=lambda kv: order.get(kv[0], len(order))))


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run benchmark_netns``."""
    p.add_argument("--results", required=True, type=Path, help="the benchmark's results file")
    p.add_argument("--out", required=True, type=Path, help="directory of the run directories and the results")
    p.add_argument("--workload", default="mnist1d")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--seed", type=int, default=0, help="whose final trial each method repeats (default 0)")
    p.add_argument("--methods", default=None, help="comma-separated (default: every method with that trial)")
    p.add_argument("--bandwidth", default="10mbit,100mbit", help="link rates (default 10mbit,100mbit)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds allowed per run (default 1200)")
    p.add_argument("--to-end", action="store_true", help="run every epoch instead of stopping at the target")
    p.add_argument("--prefix", default="bnet", help="name prefix of the namespaces (default bnet)")
    p.add_argument("--netns-results", type=Path, default=None,
                   help="also write the results (with provenance) here once every run is done")
    p.add_argument("--also-unreached", action="store_true",
                   help="also measure a method at a link where its simulated trial did not reach the target")
    p.add_argument("--resume", type=Path, default=None, metavar="FILE",
                   help="keep the runs of this earlier results file that this run does not measure again")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p, a = _cli.parse(argv, options, __doc__, "benchmark_netns")
    try:
        bw_labels = [b.strip() for b in a.bandwidth.split(",") if b.strip()]
        if not bw_labels:
            raise NetnsError("--bandwidth: give at least one rate, e.g. 10mbit,100mbit")
        rates = []
        for b in bw_labels:
            try:
                rates.append(crossover.parse_rate(b))
            except crossover.CrossoverError as e:
                raise NetnsError(f"--bandwidth {b}: {e}") from None
        try:
            results, bprov = benchmark.read_benchmark_results(a.results)
        except benchmark.SpecError as e:
            raise NetnsError(str(e)) from None
        methods = [m.strip() for m in a.methods.split(",") if m.strip()] if a.methods else None
        runs = plan_runs(results, a.workload, a.nodes, a.seed, methods)
        earlier, sessions = resumed(a.resume, {"workload": a.workload, "nodes": a.nodes, "seed": a.seed,
                                               "stop_at_target": not a.to_end}) if a.resume else ({}, [])
    except NetnsError as e:
        print(f"benchmark_netns: error: {e}", file=sys.stderr)
        return 2
    try:
        vcluster.check_rights()
    except vcluster.VClusterError as e:
        print(f"benchmark_netns: error: {e}", file=sys.stderr)
        return 2
    wl = results["workloads"][a.workload]
    selected = results["workloads"][a.workload]["nodes"][str(a.nodes)]["methods"]
    record_ = _provenance.start(SOURCES, argv=["experiments/benchmark_netns.py", *argv])
    res = {"workload": a.workload, "nodes": a.nodes, "seed": a.seed, "target": wl["target"], "metric": wl["metric"],
           "bandwidths": bw_labels, "stop_at_target": not a.to_end,
           "benchmark": {"results": a.results.name, "commit": bprov.get("commit")},
           "not_run": [m for m in selected if m not in {r["method"] for r in runs}],
           "runs": {r["method"]: {} for r in runs}, "sessions": sessions, "unreached": {}}
    a.out.mkdir(parents=True, exist_ok=True)
    interrupted = None
    try:
        _measure(a, res, runs, bw_labels, rates, wl)
    except vcluster.VClusterError as e:
        print(f"benchmark_netns: error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, vcluster.Terminated) as e:
        interrupted = "SIGINT" if isinstance(e, KeyboardInterrupt) else str(e).rsplit(" ", 1)[-1]
        res["interrupted"] = interrupted
    if a.resume:
        _merge(res, earlier, list(selected))
    res["runs"] = {m: per for m, per in res["runs"].items() if per}
    for per in res["runs"].values():  # every run the file holds (race.run_netns_args records those measured now)
        for rec in per.values():
            if rec.get("args") is not None:
                _provenance.record_config(rec["args"], ranks=a.nodes)
    res["not_run"] = [m for m in selected if m not in res["runs"] and m not in res["unreached"]]
    _provenance.write(a.out / "benchmark_netns.json", res, record_)
    if a.netns_results is not None:
        a.netns_results.parent.mkdir(parents=True, exist_ok=True)
        tmp = a.netns_results.with_name(a.netns_results.name + ".tmp")
        tmp.write_bytes((a.out / "benchmark_netns.json").read_bytes())
        os.replace(tmp, a.netns_results)
    if interrupted:
        done = sum(len(per) for per in res["runs"].values())
        print(f"benchmark_netns: interrupted ({interrupted}); the {done} finished run(s) are in "
              f"{a.netns_results or a.out / 'benchmark_netns.json'} (--resume it to go on)", file=sys.stderr)
        return 130 if interrupted == "SIGINT" else 143
    text = tables.benchmark_netns_section(*_provenance.read(a.out / "benchmark_netns.json"))
    (a.out / "benchmark_netns.md").write_text(text + "\n")
    print(text)
    return 0


def _measure(a: argparse.Namespace, res: dict, runs: list[dict], bw_labels: list[str], rates: list[float],
             wl: dict) -> None:
    """Every run of ``runs`` at every bandwidth, one cluster per bandwidth, into ``res``."""
    for bw, bps in zip(bw_labels, rates):
        todo = [r for r in runs if a.also_unreached or a.to_end or _reached(r, bw)]
        for r in runs:
            if r not in todo:
                res["unreached"].setdefault(r["method"], []).append(bw)
                print(f"benchmark_netns: {r['method']} @ {bw}: not measured (its simulated trial did not reach "
                      "the target at this link)", flush=True)
        if not todo:
            continue
        with vcluster.VirtualCluster(a.nodes, rate=vcluster.parse_rate(bw), prefix=a.prefix) as vc:
            print(f"benchmark_netns: {vc.describe()}", flush=True)
            for run in todo:
                label = f"{run['method']} @ {bw}"
                print(f"benchmark_netns: {label} (lr {run['lr']:g}) ...", flush=True)
                measured = race.run_netns_args(vc, run["args"], a.out / _run_name(run["method"], bw), bps,
                                               wl["target"], a.to_end, a.timeout, label=label, run_id="bnet",
                                               pythonpath=(HERE,))
                rec = record(run, measured, bw)
                rec["wire"] = rec.get("wire") or run.get("wire")
                res["runs"][run["method"]][bw] = rec
                t = rec["to_target"]
                print(f"benchmark_netns: {label}: " + ("target not reached" if t["time_s"] is None else
                      f"target at epoch {t['epoch']:.0f} after {t['time_s']:.1f} s measured, "
                      f"{t['model_s']:.1f} s modelled from this run, simulated trial "
                      + ("-" if rec["simulated_time_s"] is None else f"{rec['simulated_time_s']:.1f} s")),
                      flush=True)
                # after every run, what has been measured so far (the results file with its
                # provenance is written once all have run, or when interrupted)
                (a.out / "benchmark_netns.partial.json").write_text(json.dumps(res, indent=1) + "\n")


def _reached(run: dict, bw: str) -> bool:
    """Whether the run's simulated trial reached the target at ``bw`` with no latency."""
    return (run["simulated"].get(f"{bw}@0") or {}).get("time_s") is not None


if __name__ == "__main__":
    sys.exit(main())
