#!/usr/bin/env python3
"""One slow rank on shaped links: AD-PSGD against D-PSGD on a virtual cluster of
network namespaces, with every rank at speed 1 and with rank 0 slowed.

    sudo python -m experiments run adpsgd_netns --out runs/adpsgd-netns        # 4 hosts, 200 Mbit/s
    sudo python -m experiments run adpsgd_netns --repeats 1 --steps 40 --out runs/adpsgd-netns-smoke

Each host of ``experiments/vcluster.py`` (4 by default, links shaped to ``--rate`` with
tbf on both ends) runs one torchrun rank of ``gossip.train`` on a ring, MNIST-1D
``cnn1d``. Under ``slow`` rank 0 is ``--factor`` times slower (``--node-speed
slow:nodes=1,factor=F``: the rank really sleeps for the extra compute, so the shaped
links see a slow host); under ``uniform`` none is. D-PSGD exchanges with both
neighbours at every step, so the slow host sets everyone's pace. AD-PSGD's active
ranks wait only for the passive neighbour they draw, which answers from a background
thread, so the fast hosts keep their own pace (docs/heterogeneous.md).

What is timed: each rank's training clock (the ``time`` of its per-step records) from
the end of step ``--skip`` to its last step, divided by the steps between; no
evaluation falls inside (the training set is made large enough that the run stays in
its first epoch, and experiments/adpsgd_torchrun.py's reader checks it). The fast
ranks' rate is the mean over the ranks at speed 1. The four settings run in turn,
``--repeats`` times interleaved, and the best (highest) rate of each is kept.

The target, the one of experiments/adpsgd_torchrun.py on loopback (issue: "the fast
ranks of adpsgd complete at least 2x more steps per second than under dpsgd" with
one rank slowed 4x), is judged only on a quiet machine: ``verdict`` is "met" or "not
met" when the load average was below 0.3 before the first run, else "not judged
(loaded machine)". The hosts share this machine's cores, so the figures are the
protocols' waiting on shaped links, not a cluster's speed.

Out: ``adpsgd_netns.json`` in ``--out`` and, with ``--results``, the same JSON with its
provenance (experiments/_provenance.py) at that path, from which ``python -m
experiments render`` renders the table in docs/heterogeneous.md. Not a study spec: it
times torchrun ranks on the shaped links of a virtual cluster (root, tc).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from experiments import _cli, _provenance, tables
from experiments.adpsgd_torchrun import TARGET, rank_rates
from experiments.diloco_eager_netns import said

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ALGOS = ("dpsgd", "adpsgd")
SPEEDS = ("uniform", "slow")


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run adpsgd_netns``."""
    p.add_argument("--nodes", type=int, default=4, help="hosts on a ring (even; default 4)")
    p.add_argument("--rate", default="200mbit", help="each host's link, each way (default 200mbit)")
    p.add_argument("--factor", type=float, default=4.0, help="how many times slower rank 0 is under slow (default 4)")
    p.add_argument("--steps", type=int, default=120, help="steps per rank (default 120)")
    p.add_argument("--skip", type=int, default=10, help="first steps left out of the timing (default 10)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prefix", default="adns")
    p.add_argument("--out", required=True)
    p.add_argument("--results", default=None, help="also write the results JSON here (experiments/results/...)")


