#!/usr/bin/env python3
"""Step time of SGP with and without overlap on a shaped virtual cluster.

    sudo python experiments/sgp_overlap.py --nodes 4 --rate 10mbit --steps 30 --repeats 2

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
t + 1, so it should approach max(compute, comm). Writes ``results.json`` in
``--out`` and prints a table. Needs root (network namespaces); run it on a quiet
machine (speed is measured, not asserted).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _provenance  # noqa: E402


def make(seed: int):
    """``--data`` factory: 4 x 40 x 512 training inputs shaped (1, 40) like mnist1d's,
    labels from the inputs (any learnable rule will do: only time is measured)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = 4 * 40 * 512
    x = torch.randn(n + 512, 1, 40, generator=g)
    y = x[:, 0, :10].argmax(dim=1)
    return (x[:n], y[:n]), (x[n:], y[n:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--rate", default="10mbit")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--prefix", default="sgpov")
    p.add_argument("--out", default="runs/sgp_overlap")
    args = p.parse_args(argv)
    prov = _provenance.start(["gossip", "experiments/sgp_overlap.py"],
                             argv=None if argv is None else ["experiments/sgp_overlap.py", *argv])

    import sweep_network as sw
    from vcluster import VirtualCluster

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    rows = []
    with VirtualCluster(args.nodes, rate=args.rate, prefix=args.prefix) as vc:
        for rep in range(args.repeats):
            for overlap in (0, 1):
                run_dir = out / f"overlap{overlap}-{rep}"
                cmd = [sys.executable, "-m", "gossip.train", "--algo", "sgp", "--algo-opt", f"overlap={overlap}",
                       "--topology", "onepeer-exp", "--data", "sgp_overlap:make", "--model", "cnn1d",
                       "--batch-size", str(args.batch_size), "--epochs", "1", "--max-steps", str(args.steps),
                       "--log-every", "1", "--no-progress", "--overwrite", "--out", str(run_dir)]
                res = vc.run(cmd, env=env, timeout=900, outdir=out / f"cluster-overlap{overlap}-{rep}")
                if not res.ok:
                    print(f"overlap={overlap} repeat {rep}: failed, see {res.outdir}", file=sys.stderr)
                    return 1
                m = sw.measure_run(run_dir, warmup=args.warmup)
                rows.append({"overlap": overlap, "repeat": rep, "step_s": m["step_s"], "step_s_p90": m["step_s_p90"],
                             "comm_s_per_step": m["comm_s_per_step"], "compute_s_per_step": m["compute_s_per_step"],
                             "bytes_per_step": m["bytes_per_step"]})
                print(json.dumps(rows[-1]), flush=True)
    meta = {"nodes": args.nodes, "rate": args.rate, "steps": args.steps, "warmup": args.warmup,
            "batch_size": args.batch_size, "load": os.getloadavg(), "provenance": prov.finish()}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    # the reference: overlap 0's own compute and communication times
    ref = [r for r in rows if r["overlap"] == 0]
    comm0 = statistics.median(r["comm_s_per_step"] for r in ref)
    comp0 = statistics.median(r["compute_s_per_step"] for r in ref)
    print(f"\noverlap 0: compute {comp0:.3f} s + comm {comm0:.3f} s = {comp0 + comm0:.3f} s; "
          f"max(compute, comm) = {max(comp0, comm0):.3f} s")
    print("| overlap | step (s), min over repeats | step p90 (s) | waiting on the exchange (s) | compute (s) |")
    print("|---:|---:|---:|---:|---:|")
    for overlap in (0, 1):
        rs = [r for r in rows if r["overlap"] == overlap]
        print(f"| {overlap} | {min(r['step_s'] for r in rs):.3f} | {min(r['step_s_p90'] for r in rs):.3f} | "
              f"{statistics.median(r['comm_s_per_step'] for r in rs):.3f} | "
              f"{statistics.median(r['compute_s_per_step'] for r in rs):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
