#!/usr/bin/env python3
"""Groups on a virtual cluster: 2 hosts of 2 ranks, a shaped link between the hosts,
the same algorithm run flat (every rank a node) and in groups (``--group-size``: each
host a group, a gradient all-reduce inside it, the algorithm between the groups).

    sudo python -m experiments run groups_netns --out runs/groups-netns          # diloco, 20 Mbit/s
    sudo python -m experiments run groups_netns --repeats 1 --steps 24 --out runs/groups-netns-smoke

``experiments/vcluster.py`` builds ``--hosts`` network namespaces whose links are
shaped to ``--rate`` (tbf on both ends); on each host one ``torchrun`` starts
``--per-host`` workers, as across real machines, so the ranks of a host talk over its
loopback (unshaped, the fast link inside a host) and the hosts over the shaped one.
``gossip.train --algo ALGO`` runs twice: ``--group-size 1`` (flat: every rank a node of
the algorithm, whose exchanges cross the shaped link wherever the ring of ranks does)
and ``--group-size PER_HOST`` (groups: the members of a host all-reduce their gradients
in full precision every step over the loopback, and the algorithm runs between the
hosts on each member's slice of the model; docs/hierarchical.md).

What is measured, per run: rank 0's step time from the end of step ``--local-steps``
(start-up and the first round left out) to the last step; each host's interface bytes
sent during the run (what crossed the shaped link, setup and the final evaluation
included) and its loopback bytes (what stayed inside the host), read from the kernel's
counters; and what the run's summary.json reports each rank sending per step (in
groups, split into the levels: ``inter`` between the groups, ``intra`` inside one). The two
settings run in turn, ``--repeats`` times interleaved; the table shows each setting's
fastest run. The hosts share this machine's cores, so step times are the protocols'
waiting on a shaped link, not a cluster's speed; the bytes do not depend on the load.

Out: ``groups_netns.json`` in ``--out`` and, with ``--results``, the same JSON with its
provenance (experiments/_provenance.py), from which ``python -m experiments render``
renders the table in docs/hierarchical.md. Not a study spec: it times torchrun ranks
on the shaped links of a virtual cluster (root, tc).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from experiments import _cli, _provenance, tables
from experiments.diloco_eager_netns import said
from experiments.streaming_overlap import step_times, train_samples

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ALGOS = ("diloco", "sparseloco", "ecd")


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run groups_netns``."""
    p.add_argument("--hosts", type=int, default=2, help="hosts, each a group (default 2)")
    p.add_argument("--per-host", type=int, default=2, help="ranks per host, the group size (default 2)")
    p.add_argument("--rate", default="20mbit", help="each host's link, each way (default 20mbit)")
    p.add_argument("--algo", default="diloco", choices=ALGOS, help="the algorithm between the groups (default diloco)")
    p.add_argument("--local-steps", type=int, default=5, help="H of the periodic algorithms; also the steps left "
                   "out of the timing (default 5)")
    p.add_argument("--steps", type=int, default=60, help="steps per run (default 60)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prefix", default="grpn")
    p.add_argument("--out", required=True)
    p.add_argument("--results", default=None, help="also write the results JSON here (experiments/results/...)")