def main(argv: list[str] | None = None) -> int:
    p, a = _cli.parse(argv, options, __doc__, "adpsgd_netns")
    if a.nodes < 4 or a.nodes % 2:
        p.error(f"--nodes must be even and at least 4 (a ring of at least 3 that adpsgd can split in two), got {a.nodes}")
    if not a.factor >= 1:
        p.error(f"--factor must be a number >= 1, got {a.factor}")
    if a.steps <= a.skip + 1 or a.skip < 1:
        p.error(f"--skip must be at least 1 and --steps more than --skip + 1, got {a.skip} and {a.steps}")
    if a.repeats < 1:
        p.error(f"--repeats must be at least 1, got {a.repeats}")
    from experiments import bench_data, vcluster

    try:
        vcluster.check_rights()
    except vcluster.VClusterError as e:
        print(f"adpsgd_netns: error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prov = _provenance.start(_provenance.training_sources(
        "experiments/adpsgd_netns.py", "experiments/adpsgd_torchrun.py", "experiments/vcluster.py",
        "experiments/bench_data.py"), argv=None if argv is None else ["experiments/adpsgd_netns.py", *argv])
    # what the ranks run, imported here too: the provenance records the modules this
    # process imported, which certify a timing result (experiments/freshness.py)
    import gossip.algorithms.adpsgd  # noqa: F401
    import gossip.comm.pairs  # noqa: F401
    import gossip.train.loop  # noqa: F401

    samples = max(4000, a.nodes * a.batch_size * (a.steps + 1))  # the run stays inside its first epoch
    data = bench_data.dataset_name("mnist1d", samples, "test")
    print(f"adpsgd_netns: data {data} (generated once, then cached)", flush=True)
    bench_data.build("mnist1d", samples, "test")  # before any run's clock starts
    env = {"OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(q for q in (str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")) if q)}
    spec = {"uniform": "uniform", "slow": f"slow:nodes=1,factor={a.factor:g}"}
    runs: dict[str, list[dict]] = {f"{algo} {speed}": [] for speed in SPEEDS for algo in ALGOS}
    with vcluster.VirtualCluster(a.nodes, rate=vcluster.parse_rate(a.rate), prefix=a.prefix) as vc:
        print(f"adpsgd_netns: {vc.describe()}", flush=True)
        for rep in range(a.repeats):
            for speed in SPEEDS:
                for algo in ALGOS:
                    key = f"{algo} {speed}"
                    run_dir = out / f"{algo}-{speed}-r{rep}"
                    cmd = ["-m", "gossip.train", "--algo", algo, "--topology", "ring", "--data", data,
                           "--batch-size", str(a.batch_size), "--epochs", "1", "--max-steps", str(a.steps),
                           "--node-speed", spec[speed], "--log-every", "1", "--no-progress", "--overwrite",
                           "--out", str(run_dir)]
                    load = round(os.getloadavg()[0], 2)
                    _provenance.record_config(cmd[2:], ranks=a.nodes)  # witnessed as its simulation
                    res = vc.run_torchrun(cmd, 1, env=env, timeout=900, outdir=out / "cluster" / run_dir.name,
                                          cwd=str(REPO), run_id=f"adns-{algo}-{speed}-{rep}")
                    if not res.ok:
                        bad = res.failed[0]
                        raise SystemExit(f"adpsgd_netns: {key} failed on host {bad.rank}: {said(res.tail(bad.rank, 60))}")
                    rates = rank_rates(run_dir, a.nodes, a.skip)
                    fast = sum(rates[1:]) / (a.nodes - 1)
                    runs[key].append({"rates": rates, "fast": fast, "load": load})
                    print(f"adpsgd_netns: {key} repeat {rep}: fast ranks {fast:.1f} steps/s, rank 0 "
                          f"{rates[0]:.1f} (load {load})", flush=True)
    best = {key: max(x["fast"] for x in v) for key, v in runs.items()}
    ratio = best["adpsgd slow"] / best["dpsgd slow"]
    quiet = prov.load_before[0] < _provenance.QUIET_LOAD
    verdict = ("met" if ratio >= TARGET else "not met") if quiet else "not judged (loaded machine)"
    res = {"nodes": a.nodes, "rate": a.rate, "factor": a.factor, "steps": a.steps, "skip": a.skip,
           "batch_size": a.batch_size, "data": data, "runs": runs, "best_fast_steps_per_s": best, "ratio": ratio,
           "target": TARGET, "verdict": verdict}
    for path in [out / "adpsgd_netns.json"] + ([Path(a.results)] if a.results else []):
        _provenance.write(path, res, prov)
    print(tables.adpsgd_netns_table(res))
    print(f"adpsgd_netns: with rank 0 slowed, adpsgd's fast ranks / dpsgd's {ratio:.2f} (target >= {TARGET:g}: "
          f"{verdict}); load {prov.load_before[0]} before")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
