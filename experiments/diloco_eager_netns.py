#!/usr/bin/env python3
"""DiLoCo's overlapped outer step on shaped links: the step time of ``outer_delay=1``
(eager updates) against the synchronous outer step, on a virtual cluster of network
namespaces.

    sudo python -m experiments run diloco_eager_netns --out runs/diloco-eager-netns     # 4 hosts, 10 Mbit/s
    sudo python -m experiments run diloco_eager_netns --repeats 1 --steps 20 --out runs/den-smoke

Each host of ``experiments/vcluster.py`` (4 by default, links shaped to ``--rate`` with
tbf on both ends) runs one torchrun rank of ``gossip.train --algo diloco`` with
H = ``--local-steps`` on MNIST-1D; at each round's end the fp32 pseudo-gradient is
all-reduced over the shaped links. ``diloco`` waits for that exchange before its outer
step. ``diloco-eager`` (``--algo-opt outer_delay=1``; Kale et al. 2025, "Eager Updates
For Overlapped Communication and Computation in DiLoCo", arXiv:2502.12996) posts it and
waits for it one round later, so the next round's inner steps run while it is in
flight. The training set is MNIST-1D generated with ``nodes x batch x (steps + 1)``
samples (``experiments/bench_data.py``, cached after the first run), so that the timed
steps stay inside the first epoch: an epoch's end evaluates the model under torchrun.

What is timed: rank 0's training clock from the end of step H (the first round, with
start-up and first calls, left out) to the last step, divided by the steps between;
beside it, the seconds per step rank 0 waited on exchanges (its ``wait_s`` records).
The two methods run in turn, ``--repeats`` times interleaved; the minimum of each is
kept and the ratio eager / synchronous is printed with the load average before and
after. What the eager step costs in accuracy is ``experiments/diloco_eager.py``'s
question, not this one's.

The target (issue: "on the netns cluster at 10 Mbit/s its step time is below
diloco's") is judged only on a quiet machine: ``target`` in the JSON is "met" or "not
met" when the load average was below 0.3 before the first run, else "not judged
(loaded machine)".

Out: ``eager_netns.json`` in ``--out`` and, with ``--results``, the same JSON with its
provenance (experiments/_provenance.py) at that path
(``experiments/results/diloco_eager_netns.json``), from which
``python -m experiments render`` renders the table in docs/local-sgd.md. Not a study
spec: it times torchrun ranks on the shaped links of a virtual cluster (root, tc).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from experiments import _cli, _provenance, tables
from experiments.streaming_overlap import step_times, train_samples

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

#: name -> gossip.train flags on top of the shared ones
METHODS: dict[str, list[str]] = {"diloco": [], "diloco-eager": ["--algo-opt", "outer_delay=1"]}


def said(tail: str) -> str:
    """The line a failed rank's stderr names its error with (``gossip.train: error:``),
    else its last line."""
    lines = tail.strip().splitlines() or ["(no output)"]
    return next((ln.strip() for ln in lines if "gossip.train: error:" in ln), lines[-1].strip())


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run diloco_eager_netns``."""
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--rate", default="10mbit")
    p.add_argument("--local-steps", type=int, default=8, help="H (default 8)")
    p.add_argument("--steps", type=int, default=40, help="steps per run (default 40; more than 2 H)")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefix", default="eagr")
    p.add_argument("--out", required=True)
    p.add_argument("--results", default=None, help="also write the results JSON here (experiments/results/...)")


def main(argv: list[str] | None = None) -> int:
    p, a = _cli.parse(argv, options, __doc__, "diloco_eager_netns")
    if a.nodes < 2:
        p.error(f"--nodes must be at least 2, got {a.nodes}")
    if a.local_steps < 1 or a.steps <= 2 * a.local_steps:
        p.error(f"--steps must exceed 2 x --local-steps (the first round is left out and the eager step waits "
                f"one round later), got --steps {a.steps} and --local-steps {a.local_steps}")
    if a.repeats < 1:
        p.error(f"--repeats must be at least 1, got {a.repeats}")
    from experiments import bench_data, vcluster

    try:
        vcluster.check_rights()
    except vcluster.VClusterError as e:
        print(f"diloco_eager_netns: error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prov = _provenance.start(_provenance.training_sources(
        "experiments/diloco_eager_netns.py", "experiments/streaming_overlap.py", "experiments/vcluster.py",
        "experiments/bench_data.py"), argv=None if argv is None else ["experiments/diloco_eager_netns.py", *argv])
    env = {"OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(q for q in (str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")) if q)}
    samples = train_samples(a.nodes, a.batch_size, a.steps)
    data = bench_data.dataset_name("mnist1d", samples, "test")
    print(f"diloco_eager_netns: data {data} (generated once, then cached)", flush=True)
    bench_data.build("mnist1d", samples, "test")  # here, before the clock of any run starts
    runs: dict[str, list[float]] = {m: [] for m in METHODS}
    waits: dict[str, list[float]] = {m: [] for m in METHODS}
    with vcluster.VirtualCluster(a.nodes, rate=vcluster.parse_rate(a.rate), prefix=a.prefix) as vc:
        print(f"diloco_eager_netns: {vc.describe()}", flush=True)
        for rep in range(a.repeats):
            for name, extra in METHODS.items():
                run_dir = out / f"{name}-r{rep}"
                cmd = ["-m", "gossip.train", "--algo", "diloco", "--data", data, "--batch-size", str(a.batch_size),
                       "--algo-opt", f"local_steps={a.local_steps}", *extra, "--max-steps", str(a.steps),
                       "--log-every", "1", "--no-progress", "--overwrite", "--out", str(run_dir)]
                load = round(os.getloadavg()[0], 2)
                _provenance.record_config(cmd[2:], ranks=a.nodes)  # witnessed as its simulation
                res = vc.run_torchrun(cmd, 1, env=env, timeout=600, outdir=out / "cluster" / run_dir.name,
                                      cwd=str(REPO), run_id=f"eagr-{name}-{rep}")
                if not res.ok:
                    bad = res.failed[0]
                    raise SystemExit(f"diloco_eager_netns: {name} failed on host {bad.rank}: {said(res.tail(bad.rank, 60))}")
                st, wait = step_times(run_dir, a.local_steps)
                runs[name].append(st)
                waits[name].append(wait)
                print(f"diloco_eager_netns: {name} repeat {rep}: {1000 * st:.1f} ms/step, waiting "
                      f"{1000 * wait:.1f} ms/step (load {load})", flush=True)
    best = {m: min(v) for m, v in runs.items()}
    ratio = best["diloco-eager"] / best["diloco"]
    quiet = prov.load_before[0] < _provenance.QUIET_LOAD  # the ranks themselves raise the load after
    verdict = ("met" if ratio < 1 else "not met") if quiet else "not judged (loaded machine)"
    res = {"nodes": a.nodes, "rate": a.rate, "local_steps": a.local_steps, "steps": a.steps,
           "batch_size": a.batch_size, "data": data, "train_samples": samples, "methods": METHODS,
           "runs_s_per_step": runs, "wait_s_per_step": waits, "min_s_per_step": best, "ratio": ratio,
           "target": verdict}
    for path in [out / "eager_netns.json"] + ([Path(a.results)] if a.results else []):
        _provenance.write(path, res, prov)
    print(tables.diloco_eager_netns_table(res))
    print(f"diloco_eager_netns: eager / synchronous {ratio:.3f} (target below 1: {verdict}); load "
          f"{prov.load_before[0]} before")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