def main(argv: list[str] | None = None) -> int:
    p, a = _cli.parse(argv, options, __doc__, "groups_netns")
    if a.hosts < 2 or a.per_host < 2:
        p.error(f"--hosts and --per-host must each be at least 2 (groups of ranks on several hosts), "
                f"got {a.hosts} and {a.per_host}")
    if a.hosts * a.per_host < 3 and a.algo == "ecd":
        p.error("--algo ecd needs a ring of at least 3 nodes")
    if a.local_steps < 1 or a.steps <= a.local_steps + 1:
        p.error(f"--steps must exceed --local-steps + 1 (the first round is left out), got --steps {a.steps} and "
                f"--local-steps {a.local_steps}")
    if a.repeats < 1:
        p.error(f"--repeats must be at least 1, got {a.repeats}")
    from experiments import bench_data, vcluster

    try:
        vcluster.check_rights()
    except vcluster.VClusterError as e:
        print(f"groups_netns: error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prov = _provenance.start(_provenance.training_sources(
        "experiments/groups_netns.py", "experiments/diloco_eager_netns.py", "experiments/streaming_overlap.py",
        "experiments/vcluster.py", "experiments/bench_data.py"),
        argv=None if argv is None else ["experiments/groups_netns.py", *argv])
    world = a.hosts * a.per_host
    samples = train_samples(world, a.batch_size, a.steps)
    data = bench_data.dataset_name("mnist1d", samples, "test")
    print(f"groups_netns: data {data} (generated once, then cached)", flush=True)
    bench_data.build("mnist1d", samples, "test")  # before any run's clock starts
    env = {"OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(q for q in (str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")) if q)}
    algo = ["--algo", a.algo, *(["--bits", "8"] if a.algo == "ecd" else []),
            *(["--algo-opt", f"local_steps={a.local_steps}"] if a.algo != "ecd" else [])]
    settings = {"flat": 1, "groups": a.per_host}
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    with vcluster.VirtualCluster(a.hosts, rate=vcluster.parse_rate(a.rate), prefix=a.prefix) as vc:
        print(f"groups_netns: {vc.describe()}", flush=True)
        for rep in range(a.repeats):
            for name, g in settings.items():
                run_dir = out / f"{name}-r{rep}"
                cmd = ["-m", "gossip.train", *algo, "--group-size", str(g), "--data", data,
                       "--batch-size", str(a.batch_size), "--max-steps", str(a.steps), "--log-every", "1",
                       "--no-progress", "--overwrite", "--out", str(run_dir)]
                load = round(os.getloadavg()[0], 2)
                _provenance.record_config(cmd[2:], ranks=world)  # witnessed as its simulation
                res = vc.run_torchrun(cmd, a.per_host, env=env, timeout=900, outdir=out / "cluster" / run_dir.name,
                                      cwd=str(REPO), run_id=f"grpn-{name}-{rep}")
                if not res.ok:
                    bad = res.failed[0]
                    raise SystemExit(f"groups_netns: {name} failed on host {bad.rank}: {said(res.tail(bad.rank, 60))}")
                st, wait = step_times(run_dir, a.local_steps)
                summary = json.loads((run_dir / "summary.json").read_text())
                row = {"s_per_step": st, "wait_s_per_step": wait, "load": load,
                       "interface_sent": [r.tx_bytes for r in res.ranks], "loopback": [r.lo_bytes for r in res.ranks],
                       "bytes_per_rank_per_step": summary["bytes_sent_per_node_per_step"],
                       "bytes_by_level": summary.get("bytes_by_level")}
                runs[name].append(row)
                print(f"groups_netns: {name} repeat {rep}: {1000 * st:.1f} ms/step; per host sent "
                      f"{sum(row['interface_sent']) / a.hosts / 1e6:.2f} MB over the link, "
                      f"{sum(row['loopback']) / a.hosts / 1e6:.2f} MB over its loopback (load {load})", flush=True)
    best = {name: min(v, key=lambda r: r["s_per_step"]) for name, v in runs.items()}
    res = {"hosts": a.hosts, "per_host": a.per_host, "rate": a.rate, "algo": a.algo, "args": algo,
           "local_steps": a.local_steps, "steps": a.steps, "batch_size": a.batch_size, "data": data,
           "runs": runs, "step_ratio": best["groups"]["s_per_step"] / best["flat"]["s_per_step"],
           "link_bytes_ratio": sum(best["groups"]["interface_sent"]) / max(1, sum(best["flat"]["interface_sent"]))}
    for path in [out / "groups_netns.json"] + ([Path(a.results)] if a.results else []):
        _provenance.write(path, res, prov)
    print(tables.groups_netns_table(res))
    print(f"groups_netns: groups / flat: step time {res['step_ratio']:.3f}, bytes over the link "
          f"{res['link_bytes_ratio']:.3f}; load {prov.load_before[0]} before")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
