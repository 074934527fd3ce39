#!/usr/bin/env python3
"""Streaming DiLoCo's overlap on shaped links: step time with ``fragment_sync_delay`` tau
against tau = 0 (no overlap), on a virtual cluster of network namespaces.

    sudo python -m experiments run streaming_overlap --out runs/streaming-overlap        # 4 hosts, 10 Mbit/s
    sudo python -m experiments run streaming_overlap --repeats 1 --steps 12 --out runs/so-smoke

Each host of ``experiments/vcluster.py`` (4 by default, links shaped to ``--rate`` with
tbf on both ends) runs one torchrun rank of ``gossip.train --algo diloco`` with
``fragments`` F (``--fragments``, default 2) and H = ``--local-steps`` on MNIST-1D; the fp32 pseudo-gradient of
each fragment is all-reduced over the shaped links. The training set is MNIST-1D
generated with ``nodes x batch x (steps + 1)`` samples (``experiments/bench_data.py``,
cached after the first run), so that the timed steps stay inside the first epoch: an
epoch's end evaluates the model over the test split under torchrun, seconds that
would swamp the exchange (the embedded 4,000 samples give a 3-step epoch at batch 256).
The default batch of 1024 gives each inner step enough compute to hide part of an
exchange behind. Without overlap (tau = 0) the
ranks wait for each exchange at the fragment's step; with tau > 0 the exchange is
posted tau inner steps earlier and the compute of those steps hides part of it.

What is timed: rank 0's training clock (the ``time`` of its per-step records) from
the end of step H (the first round, with start-up and first calls, left out) to the
last step, divided by the steps between; no evaluation falls inside (the data make
``--steps`` shorter than one epoch, and the script checks it). Beside it, the seconds
per step rank 0 waited on exchanges over the same steps (its ``wait_s`` records), the
part of the exchange the overlap is meant to hide. The configurations are run in turn, ``--repeats`` times
interleaved, and the minimum of each is kept; the ratio overlapped / not overlapped
is printed with the load average before and after. Figures from a loaded machine
are not results: the output says the load.

The target (issue: "the streaming overlap's step time with tau = 1 is below the
non-overlapped one") is judged only on a quiet machine: ``target`` in the JSON is
"met" or "not met" when the load average was below 0.3 (experiments/_provenance.py's
``QUIET_LOAD``) before the first run, else "not judged (loaded machine)". The load
after is recorded too: the four ranks on this machine's cores raise it themselves.

Out: ``overlap.json`` (every run's step time, the minima and the ratio, the target's
verdict, and the provenance record of experiments/_provenance.py: command, commit,
date, machine, load) and ``overlap.md``; with ``--results`` the same JSON at that path
(``experiments/results/streaming_overlap.json``), from which ``make results-tables``
renders docs/modern.md. The quiet re-run, as root on an idle machine::

    python -m experiments run streaming_overlap --repeats 3 \
        --out runs/streaming-overlap --results experiments/results/streaming_overlap.json

Not a study spec: it times torchrun ranks on the shaped links of a virtual cluster
(root, tc), interleaving repeats, where a study trains and keeps what each run reached.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

from experiments import _provenance
from experiments import tables
from gossip import rundir  # noqa: E402
from experiments import _cli


def step_time(run_dir: Path, first: int) -> float:
    """Seconds per step on rank 0's clock between the end of step ``first`` and the last."""
    return step_times(run_dir, first)[0]


def step_times(run_dir: Path, first: int) -> tuple[float, float]:
    """Seconds per step on rank 0's clock between the end of step ``first`` and the
    last, and the seconds per step it waited on exchanges over the same steps."""
    recs = [r for r in rundir.read_metrics(rundir.metrics_path(run_dir, 0)) if r["kind"] == "train"]
    at = {r["step"]: r for r in recs}
    last = max(at)
    if first not in at or last <= first:
        raise SystemExit(f"streaming_overlap: {run_dir} has no records of steps {first}..{last}")
    if any(r["kind"] == "eval" and first < r["step"] < last for r in rundir.read_metrics(rundir.metrics_path(run_dir, 0))):
        raise SystemExit(f"streaming_overlap: {run_dir} evaluated inside the timed steps {first}..{last}: "
                         "the training set is too small for --steps at this batch size")
    span = last - first
    wait = (at[last].get("wait_s", 0.0) - at[first].get("wait_s", 0.0)) / span
    return (at[last]["time"] - at[first]["time"]) / span, wait


