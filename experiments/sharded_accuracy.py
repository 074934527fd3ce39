#!/usr/bin/env python3
"""Accuracy of the sharded two-way exchange against the all-gathered form, same recipe.

    python -m experiments run sharded_accuracy --nodes 16 --epochs 30 --jobs 2 --out runs/sharded-accuracy \\
        --json experiments/results/sharded_accuracy.json

Trains each method on MNIST-1D with ``cnn1d``, all ``--nodes`` nodes simulated (the
vectorized path where the model allows it), with the race's recipe
(``experiments/race.py``: 30 epochs, lr 0.1, ``step`` schedule, weight decay 1e-3,
batch 32 per node, local momentum where the method has none of its own; diloco's inner
AdamW at lr 0.003), twice: once with ``--algo-opt exchange=sharded`` (the default: each
node owns 1/n of the coordinates, re-compresses their average with its own error
feedback or majority vote and all-gathers it) and once with ``exchange=allgather``
(the replicated server every run used before). ``allreduce`` (fp32, a ring all-reduce's
bytes) runs once, as the reference both are held against.

It reports the final and best test accuracy of the averaged model and the bytes each
node sent per step (the ledger's), and writes ``--json`` (default ``OUT/results.json``)
through ``experiments/_provenance.py`` (command, commit, date, machine, load) and
``results.md`` in ``--out``. Accuracy does not depend on the machine's load: the runs
are deterministic for a seed and thread count (``--jobs`` runs them in worker
processes, one thread each unless ``OMP_NUM_THREADS`` says otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from experiments import _cli, _provenance  # noqa: E402

#: name -> gossip.train flags (on top of the recipe)
METHODS: dict[str, list[str]] = {
    # the reference: fp32 ring all-reduce, 2 (n - 1)/n x 4d bytes per node per step
    "allreduce": ["--algo", "allreduce"],
    "efsgd:8": ["--algo", "efsgd", "--compressor", "quant:bits=8"],
    "efsgd-sign": ["--algo", "efsgd", "--compressor", "sign"],
    # a sign step moves every weight by lr: the recipe's 0.1 diverges (8.8 % sharded at
    # 16 nodes, 20 epochs), 0.01 is what tests/test_library_api.py gives it
    "signum": ["--algo", "signum", "--lr", "0.01"],
    "efblocksgd": ["--algo", "efblocksgd"],
    "diloco:4": ["--algo", "diloco", "--bits", "4", "--algo-opt", "error_feedback=true",
                 "--algo-opt", "local_steps=10", "--lr", "0.003"],
}
#: methods without a compressed exchange to choose (run once, exchange "fp32")
REFERENCE = ("allreduce",)
RECIPE = ["--lr", "0.1", "--lr-schedule", "step", "--weight-decay", "1e-3", "--batch-size", "32"]
EXCHANGES = ("sharded", "allgather")
#: the code whose behaviour the figures measure (the exchange's two forms); the
#: training loop is common to both forms of every method
SOURCES = _provenance.training_sources("experiments/sharded_accuracy.py", "experiments/_cli.py")  # gossip.train runs


def _train(args: list[str]) -> tuple[int, str]:
    from gossip import train

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            rc = train.main(args)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return rc, err.getvalue()


def _best(run_dir: Path) -> tuple[float | None, float | None]:
    """The best test accuracy of the averaged model over the run's evaluations, and its epoch."""
    from gossip import rundir

    evals = [r for r in rundir.read_metrics(rundir.metrics_path(run_dir, 0))
             if r.get("kind") == "eval" and "test_acc" in r]
    if not evals:
        return None, None
    best = max(evals, key=lambda r: r["test_acc"])
    return best["test_acc"], round(best["epoch"], 2)


def _run_one(name: str, exchange: str, flags: list[str], run_dir: str) -> dict:
    """Train one (method, exchange) and read its row back; raises RuntimeError with the
    run's last error line if it fails."""
    t0 = time.perf_counter()
    rc, err = _train(flags)
    if rc != 0:
        last = err.strip().splitlines()[-1] if err.strip() else ""
        raise RuntimeError(f"{name} exchange={exchange} failed (exit {rc}): {last}")
    s = json.loads((Path(run_dir) / "summary.json").read_text())
    best, best_epoch = _best(Path(run_dir))
    return {"method": name, "exchange": exchange, "final_test_acc": s["final_test_acc"], "best_test_acc": best,
            "best_epoch": best_epoch, "bytes_per_node_per_step": s["bytes_sent_per_node_per_step"],
            "steps": s["steps"], "wall_s": round(time.perf_counter() - t0, 1)}


