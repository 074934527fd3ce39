"""Language-model recipes: a ~1M-parameter GPT and LSTM on 4 simulated nodes with all-reduce.

    python -m experiments run lm_recipes                       # both recipes, as documented
    python -m experiments run lm_recipes --recipes gpt --steps 50 --json /tmp/lm.json   # a quick check

Each recipe is one ``gossip.train`` command on the default corpus (the Python standard
library's sources, byte-level, see docs/language-models.md), run in a process of its
own: the record holds the command, the held-out bits per byte and perplexity it
reached, its parameter count, its wall clock (start-up and data loading included) and
the load average before and after, with the commit and the machine. The wall clock is
only a figure for a quiet machine (load average below 0.3 before and after); the
record says what the load was.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


from experiments import _provenance
from experiments._lmruns import REPO, run_train
from experiments import _cli

#: the code the figures measure (the results go stale when one changes): each recipe is a
#: `gossip.train` run, so the training path (experiments/_provenance.py's training_sources:
#: the text data, the models, their loss and metrics, the loop, the all-reduce), and the scripts
SOURCES = _provenance.training_sources("experiments/lm_recipes.py", "experiments/_lmruns.py")

#: name -> gossip.train flags; --max-steps is given separately (the recipe's, or --steps)
RECIPES = {
    # 4 layers of width 144 and 4 heads: 1.04M parameters; AdamW, constant 3e-3
    "gpt": (["--simulate", "4", "--algo", "allreduce", "--data", "text", "--data-opt", "context=64",
             "--model", "gpt", "--model-opt", "layers=4", "--model-opt", "width=144", "--model-opt", "heads=4",
             "--batch-size", "8", "--optimizer", "adamw", "--lr", "3e-3", "--epochs", "1", "--seed", "0"], 400),
    # 3 LSTM layers of 192 units, tied decoder: 0.94M parameters; AdamW, constant 3e-3
    "lstm": (["--simulate", "4", "--algo", "allreduce", "--data", "text", "--data-opt", "context=64",
              "--model", "lstm", "--model-opt", "layers=3", "--model-opt", "width=192",
              "--batch-size", "8", "--optimizer", "adamw", "--lr", "3e-3", "--epochs", "1", "--seed", "0"], 500),
}


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run lm_recipes``."""
    p.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated, of {', '.join(RECIPES)}")
    p.add_argument("--steps", type=int, default=None, help="override every recipe's --max-steps (a reduced run)")
    p.add_argument("--data-dir", default=None, help="train on this text (file or folder) instead of the default corpus")
    p.add_argument("--jobs", type=int, default=1, help="recipes run at once, each in its own process (default 1)")
    p.add_argument("--out", default="runs/lm-recipes", help="directory of the run directories")
    p.add_argument("--json", default=str(REPO / "experiments" / "results" / "lm_recipes.json"))


def main(argv: list[str] | None = None) -> int:
    p, a = _cli.parse(argv, options, __doc__, "lm_recipes")
    prov = _provenance.start(SOURCES, argv=None if argv is None else ["experiments/lm_recipes.py", *argv])
    names = [n.strip() for n in a.recipes.split(",") if n.strip()]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        p.error(f"--recipes: unknown {', '.join(unknown)}; known: {', '.join(RECIPES)}")
    if a.jobs < 1:
        p.error(f"--jobs must be at least 1, got {a.jobs}")
    if a.steps is not None and a.steps < 1:
        p.error(f"--steps must be at least 1, got {a.steps}")
    steps = {name: a.steps or RECIPES[name][1] for name in names}
    for name in names:
        print(f"lm_recipes: {name}, {steps[name]} steps ...", flush=True)
    # each recipe is a process of its own; --jobs 2 runs both at once (on a shared machine
    # each then waits for the other, which its wall clock and load record)
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        data = ["--data-dir", a.data_dir] if a.data_dir else []
        futures = {name: pool.submit(run_train, [*RECIPES[name][0], *data, "--max-steps", str(steps[name])],
                                     Path(a.out) / name) for name in names}
        results = {name: f.result() for name, f in futures.items()}
    for name, rec in results.items():
        rec["reduced"] = a.steps is not None
        rec["jobs"] = a.jobs
        if rec["exit"] != 0:
            print(f"lm_recipes: {name} failed: {rec['error']}", flush=True)
            continue
        print(f"lm_recipes: {name}: {rec['params']:,} params, {rec['steps']} steps, held-out "
              f"{rec['final_test_bpb']:.3f} bits per byte (perplexity per byte {rec['final_test_ppl']:.2f}) in "
              f"{rec['wall_s']:.0f} s wall clock, load average {rec['load_average'][0]:.1f} -> "
              f"{rec['load_average'][1]:.1f}", flush=True)
    _provenance.write(a.json, results, prov)  # the command, commit, machine and load are in the provenance
    print(f"lm_recipes: wrote {a.json}")
    return 0 if all(r["exit"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