def train_samples(nodes: int, batch_size: int, steps: int) -> int:
    """Training samples that give every node more than ``steps`` batches (one epoch
    longer than the run), and at least the embedded 4,000."""
    return max(4000, nodes * batch_size * (steps + 1))


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run streaming_overlap``."""
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--rate", default="10mbit")
    p.add_argument("--local-steps", type=int, default=8, help="H (default 8)")
    p.add_argument("--fragments", type=int, default=2, help="F, the fragments the model is exchanged in (default 2)")
    p.add_argument("--taus", default="0,1", help="fragment_sync_delay values, the first the baseline (default 0,1)")
    p.add_argument("--steps", type=int, default=40, help="steps per run (default 40; the data make the epoch longer)")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefix", default="sovl")
    p.add_argument("--out", required=True)
    p.add_argument("--results", default=None, help="also write the results JSON here (experiments/results/...)")


def main(argv: list[str] | None = None) -> int:
    p, a = _cli.parse(argv, options, __doc__, "streaming_overlap")
    taus = [int(t) for t in a.taus.split(",") if t.strip()]
    if len(taus) < 2 or taus[0] != 0:
        p.error(f"--taus: give 0 (the baseline) and at least one tau > 0, got {a.taus!r}")
    if a.steps <= a.local_steps:
        p.error(f"--steps must exceed --local-steps (the first round is left out), got {a.steps} <= {a.local_steps}")
    from experiments import vcluster

    try:
        vcluster.check_rights()
    except vcluster.VClusterError as e:
        print(f"streaming_overlap: error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    argv = list(argv if argv is not None else sys.argv[1:])
    record = _provenance.start(_provenance.training_sources(  # training runs on the virtual cluster
        "experiments/streaming_overlap.py", "experiments/vcluster.py", "experiments/bench_data.py"), argv=["experiments/streaming_overlap.py", *argv])
    prov = vars(record)  # the record as started (command, commit, load before, machine), for the note below
    env = {"OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(q for q in (str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")) if q)}
    from experiments import bench_data

    samples = train_samples(a.nodes, a.batch_size, a.steps)
    data = bench_data.dataset_name("mnist1d", samples, "test")
    print(f"streaming_overlap: data {data} (generated once, then cached)", flush=True)
    bench_data.build("mnist1d", samples, "test")  # here, before the clock of any run starts
    runs: dict[int, list[float]] = {t: [] for t in taus}
    waits: dict[int, list[float]] = {t: [] for t in taus}
    with vcluster.VirtualCluster(a.nodes, rate=vcluster.parse_rate(a.rate), prefix=a.prefix) as vc:
        print(f"streaming_overlap: {vc.describe()}", flush=True)
        for rep in range(a.repeats):
            for tau in taus:
                run_dir = out / f"tau{tau}-r{rep}"
                cmd = ["-m", "gossip.train", "--algo", "diloco", "--data", data, "--batch-size", str(a.batch_size),
                       "--algo-opt", f"local_steps={a.local_steps}", "--algo-opt", f"fragments={a.fragments}",
                       "--algo-opt", f"fragment_sync_delay={tau}", "--max-steps", str(a.steps),
                       "--log-every", "1", "--no-progress", "--overwrite", "--out", str(run_dir)]
                load = round(os.getloadavg()[0], 2)
                _provenance.record_config(cmd[2:], ranks=a.nodes)  # witnessed as its simulation
                res = vc.run_torchrun(cmd, 1, env=env, timeout=600, outdir=out / "cluster" / run_dir.name,
                                      cwd=str(REPO), run_id=f"sovl-{tau}-{rep}")
                if not res.ok:
                    bad = res.failed[0]
                    raise SystemExit(f"streaming_overlap: tau={tau} failed on host {bad.rank}: {res.tail(bad.rank, 1)}")
                st, wait = step_times(run_dir, a.local_steps)
                runs[tau].append(st)
                waits[tau].append(wait)
                print(f"streaming_overlap: tau={tau} repeat {rep}: {1000 * st:.1f} ms/step, waiting "
                      f"{1000 * wait:.1f} ms/step (load {load})", flush=True)
    best = {t: min(v) for t, v in runs.items()}
    ratios = {t: best[t] / best[0] for t in taus[1:]}
    doc = {"nodes": a.nodes, "rate": a.rate, "local_steps": a.local_steps, "fragments": a.fragments, "taus": taus,
           "steps": a.steps, "batch_size": a.batch_size, "data": data, "train_samples": samples,
           "runs_s_per_step": {str(t): v for t, v in runs.items()},
           "wait_s_per_step": {str(t): v for t, v in waits.items()},
           "min_s_per_step": {str(t): v for t, v in best.items()},
           "ratio_to_tau0": {str(t): r for t, r in ratios.items()}, "provenance": record.finish()}
    prov = doc["provenance"]
    quiet = prov["load_before"][0] < _provenance.QUIET_LOAD  # the ranks themselves raise the load after
    first = taus[1]
    doc["target"] = (("met" if best[first] < best[0] else "not met") if quiet else "not judged (loaded machine)")
    doc["load_end"] = prov["load_after"]  # as the first version's files had it
    md = tables.streaming_overlap_table({str(t): v for t, v in runs.items()}, {str(t): v for t, v in waits.items()})
    note = (f"Made with `{prov['command']}` at commit {(prov['commit'] or '?')[:10]}{' (dirty tree)' if prov['dirty'] else ''} "
            f"on {prov['date']}: {a.nodes} hosts, {a.rate} tbf, diloco H = {a.local_steps}, F = {a.fragments}, batch "
            f"{a.batch_size}, steps {a.local_steps}..{a.steps} timed; load average {prov['load_before'][0]} at the "
            f"start, {prov['load_after'][0]} at the end on {prov['machine']['cores']} cores; target (tau = {first} "
            f"below tau = 0): {doc['target']}.")
    (out / "overlap.md").write_text(f"{md}\n\n{note}\n")
    text = json.dumps(doc, indent=1) + "\n"
    for path in [out / "overlap.json"] + ([Path(a.results)] if a.results else []):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    print(md)
    print(note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