def _run_in_child(name: str, exchange: str, flags: list[str], run_dir: str) -> dict:
    # one thread per worker process: --jobs 2 on two cores, not 2 x all of them
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return _run_one(name, exchange, flags, run_dir)


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run sharded_accuracy``."""
    _cli.add_methods(p, METHODS)
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--max-steps", type=int, default=None, help="stop early (smoke tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exchanges", default=",".join(EXCHANGES), help="comma-separated subset of sharded, allgather")
    p.add_argument("--data", default=None, help="gossip.train's --data (default: its own, MNIST-1D)")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs at a time, each in its own process with OMP_NUM_THREADS=1 unless set "
                        "(default 1: one after another in this process)")
    p.add_argument("--out", default="runs/sharded-accuracy", help="directory for the run directories")
    p.add_argument("--json", default=None, help="results file (default OUT/results.json)")


def main(argv: list[str] | None = None) -> int:
    p, a = _cli.parse(argv, options, __doc__, "sharded_accuracy")
    names = _cli.methods(p, a.methods, METHODS)
    exchanges = [e.strip() for e in a.exchanges.split(",") if e.strip()]
    if not exchanges or any(e not in EXCHANGES for e in exchanges):
        p.error(f"--exchanges: expected a subset of {', '.join(EXCHANGES)}, got {a.exchanges!r}")
    if a.nodes < 2 or a.epochs < 1 or a.jobs < 1:
        p.error(f"need --nodes >= 2, --epochs >= 1 and --jobs >= 1, got --nodes {a.nodes} --epochs {a.epochs} "
                f"--jobs {a.jobs}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prov = _provenance.start(SOURCES, argv=None if argv is None else ["experiments/sharded_accuracy.py", *argv])

    todo = []  # (name, exchange, flags, run_dir)
    for name in names:
        for exchange in ("fp32",) if name in REFERENCE else exchanges:
            run_dir = out / f"{name.replace(':', '-')}-{exchange}"
            flags = ["--simulate", str(a.nodes), "--epochs", str(a.epochs), "--seed", str(a.seed),
                     *RECIPE, *METHODS[name], "--no-progress", "--overwrite", "--out", str(run_dir)]
            if name not in REFERENCE:
                flags += ["--algo-opt", f"exchange={exchange}"]
            if a.max_steps is not None:
                flags += ["--max-steps", str(a.max_steps)]
            if a.data is not None:
                flags += ["--data", a.data]
            _provenance.record_config(flags)  # what `python -m experiments verify` witnesses
            todo.append((name, exchange, flags, str(run_dir)))

    rows: list[dict] = []
    try:
        if a.jobs == 1:
            for job in todo:
                rows.append(_run_one(*job))
                print(json.dumps(rows[-1]), flush=True)
        else:
            import concurrent.futures as cf
            import multiprocessing as mp

            with cf.ProcessPoolExecutor(a.jobs, mp_context=mp.get_context("spawn")) as pool:
                futs = [pool.submit(_run_in_child, *job) for job in todo]
                for f in cf.as_completed(futs):
                    rows.append(f.result())
                    print(json.dumps(rows[-1]), flush=True)
    except RuntimeError as e:
        print(f"sharded_accuracy: {e}", file=sys.stderr)
        return 1
    order = {(job[0], job[1]): i for i, job in enumerate(todo)}
    rows.sort(key=lambda r: order[(r["method"], r["exchange"])])

    from experiments import render

    results = {"nodes": a.nodes, "epochs": a.epochs, "seed": a.seed, "max_steps": a.max_steps,
               "data": a.data or "mnist1d", "recipe": RECIPE,
               "methods": {k: METHODS[k] for k in names}, "rows": rows}
    path = _provenance.write(a.json or out / "results.json", results, prov)
    table = render.TABLES["sharded_accuracy"].render(results)
    (out / "results.md").write_text(table + "\n")
    print(table)
    print(f"sharded_accuracy: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
