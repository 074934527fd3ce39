"""``gossip.train`` runs for the studies: in this process or in worker processes, and what they leave, read back.

The shared run helpers of the experiments, as public names of one module: the study
runner (experiments/study.py), the race and the scripts that train a few
configurations (diloco_eager) use them::

    rc, err = training.train_in_process(args)           # exit code and stderr
    best, epoch = training.best_test_acc(run_dir)        # over the run's evaluations
    rows = training.run_all(run_one, todo, jobs=2)       # todo: argument tuples of run_one

``run_all`` runs ``run_one(*args)`` for every tuple, one after another in this process
(``jobs=1``) or ``jobs`` at a time in spawned worker processes, each with one thread
unless ``OMP_NUM_THREADS`` says otherwise; ``run_one`` must be a module-level function
(a worker imports it). The runs are deterministic for a seed and thread count, so the
figures do not depend on ``jobs``; their wall clock does.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from typing import Callable, Iterable, Sequence

__all__ = ["train_in_process", "best_test_acc", "summary_row", "run_all"]


def train_in_process(args: Sequence[str]) -> tuple[int, str]:
    """``gossip.train ARGS`` in this process, its output swallowed; its exit code and stderr."""
    from gossip import train

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            rc = train.main(list(args))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return rc, err.getvalue()


def best_test_acc(run_dir: str | Path) -> tuple[float | None, float | None]:
    """The best test accuracy of the averaged model over the run's evaluations, and its
    epoch (rounded to 2 places); ``(None, None)`` when it has none."""
    from gossip import rundir

    evals = [r for r in rundir.read_metrics(rundir.metrics_path(Path(run_dir), 0))
             if r.get("kind") == "eval" and "test_acc" in r]
    if not evals:
        return None, None
    best = max(evals, key=lambda r: r["test_acc"])
    return best["test_acc"], round(best["epoch"], 2)


def summary_row(run_dir: str | Path) -> dict:
    """A finished run's figures: final and best test accuracy (with the best's epoch),
    bytes sent per node per step and steps, from its ``summary.json`` and metrics."""
    from gossip import rundir

    s = rundir.read_json(rundir.summary_path(Path(run_dir)))
    best, best_epoch = best_test_acc(run_dir)
    return {"final_test_acc": s["final_test_acc"], "best_test_acc": best, "best_epoch": best_epoch,
            "bytes_per_node_per_step": s["bytes_sent_per_node_per_step"], "steps": s["steps"]}


def _in_worker(run_one: Callable[..., dict], args: tuple) -> dict:
    # one thread per worker process: --jobs 2 on two cores, not 2 x all of them
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return run_one(*args)


def run_all(run_one: Callable[..., dict], todo: Iterable[tuple], jobs: int = 1,
            on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """``run_one(*args)`` for every ``args`` of ``todo``: in this process when ``jobs``
    is 1, else ``jobs`` at a time in spawned workers (one thread each unless
    ``OMP_NUM_THREADS`` is set). The rows in the order of ``todo``; ``on_row(row)`` as
    each finishes. An exception of a run stops the rest and is raised here."""
    todo = list(todo)
    if jobs <= 1:
        rows = []
        for args in todo:
            rows.append(run_one(*args))
            if on_row is not None:
                on_row(rows[-1])
        return rows
    import concurrent.futures as cf
    import multiprocessing as mp

    with cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
        futs = {pool.submit(_in_worker, run_one, args): i for i, args in enumerate(todo)}
        done: dict[int, dict] = {}
        for f in cf.as_completed(futs):
            done[futs[f]] = f.result()
            if on_row is not None:
                on_row(done[futs[f]])
    return [done[i] for i in range(len(todo))]
