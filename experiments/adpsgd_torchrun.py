#!/usr/bin/env python3
"""AD-PSGD against D-PSGD under torchrun with one slow rank: how many steps per second
the fast ranks take when no barrier holds them to the slow one.

    python -m experiments run adpsgd_torchrun --out runs/adpsgd-torchrun
    python -m experiments run adpsgd_torchrun --repeats 1 --steps 40 --out runs/adpsgd-smoke

``--nodes`` ranks (4 by default) on a ring of this machine run ``gossip.train`` on
MNIST-1D, rank 0 slowed ``--factor`` times (``--node-speed slow:nodes=1,factor=F``:
the rank sleeps for the extra compute). D-PSGD waits for its neighbours at every
step, so the slow rank sets everyone's pace; AD-PSGD's active ranks wait only for the
passive neighbour they exchange with, which answers from a background thread, so the
fast ranks keep their own pace.

What is timed: each rank's training clock (the ``time`` of its per-step records) from
the end of step ``--skip`` (start-up and first calls left out) to its last step,
divided by the steps between; no evaluation falls inside (the training set is made
large enough that the run stays inside its first epoch, and the script checks it).
The fast ranks' rate is the mean over the ranks at speed 1. The two algorithms run
in turn, ``--repeats`` times interleaved; the best (highest) rate of each is kept and
the ratio adpsgd / dpsgd is printed with the load average before and after. Every
run must exit 0 (the passive ranks' threads are joined before the process ends).

The target (issue: "the fast ranks of adpsgd complete at least 2x more steps per
second than under dpsgd") is judged only on a quiet machine: ``target`` is "met" or
"not met" when the load average was below 0.3 before the first run, else "not judged
(loaded machine)". The ranks share this machine's cores, so what is measured is the
protocol's waiting, not a cluster's speed.

A timing result: this process imports the modules its ranks run (the training loop,
the algorithms, the pairwise channel), so a change to them stales it.
``--results`` writes the JSON with its provenance (experiments/_provenance.py), which
``python -m experiments render`` turns into the table in docs/heterogeneous.md.
Not a study spec: it times torchrun ranks and reads their clocks, where a study trains
and keeps what each run reached.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from experiments import _cli, _provenance, tables

REPO = Path(__file__).resolve().parents[1]
ALGOS = ("dpsgd", "adpsgd")
TARGET = 2.0


def rank_rates(run_dir: Path, nodes: int, skip: int) -> list[float]:
    """Steps per second of each rank between the end of step ``skip`` and its last step."""
    from gossip import rundir

    rates = []
    for k in range(nodes):
        recs = list(rundir.read_metrics(rundir.metrics_path(run_dir, k)))
        at = {r["step"]: r for r in recs if r["kind"] == "train"}
        last = max(at)
        if skip not in at or last <= skip:
            raise SystemExit(f"adpsgd_torchrun: {run_dir} rank {k} has no records of steps {skip}..{last}")
        if any(r["kind"] == "eval" and skip < r["step"] < last for r in recs):
            raise SystemExit(f"adpsgd_torchrun: {run_dir} evaluated inside the timed steps {skip}..{last}")
        rates.append((last - skip) / (at[last]["time"] - at[skip]["time"]))
    return rates


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run adpsgd_torchrun``."""
    p.add_argument("--nodes", type=int, default=4, help="ranks on a ring (even; default 4)")
    p.add_argument("--factor", type=float, default=4.0, help="how many times slower rank 0 is (default 4)")
    p.add_argument("--steps", type=int, default=150, help="steps per rank (default 150)")
    p.add_argument("--skip", type=int, default=10, help="first steps left out of the timing (default 10)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", required=True)
    p.add_argument("--results", default=None, help="also write the results JSON here (experiments/results/...)")


