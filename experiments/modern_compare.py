#!/usr/bin/env python3
"""The 2024-2026 methods against all-reduce on MNIST-1D: final accuracy at their bytes.

    python experiments/modern_compare.py --out runs/modern-compare                 # 8 nodes, 20 epochs
    python experiments/modern_compare.py --epochs 1 --data synthetic --out runs/mc-smoke

Every method trains the same model on the same iid shards of MNIST-1D with 8 nodes
simulated in one process (``gossip.train --simulate 8``), one ordinary run directory
per method under ``--out``; ``METHODS`` holds each one's flags (its optimizer and step
size: the sign and inner-AdamW methods need their own), ``RECIPE`` what they share.
The LoCo methods all take H = 8 inner steps (a short round for a short run; the
papers' H is 15 to 500 on language models).

Out: ``modern.json`` (per method: final and best test accuracy, bytes sent per node
per step and in total, the wire format, the margin to ``allreduce`` (AdamW at the LoCo
methods' step size; ``allreduce-sgd`` is the SGD recipe of experiments/race.py); the command, commit,
date, machine and load average) and ``modern.md`` (the table), both from one command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(REPO), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import race  # noqa: E402  (experiments/ is not a package: the curve reader)
import _cli  # noqa: E402
import _provenance  # noqa: E402

H = "8"
#: name -> the gossip.train flags that make the method (on top of the recipe)
METHODS: dict[str, list[str]] = {
    # the baseline: full-precision all-reduce with the LoCo methods' own optimizer and step size
    "allreduce": ["--algo", "allreduce", "--optimizer", "adamw", "--lr", "0.003"],
    # and with experiments/race.py's SGD recipe (momentum 0.9, lr 0.1, step schedule)
    "allreduce-sgd": ["--algo", "allreduce", "--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9",
                      "--lr-schedule", "step"],
    "demo": ["--algo", "demo", "--lr", "0.003"],
    "diloco": ["--algo", "diloco", "--lr", "0.003", "--algo-opt", f"local_steps={H}"],
    "streaming-diloco": ["--algo", "diloco", "--lr", "0.003", "--algo-opt", f"local_steps={H}",
                         "--algo-opt", "fragments=2", "--algo-opt", "fragment_sync_delay=1",
                         "--algo-opt", "fragment_update_alpha=0.5"],
    "sparseloco": ["--algo", "sparseloco", "--lr", "0.003", "--algo-opt", f"local_steps={H}"],
    "muloco": ["--algo", "muloco", "--lr", "0.003", "--algo-opt", f"local_steps={H}"],
    "noloco": ["--algo", "noloco", "--lr", "0.003", "--algo-opt", f"local_steps={H}"],
}
#: the shared recipe: batch 32 per node, weight decay 1e-3, evaluation every epoch
RECIPE = ["--batch-size", "32", "--weight-decay", "1e-3"]


def run_method(name: str, out: Path, nodes: int, common: list[str]) -> Path:
    run_dir = out / name
    args = ["--simulate", str(nodes), *RECIPE, *common, *METHODS[name],
            "--log-every", "1", "--no-progress", "--overwrite", "--out", str(run_dir)]
    rc, err = race._train(args)
    if rc != 0:
        last = err.strip().splitlines()[-1] if err.strip() else ""
        raise SystemExit(f"modern_compare: {name} failed (exit {rc}): {last}")
    return run_dir


def table(results: dict) -> str:
    head = ["method", "wire", "bytes/node/step", "vs allreduce bytes", "final acc", "best acc", "final - allreduce"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        ratio = r.get("bytes_vs_allreduce")
        margin = r.get("acc_minus_allreduce")
        lines.append("| " + " | ".join([
            name, r["wire"]["label"], race._fmt_bytes(r["bytes_per_step"]),
            "-" if ratio is None else f"{ratio:.4g}x",
            f"{r['final_test_acc']:.2%}", f"{r['best_test_acc']:.2%}",
            "-" if margin is None else f"{100 * margin:+.2f} pt"]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _cli.add_methods(p, METHODS)
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--data", default="mnist1d")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=None, help="stop every run after this many steps (a smoke run)")
    p.add_argument("--out", required=True, help="directory for the run directories and the results")
    a = p.parse_args(argv)
    names = _cli.methods(p, a.methods, METHODS)
    if a.nodes < 2 or a.epochs < 1:
        p.error(f"need --nodes >= 2 and --epochs >= 1, got --nodes {a.nodes} --epochs {a.epochs}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    argv = list(argv if argv is not None else sys.argv[1:])
    record = _provenance.start(["experiments/modern_compare.py", "gossip"], argv=["experiments/modern_compare.py", *argv])
    prov = vars(record)  # the record as started (command, commit, load before, machine), for the note below
    common = ["--data", a.data, "--epochs", str(a.epochs), "--seed", str(a.seed)]
    if a.max_steps is not None:
        common += ["--max-steps", str(a.max_steps)]
    if a.nodes % 2 and "noloco" in names:
        p.error(f"noloco pairs nodes (its matching graph): give an even --nodes, got {a.nodes}")
    results = {}
    for name in names:
        print(f"modern_compare: {name} ...", flush=True)
        run_dir = run_method(name, out, a.nodes, common)
        c = race.curve(run_dir)
        last = c["points"][-1] if c["points"] else None
        c["bytes_per_step"] = last["bytes"] / last["step"] if last else None
        c["bytes_total"] = last["bytes"] if last else None
        c["best_test_acc"] = max((pt["test_acc"] for pt in c["points"]), default=c["final_test_acc"])
        c["run_dir"] = run_dir.name
        results[name] = c
    base = results.get("allreduce")
    for r in results.values():
        if base is not None and base["bytes_per_step"]:
            r["bytes_vs_allreduce"] = r["bytes_per_step"] / base["bytes_per_step"]
            r["acc_minus_allreduce"] = r["final_test_acc"] - base["final_test_acc"]
    load_end = [round(x, 2) for x in os.getloadavg()]
    md = table(results)
    (out / "modern.md").write_text(
        f"{md}\n\nMade with `{prov['command']}` at commit {(prov['commit'] or '?')[:10]}{' (dirty tree)' if prov['dirty'] else ''} "
        f"on {prov['date']} ({a.nodes} simulated nodes, iid shards, {a.epochs} epochs, {a.data}; load average "
        f"{prov['load_before'][0]} at the start, {load_end[0]} at the end, {prov['machine']['cores']} cores).\n")
    (out / "modern.json").write_text(json.dumps({
        "nodes": a.nodes, "epochs": a.epochs, "data": a.data, "recipe": RECIPE,
        "methods": {k: METHODS[k] for k in names}, "results": results, "provenance": record.finish(), "load_end": load_end,
    }, indent=1))
    print(md)
    print(f"modern_compare: wrote {out / 'modern.md'}, {out / 'modern.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
