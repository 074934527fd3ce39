#!/usr/bin/env python3
"""The 2024-2026 methods against all-reduce on MNIST-1D, each tuned on the same budget:
final accuracy at their bytes.

    python -m experiments run modern_compare --jobs 2 --out runs/modern-compare \\
        --results experiments/results/modern_compare.json                     # 8 nodes, 30 epochs
    python -m experiments run modern_compare --epochs 1 --tune-epochs 1 --data synthetic --samples 256 \\
        --nodes 2 --out runs/mc-smoke                                           # a smoke run

Every method trains the same model on the same iid shards with 8 nodes simulated in
one process (``gossip.train --simulate 8``, the vectorized path where the model allows
it), one ordinary run directory per trial under ``--out``. ``METHODS`` holds each one's
flags and its base learning rate (the sign and inner-AdamW methods need their own);
``RECIPE`` what they all share. The LoCo methods take H = 8 inner steps (a short round
for a short run; the papers' H is 15 to 500 on language models); every other option
keeps its paper default.

The protocol (that of experiments/benchmark.py, fixed before any result is read):

1. **Tuning, the same budget for every method**: its learning rate on the grid
   ``--lr-factors`` x its base rate (3 values), ``--tune-epochs`` epochs, seed
   ``--seed``, on the training set less the fixed 10 % carve of
   ``experiments/bench_data.py`` and evaluated on that carve: the test split is never
   handed to a tuning run.
2. **Selection** on the carve's accuracy at the end of the tuning run, ties to the
   smaller rate; a failed or diverged trial ranks last.
3. **The final run** of the selected rate: ``--epochs`` epochs on the whole training
   set, evaluated on the test split, seed ``--seed``.

Trials run ``--jobs`` at a time, each in its own process with one thread; a trial
whose run directory holds a finished run of the same flags is not redone, so an
interrupted comparison continues where it stopped.

Out: ``modern.json`` (per method: the grid's validation accuracies, the selected rate,
final and best test accuracy, bytes sent per node per step and in total, the wire
format, the margin to ``allreduce`` (AdamW at its own tuned rate; ``allreduce-sgd`` is
the SGD recipe of experiments/race.py); the command, commit, date, machine and load
through experiments/_provenance.py) and ``modern.md`` (the table); with ``--results``
the same JSON at that path, from which ``make results-tables`` renders docs/modern.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

from experiments import _cli
from experiments import tables
from experiments import _provenance
from experiments import bench_data
from experiments import race
from gossip import rundir  # noqa: E402

H = "8"
#: name -> (the gossip.train flags that make the method on top of the recipe, its base learning rate)
METHODS: dict[str, tuple[list[str], float]] = {
    # the baseline: full-precision all-reduce with the LoCo methods' inner optimizer
    "allreduce": (["--algo", "allreduce", "--optimizer", "adamw"], 0.003),
    # and with experiments/race.py's SGD recipe (momentum 0.9, step schedule)
    "allreduce-sgd": (["--algo", "allreduce", "--optimizer", "sgd", "--momentum", "0.9", "--lr-schedule", "step"], 0.1),
    "demo": (["--algo", "demo"], 0.003),
    "diloco": (["--algo", "diloco", "--algo-opt", f"local_steps={H}"], 0.003),
    "streaming-diloco": (["--algo", "diloco", "--algo-opt", f"local_steps={H}", "--algo-opt", "fragments=2",
                          "--algo-opt", "fragment_sync_delay=1", "--algo-opt", "fragment_update_alpha=0.5"], 0.003),
    "sparseloco": (["--algo", "sparseloco", "--algo-opt", f"local_steps={H}"], 0.003),
    "muloco": (["--algo", "muloco", "--algo-opt", f"local_steps={H}"], 0.003),
    "noloco": (["--algo", "noloco", "--algo-opt", f"local_steps={H}"], 0.003),
}
#: the shared recipe: batch 32 per node, weight decay 1e-3, evaluation every epoch
RECIPE = ["--batch-size", "32", "--weight-decay", "1e-3"]
LR_FACTORS = "0.3,1,3"
_TRIAL = "trial.json"


def _train_args(name: str, lr: float, data: str, model: str | None, epochs: int, seed: int,
                max_steps: int | None, nodes: int, run_dir: Path) -> list[str]:
    flags, _ = METHODS[name]
    args = ["--simulate", str(nodes), "--data", data, *(["--model", model] if model else []),
            "--epochs", str(epochs), *RECIPE, *flags, "--lr", f"{lr:g}", "--seed", str(seed)]
    if max_steps is not None:
        args += ["--max-steps", str(max_steps)]
    return args + ["--log-every", "1", "--no-progress", "--overwrite", "--out", str(run_dir)]


def _done(run_dir: Path, args: list[str]) -> dict | None:
    """The trial record of a finished trial of exactly ``args`` in ``run_dir``, else None."""
    try:
        rec = rundir.read_json(run_dir / _TRIAL)
    except Exception:  # noqa: BLE001 - absent or unreadable: not finished
        return None
    # a run stopped from outside (this script interrupted) is not an outcome: it is run again
    return rec if rec.get("args") == args and rec.get("status") in ("ok", "failed") else None


def run_trial(name: str, stage: str, lr: float, args: list[str], run_dir: Path) -> dict:
    """One gossip.train run in this process; its record (also written to ``trial.json``)."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    rc, err = race.train_in_process(args)
    stopped = rc != 0 and "stopped by SIG" in err
    rec = {"method": name, "stage": stage, "lr": lr, "args": args,
           "status": "ok" if rc == 0 else "interrupted" if stopped else "failed",
           "cpu_s": round(time.process_time() - cpu0, 2), "wall_s": round(time.perf_counter() - wall0, 2),
           "error": None if rc == 0 else (err.strip().splitlines() or ["?"])[-1], "score": None}
    if rc == 0:
        score = rundir.read_json(rundir.summary_path(run_dir)).get("final_test_acc")
        rec["score"] = score if score is not None and math.isfinite(score) else None
    run_dir.mkdir(parents=True, exist_ok=True)
    rundir.write_json(run_dir / _TRIAL, rec)
    return rec


