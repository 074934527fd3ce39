#!/usr/bin/env python3
"""Training among untrusted nodes: one attacker against the mean, centered clipping and ClippedGossip.

    python -m experiments run trust_check --nodes 8 --epochs 12 --jobs 2 --out runs/trust-check \\
        --json experiments/results/trust_check.json

Trains on MNIST-1D (``cnn1d`` with 16 channels and 64 hidden units), all ``--nodes``
nodes simulated, ``--byzantine`` of them attackers drawn from the seed, each
configuration of :data:`CONFIGS` once: the clean run, the attack without defence and
the attack against the defence, for ``allreduce`` (the mean, then ``--aggregator
cclip``: centered clipping, Karimireddy, He and Jaggi, arXiv:2012.10333) and for
``dpsgd`` on a ring (plain gossip, then ``--robust clippedgossip``: He, Karimireddy and
Jaggi, arXiv:2202.01545). ``signflip`` sends the negated honest message;
``scaled:factor=-10`` ten times that.

It reports each run's final test accuracy of the averaged model (a run that diverges
is reported as such, with no accuracy) and its bytes per node per step, and the gap to
the clean run of the same method; writes ``--json`` through
``experiments/_provenance.py`` (command, commit, date, machine, load). Accuracy does
not depend on the machine's load: the runs are deterministic for a seed and thread
count.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from experiments import _cli, _provenance, training

#: name -> (method it is held against, gossip.train flags on top of the recipe)
CONFIGS: dict[str, tuple[str, list[str]]] = {
    "allreduce": ("allreduce", ["--algo", "allreduce"]),
    "allreduce+signflip": ("allreduce", ["--algo", "allreduce", "--attack", "signflip"]),
    "allreduce+signflip+cclip": ("allreduce", ["--algo", "allreduce", "--attack", "signflip",
                                               "--aggregator", "cclip:tau={tau},beta=0.9", "--momentum", "0"]),
    "allreduce+scaled": ("allreduce", ["--algo", "allreduce", "--attack", "scaled:factor=-10"]),
    "allreduce+scaled+cclip": ("allreduce", ["--algo", "allreduce", "--attack", "scaled:factor=-10",
                                             "--aggregator", "cclip:tau={tau},beta=0.9", "--momentum", "0"]),
    "dpsgd": ("dpsgd", ["--algo", "dpsgd", "--topology", "ring"]),
    "dpsgd+signflip": ("dpsgd", ["--algo", "dpsgd", "--topology", "ring", "--attack", "signflip"]),
    "dpsgd+signflip+clippedgossip": ("dpsgd", ["--algo", "dpsgd", "--topology", "ring", "--attack", "signflip",
                                               "--robust", "clippedgossip"]),
}
RECIPE = ["--lr", "0.1", "--batch-size", "32", "--no-node-eval"]
#: the data and model of the study (another --data trains gossip.train's mlp)
MODEL = ["--data", "mnist1d", "--model", "cnn1d", "--model-opt", "channels=16", "--model-opt", "hidden=64"]
SOURCES = _provenance.training_sources("experiments/trust_check.py", "experiments/training.py", "experiments/_cli.py")


def _run_one(name: str, flags: list[str], run_dir: str) -> dict:
    t0 = time.perf_counter()
    rc, err = training.train_in_process(flags)
    path = Path(run_dir) / "summary.json"
    s = json.loads(path.read_text()) if path.exists() else {}
    diverged = rc != 0 and "diverged" in err
    if rc != 0 and not diverged:
        last = err.strip().splitlines()[-1] if err.strip() else ""
        raise RuntimeError(f"{name} failed (exit {rc}): {last}")
    return {"config": name, "method": CONFIGS[name][0], "final_test_acc": None if diverged else s["final_test_acc"],
            "diverged": diverged, "steps": s.get("steps"),
            "bytes_per_node_per_step": s.get("bytes_sent_per_node_per_step"),
            "attackers": (s.get("trust") or {}).get("attackers", []), "wall_s": round(time.perf_counter() - t0, 1)}


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run trust_check``."""
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ", ".join(CONFIGS))
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--byzantine", type=int, default=1)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--max-steps", type=int, default=None, help="stop early (smoke tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tau", type=float, default=2.0, help="centered clipping's radius (cclip:tau=)")
    p.add_argument("--data", default=None, help="gossip.train's --data (default MNIST-1D)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time, each in its own process")
    p.add_argument("--out", default="runs/trust-check", help="directory for the run directories")
    p.add_argument("--json", default=None, help="results file (default OUT/results.json)")

def main(argv: list[str] | None = None) -> int:
    p, a = _cli.parse(argv, options, __doc__, "trust_check")
    names = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in names if c not in CONFIGS]
    if not names or bad:
        p.error(f"--configs: unknown {', '.join(bad) or '(none given)'}; accepted: {', '.join(CONFIGS)}")
    if a.nodes < 2 or a.epochs < 1 or a.jobs < 1 or a.byzantine < 1:
        p.error("need --nodes >= 2, --epochs >= 1, --jobs >= 1 and --byzantine >= 1")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prov = _provenance.start(SOURCES, argv=None if argv is None else ["experiments/trust_check.py", *argv])
    todo = []
    for name in names:
        flags = [f.format(tau=f"{a.tau:g}") for f in CONFIGS[name][1]]
        if "--attack" in flags:
            flags += ["--byzantine", str(a.byzantine)]
        run_dir = out / name.replace("+", "-").replace(":", "-")
        flags += ["--simulate", str(a.nodes), "--epochs", str(a.epochs), "--seed", str(a.seed), *RECIPE,
                  "--no-progress", "--overwrite", "--out", str(run_dir)]
        if a.max_steps is not None:
            flags += ["--max-steps", str(a.max_steps)]
        flags += MODEL if a.data is None else ["--data", a.data, "--model", "mlp"]
        _provenance.record_config(flags)
        todo.append((name, flags, str(run_dir)))
    try:  # in the order of todo
        rows = training.run_all(_run_one, todo, a.jobs, on_row=lambda r: print(json.dumps(r), flush=True))
    except RuntimeError as e:
        print(f"trust_check: {e}", file=sys.stderr)
        return 1
    clean = {r["method"]: r["final_test_acc"] for r in rows if r["config"] == r["method"]}
    for r in rows:
        c = clean.get(r["method"])
        r["gap_to_clean"] = None if c is None or r["final_test_acc"] is None else round(c - r["final_test_acc"], 4)
    results = {"nodes": a.nodes, "byzantine": a.byzantine, "epochs": a.epochs, "seed": a.seed, "tau": a.tau,
               "max_steps": a.max_steps, "data": a.data or "mnist1d", "recipe": RECIPE + (MODEL if a.data is None else []),
               "configs": {k: CONFIGS[k][1] for k in names}, "rows": rows}
    path = _provenance.write(a.json or out / "results.json", results, prov)
    for r in rows:
        acc = "diverged" if r["diverged"] else f"{100 * r['final_test_acc']:.1f} %"
        gap = "" if r["gap_to_clean"] is None else f"  ({100 * r['gap_to_clean']:+.1f} points below clean)"
        print(f"{r['config']:<32} {acc}{gap}")
    print(f"trust_check: wrote {path}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