def main(argv: list[str] | None = None) -> int:
    p, a = _cli.parse(argv, options, __doc__, "adpsgd_torchrun")
    if a.nodes < 2 or a.nodes % 2:
        p.error(f"--nodes must be even and at least 2 (adpsgd needs a bipartite ring), got {a.nodes}")
    if not a.factor >= 1:
        p.error(f"--factor must be a number >= 1, got {a.factor}")
    if a.steps <= a.skip + 1 or a.skip < 1:
        p.error(f"--skip must be at least 1 and --steps more than --skip + 1, got {a.skip} and {a.steps}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prov = _provenance.start(_provenance.training_sources("experiments/adpsgd_torchrun.py", "experiments/bench_data.py"),
                             argv=None if argv is None else ["experiments/adpsgd_torchrun.py", *argv])
    from experiments import bench_data
    # what the ranks run, imported here too: the provenance records the modules this
    # process imported, which certify a timing result (experiments/freshness.py)
    import gossip.algorithms.adpsgd  # noqa: F401
    import gossip.comm.pairs  # noqa: F401
    import gossip.train.loop  # noqa: F401

    samples = max(4000, a.nodes * a.batch_size * (a.steps + 1))  # the run stays inside its first epoch
    data = bench_data.dataset_name("mnist1d", samples, "test")
    bench_data.build("mnist1d", samples, "test")  # before any run's clock starts
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(q for q in (str(REPO), str(REPO / "experiments"),
                                                     os.environ.get("PYTHONPATH", "")) if q)}
    speed = f"slow:nodes=1,factor={a.factor:g}"
    runs: dict[str, list[dict]] = {algo: [] for algo in ALGOS}
    for rep in range(a.repeats):
        for algo in ALGOS:
            run_dir = out / f"{algo}-r{rep}"
            args = ["--algo", algo, "--topology", "ring", "--data", data, "--batch-size", str(a.batch_size),
                    "--epochs", "1", "--max-steps", str(a.steps), "--node-speed", speed, "--log-every", "1",
                    "--no-progress", "--overwrite", "--out", str(run_dir)]
            load = round(os.getloadavg()[0], 2)
            r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                f"--nproc_per_node={a.nodes}", "-m", "gossip.train", *args],
                               capture_output=True, text=True, env=env, timeout=1800, cwd=str(REPO))
            if r.returncode != 0:
                said = [ln for ln in r.stderr.splitlines() if "gossip.train: error:" in ln][:1] or [r.stderr[-2000:]]
                raise SystemExit(f"adpsgd_torchrun: {algo} repeat {rep} exited {r.returncode}: {said[0]}")
            rates = rank_rates(run_dir, a.nodes, a.skip)
            fast = sum(rates[1:]) / (a.nodes - 1)
            runs[algo].append({"rates": rates, "fast": fast, "load": load})
            print(f"adpsgd_torchrun: {algo} repeat {rep}: fast ranks {fast:.1f} steps/s, slow rank "
                  f"{rates[0]:.1f} (load {load})", flush=True)
    best = {algo: max(x["fast"] for x in v) for algo, v in runs.items()}
    ratio = best["adpsgd"] / best["dpsgd"]
    res = {"nodes": a.nodes, "factor": a.factor, "steps": a.steps, "skip": a.skip, "batch_size": a.batch_size,
           "data": data, "runs": runs, "best_fast_steps_per_s": best, "ratio": ratio, "target": TARGET}
    quiet = prov.load_before[0] < _provenance.QUIET_LOAD
    verdict = ("met" if ratio >= TARGET else "not met") if quiet else "not judged (loaded machine)"
    res["verdict"] = verdict
    for path in [out / "adpsgd_torchrun.json"] + ([Path(a.results)] if a.results else []):
        _provenance.write(path, res, prov)
    print(tables.adpsgd_torchrun_table(res))
    print(f"adpsgd_torchrun: ratio {ratio:.2f} (target >= {TARGET:g}: {verdict}); load "
          f"{prov.load_before[0]} before; {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
