#!/usr/bin/env python3
"""Accuracy of the sharded two-way exchange against the all-gathered form, same recipe.

    python experiments/sharded_accuracy.py --nodes 16 --epochs 30 --out runs/sharded-accuracy

Trains each method twice on MNIST-1D with ``cnn1d``, all ``--nodes`` nodes simulated,
with the race's recipe (``experiments/race.py``: lr 0.1, ``step`` schedule, weight decay
1e-3, batch 32 per node, local momentum where the method has none of its own; diloco's
inner AdamW at lr 0.003): once with ``--algo-opt exchange=sharded`` (the default: each
node owns 1/n of the coordinates, re-compresses their average with its own error
feedback or majority vote and all-gathers it) and once with ``exchange=allgather``
(the replicated server every run used before). It reports the final and best test
accuracy of the averaged model and the bytes each node sent per step, and writes
``results.json`` (with the command, commit, date, machine and load) and
``results.md`` in ``--out``. Accuracy does not depend on the machine's load; the
bytes are the ledger's.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

#: name -> gossip.train flags (on top of the recipe)
METHODS: dict[str, list[str]] = {
    "efsgd:8": ["--algo", "efsgd", "--compressor", "quant:bits=8"],
    "efsgd-sign": ["--algo", "efsgd", "--compressor", "sign"],
    # a sign step moves every weight by lr: the recipe's 0.1 diverges (8.8 % sharded at
    # 16 nodes, 20 epochs), 0.01 is what tests/test_library_api.py gives it
    "signum": ["--algo", "signum", "--lr", "0.01"],
    "efblocksgd": ["--algo", "efblocksgd"],
    "diloco:4": ["--algo", "diloco", "--bits", "4", "--algo-opt", "error_feedback=true",
                 "--algo-opt", "local_steps=10", "--lr", "0.003"],
}
RECIPE = ["--lr", "0.1", "--lr-schedule", "step", "--weight-decay", "1e-3", "--batch-size", "32"]
EXCHANGES = ("sharded", "allgather")


def _train(args: list[str]) -> tuple[int, str]:
    from gossip import train

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            rc = train.main(args)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return rc, err.getvalue()


def _best(run_dir: Path) -> float | None:
    from gossip import rundir

    accs = [r["test_acc"] for r in rundir.read_metrics(rundir.metrics_path(run_dir, 0))
            if r.get("kind") == "eval" and "test_acc" in r]
    return max(accs) if accs else None


def _commit() -> tuple[str, bool]:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                                    text=True).stdout.strip())
        return sha, dirty
    except OSError:
        return "unknown", True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--max-steps", type=int, default=None, help="stop early (smoke tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exchanges", default=",".join(EXCHANGES), help="comma-separated subset of sharded, allgather")
    p.add_argument("--data", default=None, help="gossip.train's --data (default: its own, MNIST-1D)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    p.add_argument("--out", default="runs/sharded-accuracy")
    args = p.parse_args(argv)
    names = [m for m in args.methods.split(",") if m]
    bad = [m for m in names if m not in METHODS]
    if bad:
        print(f"sharded_accuracy: --methods: unknown {', '.join(bad)}; known: {', '.join(METHODS)}", file=sys.stderr)
        return 2
    exchanges = [e for e in args.exchanges.split(",") if e]
    if not exchanges or any(e not in EXCHANGES for e in exchanges):
        print(f"sharded_accuracy: --exchanges: expected a subset of {', '.join(EXCHANGES)}, got {args.exchanges!r}",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    started = time.time()
    rows = []
    for name in names:
        for exchange in exchanges:
            run_dir = out / f"{name.replace(':', '-')}-{exchange}"
            flags = ["--simulate", str(args.nodes), "--epochs", str(args.epochs), "--seed", str(args.seed),
                     *RECIPE, *METHODS[name], "--algo-opt", f"exchange={exchange}",
                     "--no-progress", "--overwrite", "--out", str(run_dir)]
            if args.max_steps is not None:
                flags += ["--max-steps", str(args.max_steps)]
            if args.data is not None:
                flags += ["--data", args.data]
            rc, err = _train(flags)
            if rc != 0:
                last = err.strip().splitlines()[-1] if err.strip() else ""
                print(f"sharded_accuracy: {name} exchange={exchange} failed (exit {rc}): {last}", file=sys.stderr)
                return 1
            s = json.loads((run_dir / "summary.json").read_text())
            rows.append({"method": name, "exchange": exchange, "final_test_acc": s["final_test_acc"],
                         "best_test_acc": _best(run_dir),
                         "bytes_per_node_per_step": s["bytes_sent_per_node_per_step"], "steps": s["steps"]})
            print(json.dumps(rows[-1]), flush=True)
    sha, dirty = _commit()
    meta = {"command": " ".join([sys.executable, *sys.argv]), "commit": sha, "dirty": dirty,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "load_before": load_before, "load_after": os.getloadavg(), "wall_s": round(time.time() - started, 1),
            "nodes": args.nodes, "epochs": args.epochs, "seed": args.seed, "recipe": RECIPE,
            "methods": {k: METHODS[k] for k in names}}
    lines = ["| method | sharded: final (best) | allgather: final (best) | difference (points) | "
             "bytes/node/step sharded | allgather |", "|---|---|---|---|---|---|"]
    for name in names if len(exchanges) == 2 else ():
        sh, ag = (next(r for r in rows if r["method"] == name and r["exchange"] == e) for e in EXCHANGES)

        def acc(r: dict) -> str:
            best = f" ({r['best_test_acc']:.1%})" if r["best_test_acc"] is not None else ""
            return f"{r['final_test_acc']:.1%}{best}"

        lines.append(f"| {name} | {acc(sh)} | {acc(ag)} | {100 * (sh['final_test_acc'] - ag['final_test_acc']):+.1f} | "
                     f"{sh['bytes_per_node_per_step']:,.0f} | {ag['bytes_per_node_per_step']:,.0f} |")
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
