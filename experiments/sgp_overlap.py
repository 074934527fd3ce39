#!/usr/bin/env python3
"""Step time of SGP with and without overlap on a shaped virtual cluster.

    sudo python -m experiments run sgp_overlap --nodes 4 --rate 100mbit,10mbit --steps 30 --repeats 2 \\
        --results experiments/results/sgp_overlap.json

Runs ``gossip.train --algo sgp --topology onepeer-exp --algo-opt overlap=0|1`` on
``experiments/vcluster.py`` (one network namespace per rank, links shaped with tc),
the two settings interleaved ``--repeats`` times, on a generated data set big enough
that no epoch (hence no evaluation) ends inside the measured steps (``make`` below,
reached by the runs as ``--data sgp_overlap:make``), with the cnn1d model (124,810
parameters: 499 KB per message). For each run it reports, from the run's own
per-step records (``sweep_network.measure_run``, median over steps after
``--warmup``): the step time, the time in the communicate phase (waiting on the
exchange) and in the compute phase. Without overlap a step costs about compute +
comm; with overlap=1 the exchange of step t runs during the computation of step
t + 1, so it should approach max(compute, comm). ``--rate`` takes a comma list (one
cluster per rate). Writes ``results.json`` in ``--out`` (every run's figures and the
provenance record of ``experiments/_provenance.py``), with ``--results PATH`` the same
at PATH (``experiments/results/sgp_overlap.json``, rendered into docs/decentralized.md
by ``make results-tables``), and prints the table. Needs root (network namespaces);
run it on a quiet machine (speed is measured, not asserted).

Not a study spec: it times ranks on the shaped links of a virtual cluster (root, tc),
interleaving repeats, where a study trains and keeps what each run reached.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

from experiments import _provenance
from experiments import tables
from experiments import _cli


def make(seed: int):
    """``--data`` factory: 4 x 40 x 512 training inputs shaped (1, 40) like mnist1d's,
    labels from the inputs (any learnable rule will do: only time is measured)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = 4 * 40 * 512
    x = torch.randn(n + 512, 1, 40, generator=g)
    y = x[:, 0, :10].argmax(dim=1)
    return (x[:n], y[:n]), (x[n:], y[n:])


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run sgp_overlap``."""
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--rate", default="10mbit", help="link rates, a comma list (one cluster each; default 10mbit)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--prefix", default="sgpov")
    p.add_argument("--out", default="runs/sgp_overlap")
    p.add_argument("--results", default=None,
                   help="also write results.json here (experiments/results/sgp_overlap.json: docs/decentralized.md's table)")


def main(argv: list[str] | None = None) -> int:
    p, args = _cli.parse(argv, options, __doc__, "sgp_overlap")
    rates = [r.strip() for r in args.rate.split(",") if r.strip()]
    if not rates:
        p.error(f"--rate must name at least one rate, e.g. 10mbit, got {args.rate!r}")
    if args.steps <= args.warmup or args.repeats < 1:
        p.error(f"need --steps > --warmup and --repeats >= 1, got --steps {args.steps} --warmup {args.warmup} "
                f"--repeats {args.repeats}")
    prov = _provenance.start(_provenance.training_sources(  # training runs, timed by sweep_network's reader
        "experiments/sgp_overlap.py", "experiments/vcluster.py", "experiments/sweep_network.py"),
                             argv=None if argv is None else ["experiments/sgp_overlap.py", *argv])

    from experiments import sweep_network as sw
    from experiments.vcluster import VirtualCluster

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    rows = []
    for rate in rates:
        with VirtualCluster(args.nodes, rate=rate, prefix=args.prefix) as vc:
            for rep in range(args.repeats):
                for overlap in (0, 1):
                    tag = f"{rate}-overlap{overlap}-{rep}"
                    run_dir = out / tag
                    cmd = [sys.executable, "-m", "gossip.train", "--algo", "sgp", "--algo-opt", f"overlap={overlap}",
                           "--topology", "onepeer-exp", "--data", "sgp_overlap:make", "--model", "cnn1d",
                           "--batch-size", str(args.batch_size), "--epochs", "1", "--max-steps", str(args.steps),
                           "--log-every", "1", "--no-progress", "--overwrite", "--out", str(run_dir)]
                    _provenance.record_config(cmd[3:], ranks=args.nodes)  # witnessed as its simulation
                    res = vc.run(cmd, env=env, timeout=900, outdir=out / f"cluster-{tag}")
                    if not res.ok:
                        print(f"{rate}, overlap={overlap}, repeat {rep}: failed, see {res.outdir}", file=sys.stderr)
                        return 1
                    m = sw.measure_run(run_dir, warmup=args.warmup)
                    rows.append({"rate": rate, "overlap": overlap, "repeat": rep, "step_s": m["step_s"],
                                 "step_s_p90": m["step_s_p90"], "comm_s_per_step": m["comm_s_per_step"],
                                 "compute_s_per_step": m["compute_s_per_step"], "bytes_per_step": m["bytes_per_step"]})
                    print(json.dumps(rows[-1]), flush=True)
    results = {"nodes": args.nodes, "rates": rates, "steps": args.steps, "warmup": args.warmup,
               "repeats": args.repeats, "batch_size": args.batch_size, "model": "cnn1d", "rows": rows}
    record = {**results, "provenance": prov.finish()}
    for path in [out / "results.json"] + ([Path(args.results)] if args.results else []):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")
    print(tables.sgp_overlap_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
