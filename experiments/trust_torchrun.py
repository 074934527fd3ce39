#!/usr/bin/env python3
"""An attacker rank under torchrun: a clean run, the attacked run and the defended run,
each ``gossip.train`` on MNIST-1D with ``--nodes`` real ranks, one of them Byzantine.

    OMP_NUM_THREADS=1 python -m experiments run trust_torchrun --out runs/trust-torchrun \\
        --results experiments/results/trust_torchrun.json
    python -m experiments run trust_torchrun --epochs 1 --max-steps 2 --seeds 0 \\
        --methods allreduce --cases defended --out runs/trust-torchrun-smoke

The study experiments/studies/trust.toml simulates its nodes in one process. Here every
node is a rank of its own, launched by torchrun on this machine (gloo), and the
Byzantine rank (drawn from the seed, as in the simulation) sends its crafted message
through the same wire format as the honest ranks: the sharded exchange of ``allreduce``
(reduce-scatter by shard owner, the rule per shard, all-gather; centered clipping adds
its round of distances), the pairwise exchange of ``noloco`` on a ring. For each method
and seed: the clean run, the clean run with the defence (what it costs alone), the
attack without and with the defence. The protocol is the study's (cnn1d, batch 32 per
node, SGD at lr 0.05 with momentum 0.9, the same epochs, centered clipping's adaptive
radius), at 4 nodes: one attacker is a quarter of the nodes, twice the study's share.

A training result (not timed): its provenance lists each configuration, witnessed as its
simulation (a torchrun run of N ranks computes what ``--simulate N`` computes: the
tests hold them bit-identical), so ``python -m experiments verify`` certifies it by
behaviour. ``--results`` writes the JSON with its provenance, which ``python -m
experiments render`` turns into the table in docs/trust.md.
Not a study spec: a study trains in one process; these runs are torchrun launches.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from experiments import _cli, _provenance, tables
from experiments.diloco_eager_netns import said

REPO = Path(__file__).resolve().parents[1]
#: each method: its flags, and its defence (label, flags)
METHODS = {
    "allreduce": (["--algo", "allreduce"], ("cclip", ["--aggregator", "cclip:iters=3,beta=0.9"])),
    "noloco": (["--algo", "noloco", "--topology", "ring", "--optimizer", "sgd", "--momentum", "0.9",
                "--algo-opt", "local_steps=10"], ("clippedgossip", ["--robust", "clippedgossip"])),
}
ATTACK = "signflip"
#: the runs of each method and seed: (attack, defended)
CASES = {"clean": (False, False), "clean-defended": (False, True), "attacked": (True, False), "defended": (True, True)}


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run trust_torchrun``."""
    p.add_argument("--nodes", type=int, default=4, help="ranks (default 4; one of them Byzantine)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)} (default all)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)} (default all)")
    p.add_argument("--seeds", default="0,1", help="comma list of seeds (default 0,1)")
    p.add_argument("--epochs", type=int, default=60, help="epochs per run (default 60, the study's)")
    p.add_argument("--max-steps", type=int, default=None, help="stop each run after this many steps (smoke runs)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05, the study's)")
    p.add_argument("--out", required=True)
    p.add_argument("--results", default=None, help="also write the results JSON here (experiments/results/...)")


def main(argv: list[str] | None = None) -> int:
    p, a = _cli.parse(argv, options, __doc__, "trust_torchrun")
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        p.error(f"--methods: unknown {', '.join(bad) or '(none given)'}; accepted: {', '.join(METHODS)}")
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad or not cases:
        p.error(f"--cases: unknown {', '.join(bad) or '(none given)'}; accepted: {', '.join(CASES)}")
    try:
        seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds must be a comma list of integers, got {a.seeds!r}")
    if not seeds:
        p.error("--seeds must name at least one seed")
    if a.nodes < 3:
        p.error(f"--nodes must be at least 3 (one Byzantine rank of fewer than half), got {a.nodes}")
    if a.epochs < 1 or (a.max_steps is not None and a.max_steps < 1):
        p.error(f"--epochs and --max-steps must be at least 1, got {a.epochs} and {a.max_steps}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prov = _provenance.start(_provenance.training_sources("experiments/trust_torchrun.py"),
                             argv=None if argv is None else ["experiments/trust_torchrun.py", *argv])
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(q for q in (str(REPO), os.environ.get("PYTHONPATH", "")) if q)}
    base = ["--data", "mnist1d", "--epochs", str(a.epochs), "--lr", f"{a.lr:g}", "--batch-size", "32",
            "--model", "cnn1d", "--model-opt", "channels=16", "--model-opt", "hidden=64", "--no-node-eval",
            "--no-progress", *(["--max-steps", str(a.max_steps)] if a.max_steps else [])]
    rows = []
    for seed in seeds:
        for m in methods:
            flags, (dname, dflags) = METHODS[m]
            for attacked, defended in (CASES[c] for c in cases):
                attack, defence = ATTACK if attacked else "none", dname if defended else "none"
                extra = [*(["--byzantine", "1", "--attack", ATTACK] if attacked else []), *(dflags if defended else [])]
                name = f"{m}-{attack}-{defence}-s{seed}"
                run_dir = out / name
                args = [*flags, *base, *extra, "--seed", str(seed)]
                _provenance.record_config(args, ranks=a.nodes)  # witnessed as its simulation
                r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                    f"--nproc_per_node={a.nodes}", "-m", "gossip.train", *args, "--overwrite",
                                    "--out", str(run_dir)],
                                   capture_output=True, text=True, env=env, timeout=3600, cwd=str(REPO))
                if r.returncode != 0:
                    raise SystemExit(f"trust_torchrun: {name} exited {r.returncode}: {said(r.stderr)}")
                s = json.loads((run_dir / "summary.json").read_text())
                if s.get("world_size", a.nodes) != a.nodes:
                    raise SystemExit(f"trust_torchrun: {name} ran {s.get('world_size')} ranks, not {a.nodes}")
                row = {"method": m, "attack": attack, "defence": defence, "seed": str(seed),
                       "final_test_acc": s.get("final_test_acc"),
                       "bytes_per_node_per_step": s.get("bytes_sent_per_node_per_step"),
                       "attackers": (s.get("trust") or {}).get("attackers"), "steps": s.get("steps")}
                rows.append(row)
                acc = row["final_test_acc"]
                print(f"trust_torchrun: {name}: final test accuracy "
                      f"{'-' if acc is None else f'{100 * acc:.1f} %'}"
                      + (f", attacker rank(s) {row['attackers']}" if row["attackers"] else ""), flush=True)
    res = {"nodes": a.nodes, "epochs": a.epochs, "lr": a.lr, "max_steps": a.max_steps, "seeds": seeds, "cases": cases,
           "attack": ATTACK, "methods": {m: {"flags": METHODS[m][0], "defence": METHODS[m][1][0],
                                             "defence_flags": METHODS[m][1][1]} for m in methods},
           "rows": rows}
    for path in [out / "trust_torchrun.json"] + ([Path(a.results)] if a.results else []):
        _provenance.write(path, res, prov)
    print(tables.trust_table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