def _trial_in_child(name: str, stage: str, lr: float, args: list[str], run_dir: Path) -> dict:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    return run_trial(name, stage, lr, args, run_dir)


def _run_all(todo: list[tuple], jobs: int, log) -> list[dict]:
    """Run (name, stage, lr, args, run_dir) tuples, ``jobs`` at a time; their records."""
    recs = []

    def note(i: int, rec: dict) -> None:
        recs.append(rec)
        log(f"modern_compare: {rec['stage']} [{i}/{len(todo)}] {rec['method']} lr={rec['lr']:g}: {rec['status']}"
            + (f" val/test acc {rec['score']:.4f}" if rec["score"] is not None else "")
            + f" in {rec['wall_s']:.0f} s" + (f" ({rec['error']})" if rec["error"] else ""))

    if jobs <= 1:
        for i, t in enumerate(todo, 1):
            note(i, run_trial(*t))
        return recs
    import concurrent.futures as cf
    import multiprocessing as mp

    with cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
        futs = [pool.submit(_trial_in_child, *t) for t in todo]
        for i, f in enumerate(cf.as_completed(futs), 1):
            note(i, f.result())
    return recs


def select(grid: list[dict]) -> float | None:
    """The selected rate of a tuning grid: the best validation accuracy, ties to the smaller rate."""
    ok = [g for g in grid if g["val_acc"] is not None]
    return max(ok, key=lambda g: (g["val_acc"], -g["lr"]))["lr"] if ok else None


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run modern_compare``."""
    _cli.add_methods(p, METHODS)
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--epochs", type=int, default=30, help="the final run's epochs (default 30)")
    p.add_argument("--tune-epochs", type=int, default=8, help="each tuning trial's epochs (default 8)")
    p.add_argument("--lr-factors", default=LR_FACTORS, help=f"the grid, times each method's base rate (default {LR_FACTORS})")
    p.add_argument("--data", default="mnist1d", help="the base data set of experiments/bench_data.py (mnist1d, synthetic)")
    p.add_argument("--model", default=None, help="gossip.train's --model (default: cnn1d for mnist1d, the model "
                   "`--data mnist1d` trains; else the data set's own)")
    p.add_argument("--samples", type=int, default=4000, help="training samples in all (default 4000: MNIST-1D's own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1, help="trials at a time, each in its own one-thread process")
    p.add_argument("--max-steps", type=int, default=None, help="stop every run after this many steps (a smoke run)")
    p.add_argument("--out", required=True, help="directory for the run directories and the results")
    p.add_argument("--results", default=None, help="also write the results JSON here (experiments/results/...)")


def main(argv: list[str] | None = None) -> int:
    p, a = _cli.parse(argv, options, __doc__, "modern_compare")
    names = _cli.methods(p, a.methods, METHODS)
    if a.nodes < 2 or a.epochs < 1 or a.tune_epochs < 1 or a.jobs < 1:
        p.error(f"need --nodes >= 2, --epochs >= 1, --tune-epochs >= 1 and --jobs >= 1, got --nodes {a.nodes} "
                f"--epochs {a.epochs} --tune-epochs {a.tune_epochs} --jobs {a.jobs}")
    try:
        factors = [float(f) for f in a.lr_factors.split(",") if f.strip()]
    except ValueError:
        factors = []
    if not factors or any(not (f > 0 and math.isfinite(f)) for f in factors):
        p.error(f"--lr-factors: give positive numbers separated by commas, got {a.lr_factors!r}")
    if a.nodes % 2 and "noloco" in names:
        p.error(f"noloco pairs nodes (its matching graph): give an even --nodes, got {a.nodes}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    argv = list(argv if argv is not None else sys.argv[1:])
    record = _provenance.start(_provenance.training_sources(  # training runs, read back through race.py
        "gossip/tools/crossover.py", "experiments/modern_compare.py", "experiments/bench_data.py", "experiments/race.py",
        "experiments/_cli.py"),
                               argv=["experiments/modern_compare.py", *argv])
    # bench_data's factories are not the registry's mnist1d, whose default model is cnn1d: name it
    model = a.model or ("cnn1d" if a.data == "mnist1d" else None)
    val = bench_data.dataset_name(a.data, a.samples, "val")
    test = bench_data.dataset_name(a.data, a.samples, "test")

    def trial(name: str, stage: str, lr: float) -> tuple:
        run_dir = out / name / (f"tune-lr{lr:g}" if stage == "tune" else "final")
        epochs, data = (a.tune_epochs, val) if stage == "tune" else (a.epochs, test)
        return name, stage, lr, _train_args(name, lr, data, model, epochs, a.seed, a.max_steps, a.nodes, run_dir), run_dir

    def pending(ts: list[tuple]) -> list[tuple]:
        return [t for t in ts if _done(t[4], t[3]) is None]

    # 1. the tuning grid of every method
    tune = [trial(n, "tune", round(METHODS[n][1] * f, 10)) for n in names for f in factors]
    _run_all(pending(tune), a.jobs, lambda s: print(s, flush=True))
    # 2. selection on the validation carve
    grids = {n: [] for n in names}
    for t in tune:
        rec = _done(t[4], t[3])
        grids[t[0]].append({"lr": t[2], "val_acc": rec["score"] if rec else None, "cpu_s": rec["cpu_s"] if rec else None})
    chosen = {n: select(grids[n]) for n in names}
    # 3. the final runs at the selected rates
    final = [trial(n, "final", chosen[n]) for n in names if chosen[n] is not None]
    for t in final:  # what `python -m experiments verify` witnesses (as the benchmark's, not the tuning trials)
        _provenance.record_config(t[3])
    _run_all(pending(final), a.jobs, lambda s: print(s, flush=True))

    results = {}
    for n in names:
        r = {"grid": grids[n], "lr": chosen[n], "status": "every tuning trial failed" if chosen[n] is None else None}
        if chosen[n] is not None:
            t = trial(n, "final", chosen[n])
            rec = _done(t[4], t[3])
            r["status"] = rec["status"]
            r["final_cpu_s"] = rec["cpu_s"]
            if rec["status"] == "ok":
                c = race.curve(t[4])
                last = c["points"][-1] if c["points"] else None
                r.update(final_test_acc=c["final_test_acc"], wire=c["wire"], steps=c["steps"],
                         best_test_acc=max((pt["test_acc"] for pt in c["points"]), default=c["final_test_acc"]),
                         bytes_per_step=last["bytes"] / last["step"] if last else None,
                         bytes_total=last["bytes"] if last else None, points=c["points"])
            else:
                r["error"] = rec["error"]
        results[n] = r
    base = results.get("allreduce")
    for r in results.values():
        if base is not None and base.get("bytes_per_step") and r.get("bytes_per_step") is not None:
            r["bytes_vs_allreduce"] = r["bytes_per_step"] / base["bytes_per_step"]
            r["acc_minus_allreduce"] = r["final_test_acc"] - base["final_test_acc"]
    md = tables.modern_compare_table(results)
    doc = {"nodes": a.nodes, "model": model, "epochs": a.epochs, "tune_epochs": a.tune_epochs, "lr_factors": factors,
           "data": {"tune": val, "final": test}, "seed": a.seed, "recipe": RECIPE,
           "methods": {k: {"flags": METHODS[k][0], "base_lr": METHODS[k][1]} for k in names},
           "results": results, "provenance": record.finish()}
    prov = doc["provenance"]
    text = json.dumps(doc, indent=1) + "\n"
    for path in [out / "modern.json"] + ([Path(a.results)] if a.results else []):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    (out / "modern.md").write_text(
        f"{md}\n\nMade with `{prov['command']}` at commit {(prov['commit'] or '?')[:10]}"
        f"{' (dirty tree)' if prov['dirty'] else ''} on {prov['date']} ({a.nodes} simulated nodes, iid shards, "
        f"{a.epochs} epochs, grid {a.lr_factors} x base at {a.tune_epochs} epochs on the validation carve; load "
        f"average {prov['load_before'][0]} at the start, {prov['load_after'][0]} at the end, "
        f"{prov['machine']['cores']} cores).\n")
    print(md)
    print(f"modern_compare: wrote {out / 'modern.md'}, {out / 'modern.json'}" + (f", {a.results}" if a.results else ""))
    bad = {n: r.get("error") or r["status"] for n, r in results.items() if r.get("final_test_acc") is None}
    for n, why in bad.items():
        print(f"modern_compare: error: {n} has no final result: {why}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
