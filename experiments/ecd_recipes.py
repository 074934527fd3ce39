#!/usr/bin/env python3
"""Which training recipe suits the demo's algorithm (ECD at 8 bits on a ring of 4)?

    python -m experiments run ecd_recipes --out runs/ecd-recipes --results experiments/results/ecd_recipes.json
    python -m experiments run ecd_recipes --recipes demo --epochs-scale 0.05 --data synthetic --out runs/ecd-smoke

Every recipe in ``RECIPES`` trains ``gossip.train --simulate 4 --algo ecd --bits 8
--topology ring --seed 0`` (MNIST-1D, the data set's default model ``cnn1d``, batch 32
per node, local momentum 0.9) with its own learning rate, schedule, weight decay and
epochs, one ordinary run directory each under ``--out``. From each run it reads the
test accuracy of the averaged model at every epoch's end: the last one, and the best
one with its epoch. The accuracies do not depend on the machine's load (the runs are
simulated in one process, seeded); the results file records the provenance of
``experiments/_provenance.py`` all the same, and docs/race.md renders its table from
``experiments/results/ecd_recipes.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from experiments import _provenance  # noqa: E402
from experiments import tables
from experiments import race  # noqa: E402
from experiments import _cli

__all__ = ["BASE", "RECIPES", "main"]

#: the code the figures measure: training runs (the gossip package less what they never
#: import, experiments/_provenance.py's NOT_TRAINED), through race.py's runner
SOURCES = _provenance.training_sources("gossip/tools/crossover.py", "experiments/ecd_recipes.py", "experiments/race.py",
                                       "experiments/_cli.py")

#: what every recipe trains: the demo's algorithm, 4 simulated nodes, seed 0
BASE = ["--simulate", "4", "--algo", "ecd", "--bits", "8", "--topology", "ring", "--batch-size", "32"]
#: name -> (what the table calls it, epochs, the flags on top of BASE)
RECIPES: dict[str, tuple[str, int, list[str]]] = {
    "demo": ("the demo: lr 0.05 constant", 20, ["--lr", "0.05", "--lr-schedule", "constant"]),
    "demo-25": ("the demo, longer", 25, ["--lr", "0.05", "--lr-schedule", "constant"]),
    "wd": ("lr 0.05 constant, weight decay 1e-3", 20, ["--lr", "0.05", "--lr-schedule", "constant",
                                                        "--weight-decay", "1e-3"]),
    "lr0.1": ("lr 0.1 constant", 20, ["--lr", "0.1", "--lr-schedule", "constant"]),
    "race-20": ("lr 0.1 step, weight decay 1e-3 (the race's, shorter)", 20,
                ["--lr", "0.1", "--lr-schedule", "step", "--weight-decay", "1e-3"]),
    "cosine": ("lr 0.1 cosine, weight decay 1e-3", 20, ["--lr", "0.1", "--lr-schedule", "cosine",
                                                        "--weight-decay", "1e-3"]),
    "step-0.05": ("lr 0.05 step, weight decay 1e-3", 20, ["--lr", "0.05", "--lr-schedule", "step",
                                                          "--weight-decay", "1e-3"]),
}


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run ecd_recipes``."""
    p.add_argument("--recipes", default=",".join(RECIPES), help=f"comma list of {', '.join(RECIPES)} (default all)")
    p.add_argument("--data", default="mnist1d")
    p.add_argument("--epochs-scale", type=float, default=1.0,
                   help="multiply every recipe's epochs (at least 1), for a quick look; 1 for the table")
    p.add_argument("--out", required=True, help="directory for the run directories")
    p.add_argument("--results", type=Path, default=None, help="results JSON (experiments/results/ecd_recipes.json)")


def main(argv: list[str] | None = None) -> int:
    p, a = _cli.parse(argv, options, __doc__, "ecd_recipes")
    names = [n.strip() for n in a.recipes.split(",") if n.strip()]
    bad = [n for n in names if n not in RECIPES]
    if bad or not names:
        p.error(f"--recipes: unknown {', '.join(bad) or '(none given)'}; known: {', '.join(RECIPES)}")
    if not a.epochs_scale > 0:
        p.error(f"--epochs-scale must be > 0, got {a.epochs_scale:g}")
    prov = _provenance.start(SOURCES, argv=None if argv is None else ["experiments/ecd_recipes.py", *argv])
    out = Path(a.out)
    runs = {}
    for name in names:
        label, epochs, flags = RECIPES[name]
        epochs = max(1, round(epochs * a.epochs_scale))
        run_dir = out / name
        print(f"ecd_recipes: {name} ({epochs} epochs) ...", flush=True)
        args = [*BASE, *flags, "--data", a.data, "--epochs", str(epochs), "--seed", "0",
                "--log-every", "1", "--no-progress", "--overwrite", "--out", str(run_dir)]
        _provenance.record_config(args)  # what `python -m experiments verify` witnesses
        rc, err = race.train_in_process(args)
        if rc != 0:
            last = err.strip().splitlines()[-1] if err.strip() else ""
            print(f"ecd_recipes: {name} failed (exit {rc}): {last}", file=sys.stderr)
            return 1
        c = race.curve(run_dir)
        runs[name] = {"label": label, "epochs": epochs, "flags": [*BASE, *flags], "final_test_acc": c["final_test_acc"],
                      "points": [{"epoch": pt["epoch"], "test_acc": pt["test_acc"]} for pt in c["points"]]}
    res = {"data": a.data, "runs": runs}
    if a.results:
        _provenance.write(a.results, res, prov)
    print(tables.ecd_recipes_table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
