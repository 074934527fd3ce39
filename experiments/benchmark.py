#!/usr/bin/env python3
"""The neutral benchmark: every method tuned on the same budget, several seeds, per link and node count.

    python -m experiments.benchmark run --spec experiments/benchmark.toml --out runs/bench --jobs 2
    python -m experiments.benchmark report --results runs/bench/benchmark.json --md runs/bench/report.md
    python -m experiments.benchmark plan --spec experiments/benchmark.toml      # what would run
    python -m experiments.benchmark collect --spec S --out DIR                  # results from run dirs only

``run`` is resumable: a trial whose run directory holds its record (``trial.json``, with
the trial's figures) is never redone, so an interrupted benchmark continues where it
stopped, and widening the spec (another seed, another method) runs only what is new.
``--resume RESULTS`` takes the trials of an earlier session's results file as finished,
so a session on another machine continues from that file alone; ``--workloads``,
``--nodes`` and ``--methods`` run a part of the spec under the same protocol;
``--stop-after`` and SIGTERM stop it with what finished kept. The spec is checked whole
before the first trial (``experiments/bench_spec.py``): a bad field is one line naming the
file and the field, exit 2, nothing run.

The protocol, fixed before any result is read (each report page states it too):

1. **Tuning, the same budget for everyone.** Each method gets the same number of trial
   runs: its learning rate on a grid of ``lr_factors`` times its paper's (or the
   project's documented) default, at a short horizon (``tune_epochs``), seed
   ``tune_seed``. Every other option keeps the method's paper default. The trials train
   on the training data less a validation carve and are evaluated on that carve
   (``experiments/bench_data.py``: 10 % of the samples for a classifier; for text, the
   block of the training text just before the test tail): the test split is never
   handed to a tuning run.
2. **Selection** on the validation metric at the end of the short horizon (higher
   accuracy, or lower loss or bits per byte), ties to the smaller learning rate. A
   trial that fails or diverges ranks last.
3. **Final runs** of the selected setting with every seed in ``seeds``, on the whole
   training data, evaluated on the test split. They start as soon as the method's own
   tuning has finished.
4. **What is reported**, per workload, node count and link (bandwidth x latency): time
   to the target, modelled from each run's own bytes, message rounds and measured
   compute and codec time as ``experiments/race.py`` does (a ring all-reduce is
   2(n - 1) rounds, a neighbour exchange 1); bytes per node to the target; the final
   metric; the mean and a 95 % Student-t interval over the seeds. A method is ranked
   at a link only if every seed reached the target. The verdict names the fastest, the
   second, the margin, and whether the lead is larger than the intervals (the winner's
   upper bound below the second's lower bound).
5. **Budget**: the runs, steps and CPU seconds spent per method, tuning and final
   apart, are recorded and shown.

Every node count trains on the same data per node: ``samples_per_node x nodes``
training samples (MNIST-1D is generated with that many; 4,000 at 4 nodes is the
embedded default data set; text windows are spread over the corpus's training text).

Output under ``--out``: one run directory per trial
(``<workload>/n<N>/<method>/tune-lr<LR>`` and ``.../seed<S>``, ordinary gossip run
directories, each with the driver's ``trial.json``), and the results file
(``--results``, default ``OUT/benchmark.json``): every finished trial's record and
figures, the selection, the per-link statistics, the verdicts, the budget, the sessions
it was made in and the provenance. ``report`` reads that file alone and writes the
Markdown page and the figures (metric against bytes and against modelled time per link).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

from experiments import _provenance
from experiments import tables
from experiments import bench_data
from experiments.bench_spec import METRICS, Method, Spec, SpecError, Workload, check_trials, load_spec
from gossip import rundir  # noqa: E402
from gossip.tools import crossover, leaderboard  # noqa: E402

__all__ = ["Spec", "Workload", "Method", "SOURCES", "METRICS", "load_spec", "plan", "run", "collect", "analyse",
           "report", "figure_paths", "read_results", "read_benchmark_results", "estimate", "main"]

_TRIAL = "trial.json"
# ``race`` (the modelled time, the training runs) imports torch and the training code, seconds
# of imports: the functions that use it import it, so that a spec is checked and refused first


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Trial:
    workload: Workload
    nodes: int
    method: Method
    stage: str  # "tune" or "final"
    lr: float | None  # None: the tuning's selection, known once the tuning has run
    seed: int

    @property
    def group(self) -> str:
        """The method at one workload and node count: the trials one selection covers."""
        return f"{self.workload.name}/n{self.nodes}/{self.method.name.replace(':', '-')}"

    @property
    def key(self) -> str:
        """The trial's name in the results file: its run directory below ``--out``."""
        return f"{self.group}/tune-lr{self.lr:.4g}" if self.stage == "tune" else f"{self.group}/seed{self.seed}"

    def run_dir(self, out: Path, lr: float | None = None) -> Path:
        return out / self.key


def _methods_at(spec: Spec, n: int) -> list[Method]:
    return [m for m in spec.methods if m.max_nodes is None or n <= m.max_nodes]


def plan(spec: Spec, *, workloads: Sequence[str] | None = None, nodes: Sequence[int] | None = None,
         methods: Sequence[str] | None = None) -> list[Trial]:
    """Every trial the spec asks for, method by method: its grid, then its seeds;
    ``workloads``, ``nodes`` and ``methods`` keep only those named (a subset of the
    same protocol: each kept method still gets its whole grid and every seed)."""
    trials = []
    for wl in spec.workloads:
        if workloads and wl.name not in workloads:
            continue
        for n in wl.nodes:
            if nodes and n not in nodes:
                continue
            for m in _methods_at(spec, n):
                if methods and m.name not in methods:
                    continue
                trials += [Trial(wl, n, m, "tune", round(m.lr * f, 10), spec.tune_seed) for f in spec.lr_factors]
                trials += [Trial(wl, n, m, "final", None, s) for s in spec.seeds]
    return trials


def _check_trials(spec: Spec, out: Path) -> None:
    """Every method's trial arguments (a tuning trial's and a final one's) parsed by
    gossip.train before the first trial (:func:`bench_spec.check_trials`)."""
    def argvs(wl: Workload, n: int, m: Method):
        for t in (Trial(wl, n, m, "tune", m.lr, spec.tune_seed), Trial(wl, n, m, "final", None, spec.seeds[0])):
            yield _train_args(t, m.lr, t.run_dir(out), spec.device)

    check_trials(spec, argvs)


def parameter_counts(spec: Spec) -> dict[str, int]:
    """Each workload's model's parameter count, as its trials build it (the recipe's and the
    size knob's model options included), built on torch's meta device: no memory is
    allocated, so a model sized for a GPU is counted on any machine."""
    import torch

    from gossip import models
    from gossip.train import config as _config

    out = {}
    for wl in spec.workloads:
        t = Trial(wl, wl.nodes[0], spec.methods[0], "final", None, spec.seeds[0])
        cfg = _config.parse_args(_train_args(t, spec.methods[0].lr, Path("OUT"), spec.device))
        if wl.task == "lm":
            from gossip.data import text as textdata

            shape, classes = (int(wl.context),), textdata.VOCAB_SIZE
        else:
            ds = bench_data.build(wl.data, wl.samples_per_node * min(wl.nodes), "test")
            shape, classes = tuple(ds.input_shape), ds.num_classes
        with torch.device("meta"):
            model = models.build_model(cfg.model_name, input_shape=shape, num_classes=classes,
                                       **dict(cfg.model.options))
        out[wl.name] = sum(p.numel() for p in model.parameters())
    return out


def _train_args(t: Trial, lr: float, run_dir: Path, device: str = "cpu") -> list[str]:
    wl = t.workload
    role = "val" if t.stage == "tune" else "test"
    epochs = wl.tune_epochs if t.stage == "tune" else wl.epochs
    data = bench_data.dataset_name(wl.data, wl.samples_per_node * t.nodes, role, wl.context)
    return ["--simulate", str(t.nodes), "--data", data, "--model", wl.model, "--epochs", str(epochs),
            "--batch-size", str(wl.batch_size), *wl.recipe, *wl.model_flags, *t.method.run_flags, "--lr", f"{lr:g}",
            "--seed", str(t.seed), "--device", device, "--log-every", "1", "--no-progress", "--overwrite",
            *_UNREAD, "--out", str(run_dir)]


#: flags that only skip work whose figures the benchmark never reads: each node's own
#: accuracy at every epoch's end (16 models evaluated besides the average at 16 nodes,
#: a fifth to a third of a tuning trial's CPU time). Every figure it reads stays the same
#: bit for bit, so a trial run with or without them stands for the other (``_protocol_args``)
_UNREAD = ("--no-node-eval",)


def _protocol_args(args: Sequence[str]) -> list[str]:
    """A trial's gossip.train arguments less where it wrote (``--out``), the flags of
    :data:`_UNREAD` and, for records made before the benchmark pinned it, ``--device cpu``:
    what must match for a finished trial to stand for the one the spec asks for."""
    out, skip = [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a in _UNREAD:
            continue
        if a == "--out" or (a == "--device" and i + 1 < len(args) and args[i + 1] == "cpu"):
            skip = True
            continue
        out.append(a)
    return out


def _r(x: float | None, digits: int = 5) -> float | None:
    return None if x is None else float(f"{x:.{digits}g}")


def _result(run_dir: Path, metric: str) -> dict:
    """A finished run's figures, compact: what the analysis and the report need, so
    that the results file stands without the run directories."""
    from experiments import race

    c = race.curve(run_dir)
    summary = rundir.read_json(rundir.summary_path(run_dir))
    evals = {r["step"]: r for r in rundir.read_metrics(rundir.metrics_path(run_dir, 0)) if r["kind"] == "eval"}
    pts = c["points"]
    return {
        "final": {k: _r(v) for k, v in summary.items() if k.startswith("final_") and isinstance(v, (int, float))},
        "params": summary.get("params"), "wire": c["wire"]["label"], "world_size": c["world_size"],
        "calls_per_step": {k: _r(v) for k, v in c["calls_per_step"].items()},
        "bytes_per_node": summary.get("bytes_sent_per_node_total"),
        # one column per figure, one entry per evaluation (the end of each epoch)
        "curve": {"step": [p["step"] for p in pts], "metric": [_r(evals[p["step"]].get(metric)) for p in pts],
                  "bytes": [int(p["bytes"]) for p in pts], "compute_s": [_r(p["compute_s"], 6) for p in pts],
                  "codec_s": [_r(p["codec_s"], 6) for p in pts]},
    }


def _finished(run_dir: Path, metric: str, args: Sequence[str] | None = None) -> dict | None:
    """The record of a finished trial in ``run_dir`` (with its compact ``result``), else
    None; with ``args``, only if it ran those (less ``--out``)."""
    try:
        rec = rundir.read_json(run_dir / _TRIAL)
    except Exception:  # noqa: BLE001 - absent or unreadable: not finished
        return None
    if args is not None and _protocol_args(rec.get("args", [])) != _protocol_args(args):
        return None
    if rec.get("status") == "failed" or "result" in rec:
        return rec
    try:  # a record written before records held their figures: read them from the run
        summary = rundir.read_json(rundir.summary_path(run_dir))
        if summary.get(f"final_{metric}") is None:
            return None
        rec["result"] = _result(run_dir, metric)
    except Exception:  # noqa: BLE001 - the run directory is incomplete: not finished
        return None
    return rec


def _run_trial(t: Trial, lr: float, out: Path, device: str = "cpu") -> dict:
    from experiments import training

    run_dir = t.run_dir(out)
    args = _train_args(t, lr, run_dir, device)
    served = len(bench_data.SERVED)
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    cpu0, wall0 = time.process_time(), time.perf_counter()
    rc, err = training.train_in_process(args)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if rc in (130, 128 + 15):  # interrupted or SIGTERM: the trial did not fail, it was stopped; no record
        raise _Stop()
    what = bench_data.SERVED[served:] if len(bench_data.SERVED) > served else [None]
    rec = {"key": t.key, "workload": t.workload.name, "nodes": t.nodes, "method": t.method.name, "stage": t.stage,
           "lr": lr, "seed": t.seed, "args": args, "cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
           # the 1-minute load before and after: a CPU-time figure from a crowded machine is inflated
           "load": [None if x is None else round(x, 2) for x in (load0, load1)], "data": what[-1], "status": "ok" if rc == 0 else "failed",
           "error": None if rc == 0 else (err.strip().splitlines() or ["?"])[-1]}
    if rc == 0:
        try:
            rec["result"] = _result(run_dir, t.workload.metric)
            rec["steps"] = rundir.read_json(rundir.summary_path(run_dir)).get("steps")
        except Exception as e:  # noqa: BLE001 - a run that ended without its figures failed
            rec.update(status="failed", error=f"no figures in the run directory ({type(e).__name__}: {e})", steps=0)
    else:
        rec["steps"] = 0
        run_dir.mkdir(parents=True, exist_ok=True)
    rundir.write_json(run_dir / _TRIAL, rec)
    return rec


def _score(rec: dict | None, metric: str) -> float | None:
    if rec is None or rec.get("status") != "ok":
        return None
    v = (rec.get("result") or {}).get("final", {}).get(f"final_{metric}")
    return v if v is not None and math.isfinite(v) else None


class NotRun(LookupError):
    """A method whose tuning has not (all) run yet: ``trial``, the first tuning trial it
    waits for (an extension of the grid included), and ``done``, those finished so far."""

    def __init__(self, message: str, trial: Trial | None = None, done: Sequence[tuple[Trial, dict]] = ()) -> None:
        super().__init__(message)
        self.trial = trial
        self.done = list(done)


#: the factor each extension of a grid whose pick lies at its edge moves the rate by
GRID_FACTOR = 2.0


def _pick(scores: Sequence[dict], higher: bool) -> dict | None:
    """The selected tuning score: the best validation metric, ties to the smaller rate."""
    ok = [x for x in scores if x["validation"] is not None]
    if not ok:
        return None
    sign = 1.0 if higher else -1.0
    return max(ok, key=lambda x: (sign * x["validation"], -x["lr"]))


def next_rate(scores: Sequence[dict], higher: bool, base: int, extensions: int) -> tuple[float | None, str]:
    """The grid's closing rule. ``scores``: the tuning trials run so far (``lr`` and
    ``validation``, None where the trial failed or diverged), the ``base`` first the spec's
    grid; ``extensions``: how many rates may be added. While the pick (:func:`_pick`) is
    the smallest or largest rate tried, the next rate beyond it (a factor
    :data:`GRID_FACTOR` further) is tried; the grid is closed once the pick is interior,
    when the rate beyond it diverged, or when the extensions are spent. Returns
    ``(rate to try, "")`` or ``(None, why the grid is closed)``."""
    best = _pick(scores, higher)
    if best is None:
        return None, "every tuning trial failed"
    lo, hi = min(x["lr"] for x in scores), max(x["lr"] for x in scores)
    below = [x for x in scores if x["lr"] < best["lr"]]
    above = [x for x in scores if x["lr"] > best["lr"]]
    if below and above:
        near = (max(below, key=lambda x: x["lr"]), min(above, key=lambda x: x["lr"]))
        return None, "the next rate diverged" if any(x["validation"] is None for x in near) else "interior"
    if len(scores) - base >= extensions:
        return None, f"at the edge after {len(scores) - base} extension(s): the limit" if extensions else \
            "at the edge: the spec allows no extension"
    if best["lr"] == lo:
        return round(lo / GRID_FACTOR, 10), ""
    return round(hi * GRID_FACTOR, 10), ""


def _tuning(spec: Spec, wl: Workload, n: int, m: Method, get) -> tuple[dict, list[dict], list[tuple[Trial, dict]], str]:
    """A method's tuning at one workload and node count, its grid closed (:func:`next_rate`):
    ``get(trial)`` is a finished trial's record or None. Returns the selected score, every
    score (``extension`` marks a rate the closing added), the trials with their records and
    why the grid is closed. NotRun while a trial (the spec's or an extension) is to run;
    RuntimeError if every one failed."""
    base = [Trial(wl, n, m, "tune", round(m.lr * f, 10), spec.tune_seed) for f in spec.lr_factors]
    done: list[tuple[Trial, dict]] = []
    scores: list[dict] = []
    for t in base:
        rec = get(t)
        if rec is None:
            raise NotRun(f"the tuning of {m.name} at n={n} on {wl.name} has not finished", t, done)
        done.append((t, rec))
        scores.append({"lr": t.lr, "validation": _score(rec, wl.metric)})
    while True:
        lr, why = next_rate(scores, wl.higher_is_better, len(base), spec.grid_extensions)
        if lr is None:
            break
        t = Trial(wl, n, m, "tune", lr, spec.tune_seed)
        rec = get(t)
        if rec is None:
            raise NotRun(f"the tuning of {m.name} at n={n} on {wl.name} extends its grid to lr={lr:g}", t, done)
        done.append((t, rec))
        scores.append({"lr": lr, "validation": _score(rec, wl.metric), "extension": True})
    best = _pick(scores, wl.higher_is_better)
    if best is None:
        raise RuntimeError(f"benchmark: every tuning trial of {m.name} at n={n} on {wl.name} failed")
    return best, scores, done, why


def _selected_lr(spec: Spec, wl: Workload, n: int, m: Method, out: Path) -> tuple[float, list[dict]]:
    """The learning rate the tuning selected, with the tuning trials' scores. NotRun
    while a tuning trial is unfinished; RuntimeError if every one failed."""
    def get(t: Trial) -> dict | None:
        return _finished(t.run_dir(out), wl.metric, _train_args(t, t.lr, t.run_dir(out), spec.device))

    best, scores, _, _ = _tuning(spec, wl, n, m, get)
    return best["lr"], scores


def _import_records(paths: Sequence[Path], out: Path, log=print) -> list[dict]:
    """Trials finished elsewhere (the ``trials`` of earlier results files) written into
    ``out`` as finished trials, where ``out`` has none of its own; returns the
    provenance records of those files (the sessions the results were made in)."""
    sessions = []
    for path in paths:
        try:
            res, prov = _provenance.read(path)
        except (OSError, ValueError) as e:
            raise SpecError(f"--resume {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
        trials = res.get("trials") if isinstance(res, dict) else None
        if not isinstance(trials, list):
            raise SpecError(f"--resume {path}: not a benchmark results file with its trials (no 'trials' list)")
        sessions += [*res.get("sessions", []), prov]
        added = 0
        for rec in trials:
            key = rec.get("key", "")
            if not key or ".." in Path(key).parts or Path(key).is_absolute():
                raise SpecError(f"--resume {path}: a trial with no usable key ({key!r})")
            rd = out / key
            if _finished(rd, "", None) is None:
                rd.mkdir(parents=True, exist_ok=True)
                rundir.write_json(rd / _TRIAL, {**rec, "imported_from": path.name})
                added += 1
        log(f"benchmark: {added} finished trials taken from {path} ({len(trials) - added} already here)")
    return sessions


def _trial_in_child(t: Trial, lr: float, out: Path, device: str) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return _run_trial(t, lr, out, device)


class _Stop(Exception):
    """SIGTERM (a ``timeout`` running out): stop, keep what finished, write the results."""


def run(spec: Spec, out: Path, *, jobs: int = 1, log=print, stop_after: float | None = None,
        workloads: Sequence[str] | None = None, nodes: Sequence[int] | None = None,
        methods: Sequence[str] | None = None) -> dict:
    """Run every trial not yet finished, ``jobs`` at a time in worker processes (1: in
    this process). A method's final runs start as soon as its own tuning has finished
    (they need its selection), so methods complete one after another and an
    interrupted run leaves whole methods. With ``stop_after`` (seconds), no trial
    starts after that time; on SIGTERM the running trials are abandoned. Either way
    what finished is kept and a re-run goes on from there.
    Returns {"ran": k, "skipped": k, "failed": k, "left": k, "stopped": whether SIGTERM stopped it}."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    counts = {"ran": 0, "skipped": 0, "failed": 0, "left": 0, "stopped": False}
    todo: list[Trial] = []
    for t in plan(spec, workloads=workloads, nodes=nodes, methods=methods):
        if t.stage == "tune" and _finished(t.run_dir(out), t.workload.metric,
                                           _train_args(t, t.lr, t.run_dir(out), spec.device)) is not None:
            counts["skipped"] += 1
        else:
            todo.append(t)

    selected: dict[str, float | None] = {}  # a group's selection, once its tuning has finished
    extended: list[Trial] = []  # the tuning trials that closing a grid added

    def ready(t: Trial, running: Sequence[Trial]) -> float | None | bool:
        """The trial's learning rate if it can start now; False if it must wait; None if
        it is finished (or can never run: its whole tuning failed). A final trial whose
        tuning must extend its grid queues the extension's trial and waits for it."""
        if t.stage == "tune":
            return t.lr
        if t.group not in selected:
            try:
                selected[t.group] = _selected_lr(spec, t.workload, t.nodes, t.method, out)[0]
            except NotRun as e:
                x = e.trial
                if x is not None and not any(y.key == x.key for y in [*todo, *running]):
                    todo.insert(0, x)  # an extension of the grid: run it before the finals wait on it
                    extended.append(x)
                return False
            except RuntimeError:
                selected[t.group] = None
        lr = selected[t.group]
        if lr is None:
            return None
        if _finished(t.run_dir(out), t.workload.metric, _train_args(t, lr, t.run_dir(out), spec.device)) is not None:
            counts["skipped"] += 1
            return None
        return lr

    def note(t: Trial, lr: float, rec: dict) -> None:
        counts["ran"] += 1
        counts["failed"] += rec["status"] != "ok"
        log(f"benchmark: [{counts['ran']}] {t.workload.name} n={t.nodes} {t.method.name} {t.stage} lr={lr:g} "
            f"seed={t.seed}: {rec['status']} in {rec['wall_s']:.1f} s"
            + (f" ({rec['error']})" if rec["error"] else ""), flush=True)

    def late() -> bool:
        return stop_after is not None and time.perf_counter() - t0 >= stop_after

    def next_ready(running: list[Trial]) -> tuple[Trial, float] | None:
        while True:  # again when a final trial queued an extension of its grid
            tuning = {t.group for t in [*todo, *running] if t.stage == "tune"}
            queued = len(extended)
            for t in list(todo):
                if t.stage == "final" and t.group in tuning:
                    continue  # its tuning is still to run or running
                lr = ready(t, running)
                if lr is None:
                    todo.remove(t)
                elif lr is not False:
                    todo.remove(t)
                    return t, lr
            if len(extended) == queued:
                return None

    import signal

    def on_term(signum, frame):  # noqa: ARG001
        raise _Stop()

    old = signal.signal(signal.SIGTERM, on_term) if threading_main() else None
    try:
        if jobs <= 1:
            while todo and not late():
                nxt = next_ready([])
                if nxt is None:
                    break
                note(*nxt, _run_trial(*nxt, out, spec.device))
        else:
            import concurrent.futures as cf
            import multiprocessing as mp

            pool = cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"))
            futs: dict[Any, tuple[Trial, float]] = {}
            try:
                while True:
                    while len(futs) < jobs and not late():
                        nxt = next_ready([t for t, _ in futs.values()])
                        if nxt is None:
                            break
                        futs[pool.submit(_trial_in_child, *nxt, out, spec.device)] = nxt
                    if not futs:
                        break
                    done, _ = cf.wait(futs, return_when=cf.FIRST_COMPLETED)
                    for f in done:
                        t, lr = futs.pop(f)
                        note(t, lr, f.result())
            except (_Stop, KeyboardInterrupt, cf.process.BrokenProcessPool):
                log(f"benchmark: stopped with {len(futs)} trials running (run again next time); what finished "
                    "is kept", flush=True)
                for proc in list(getattr(pool, "_processes", {}).values()):
                    proc.kill()  # abandoned: their run directories hold no record, so they run again
                pool.shutdown(wait=False, cancel_futures=True)
                counts["left"] += len(futs)
                raise _Stop() from None
            pool.shutdown(wait=True)
    except _Stop:
        counts["stopped"] = True
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    counts["left"] += len(todo)
    return counts


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


# ----------------------------------------------------------------------------- analysis


def _t95(k: int) -> float:
    """The two-sided 95 % Student-t quantile for k samples (k - 1 degrees of freedom)."""
    from scipy import stats

    return float(stats.t.ppf(0.975, k - 1)) if k > 1 else float("inf")


def mean_ci(xs: list[float]) -> dict:
    k = len(xs)
    m = sum(xs) / k
    if k == 1:
        return {"mean": m, "lo": None, "hi": None, "n": 1}
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (k - 1))
    h = _t95(k) * sd / math.sqrt(k)
    return {"mean": m, "lo": m - h, "hi": m + h, "n": k}


def _points(result: dict) -> list[dict]:
    """A compact result's curve as one dict per evaluation."""
    c = result["curve"]
    return [dict(zip(c, vals)) for vals in zip(*c.values())]


def _reached(value: float | None, target: float, higher: bool) -> bool:
    if value is None or not math.isfinite(value):
        return False
    return value >= target if higher else value <= target


@dataclass(frozen=True)
class Goal:
    """What a run is judged against: a workload's target, its metric and direction, and how
    far below the target (above, for a lower-is-better metric) its final value may end and
    still hold it (:attr:`Workload.hold_tolerance`)."""

    target: float
    metric: str
    higher_is_better: bool
    hold_tolerance: float = 0.005

    @classmethod
    def of(cls, w: dict) -> "Goal":
        """A results file's workload entry (files written before the tolerance was a
        spec key are judged with the default)."""
        return cls(w["target"], w["metric"], w.get("higher_is_better", "acc" in w["metric"]),
                   w.get("hold_tolerance", Workload.hold_tolerance))


def final_metric(result: dict, metric: str) -> float | None:
    """A run's final metric: its summary's, else its last evaluation's."""
    v = (result.get("final") or {}).get(f"final_{metric}")
    if v is None:
        pts = _points(result) if result.get("curve") else []
        v = pts[-1]["metric"] if pts else None
    return v if v is not None and math.isfinite(v) else None


def holds(result: dict, goal) -> bool:
    """Whether the run ends holding the target: its final metric at or above the target
    less the tolerance (at or below it plus the tolerance, for a lower-is-better metric)."""
    v = final_metric(result, goal.metric)
    if v is None:
        return False
    tol = goal.hold_tolerance
    return v >= goal.target - tol if goal.higher_is_better else v <= goal.target + tol


def _to_target(result: dict, wl, bw: float, lat: float, slowest: float = 1.0,
               held: bool = True) -> tuple[float | None, float | None]:
    """Modelled time and bytes to the target at a link: the first evaluation that crosses
    it, of a run that holds it (``held``; False: of any run that ever crossed it, the
    criterion of the results made before); ``slowest``: the compute time's multiplier (a
    straggler setting's slowest node, whom every synchronous step waits for)."""
    from experiments import race

    if held and not holds(result, wl):
        return None, None
    for p in _points(result):
        if _reached(p["metric"], wl.target, wl.higher_is_better):
            if slowest != 1.0:
                p = {**p, "compute_s": p["compute_s"] * slowest}
            return race.modelled_time(p, result["calls_per_step"], result["world_size"], bw, lat), p["bytes"]
    return None, None


def _seed_links(result: dict, goal, links: list) -> dict:
    """A run's time and bytes to the target at every link, by both criteria: held
    (``time_s``, ``bytes``) and ever crossed (``time_crossed_s``, ``bytes_crossed``)."""
    keep = holds(result, goal)
    out = {}
    for blabel, bw, llabel, lat in links:
        t_s, by = _to_target(result, goal, bw, lat, held=False)
        out[f"{blabel}@{llabel}"] = {"time_s": t_s if keep else None, "bytes": by if keep else None,
                                     "time_crossed_s": t_s, "bytes_crossed": by}
    return out


def _link_stats(seeds: dict, links: list, n_seeds: int, crossed: bool = False) -> dict:
    """Per link: how many seeds reached the target (by the criterion), whether all the
    protocol's did, and the mean and interval of their times and bytes."""
    tk, bk = ("time_crossed_s", "bytes_crossed") if crossed else ("time_s", "bytes")
    stats = {}
    for blabel, _, llabel, _ in links:
        key = f"{blabel}@{llabel}"
        reached = [v["links"][key][tk] for v in seeds.values() if v["links"][key].get(tk) is not None]
        byts = [v["links"][key][bk] for v in seeds.values() if v["links"][key].get(bk) is not None]
        stats[key] = {"reached": f"{len(reached)}/{n_seeds}", "all_reached": len(reached) == n_seeds,
                      "time_s": mean_ci(reached) if reached else None, "bytes": mean_ci(byts) if byts else None}
    return stats


def _straggler_verdicts(settings: Sequence[str], goal, n: int, methods: dict, links: list, n_seeds: int,
                        result_of) -> dict:
    """For each straggler setting at ``n`` nodes: its slowest multiplier, each method's time
    to target per link (every seed's compute slowed by it; runs that hold the target) and the
    verdicts. ``result_of(seed entry)``: that seed's compact result."""
    from gossip import speeds

    out = {}
    for setting in settings:
        slowest = float(speeds.parse(setting, n).multipliers.max())
        slowed = {}
        for name, r in methods.items():
            if "seeds" not in r:
                continue
            stats = {}
            results = [result_of(sd) for sd in r["seeds"].values()]
            for blabel, bw, llabel, lat in links:
                key = f"{blabel}@{llabel}"
                times = [_to_target(x, goal, bw, lat, slowest)[0] for x in results if x is not None]
                reached = [x for x in times if x is not None]
                stats[key] = {"reached": f"{len(reached)}/{n_seeds}", "all_reached": len(reached) == n_seeds,
                              "time_s": mean_ci(reached) if reached else None}
            slowed[name] = {"links": stats}
        out[setting] = {"slowest": slowest, "methods": slowed, "verdicts": _verdicts(slowed, links)}
    return out


def collect(spec: Spec, out: Path) -> list[dict]:
    """The records of the spec's finished trials under ``out`` (the tuning trials, the
    grid's extensions included, and the final runs of the learning rate their tuning
    selected), in the plan's order."""
    recs = []

    def add(t: Trial, rec: dict | None) -> None:
        if rec is not None:
            rec = {k: v for k, v in rec.items() if k != "imported_from"}
            # where it wrote is this machine's business, not the trial's (the key names the trial)
            args = rec.get("args", [])
            rec["args"] = [a for i, a in enumerate(args) if a != "--out" and (i == 0 or args[i - 1] != "--out")]
            recs.append({**rec, "key": t.key})

    for wl in spec.workloads:
        for n in wl.nodes:
            for m in _methods_at(spec, n):
                def get(t: Trial) -> dict | None:
                    return _finished(t.run_dir(out), wl.metric, _train_args(t, t.lr, t.run_dir(out), spec.device))

                try:
                    best, _, done, _ = _tuning(spec, wl, n, m, get)
                except NotRun as e:
                    for t, rec in e.done:
                        add(t, rec)
                    base = {round(m.lr * f, 10) for f in spec.lr_factors}
                    for f in spec.lr_factors:  # the spec's grid past the first unfinished trial
                        t = Trial(wl, n, m, "tune", round(m.lr * f, 10), spec.tune_seed)
                        if all(t.key != d.key for d, _ in e.done) and t.lr in base:
                            add(t, get(t))
                    continue
                except RuntimeError:
                    done, best = [], None
                    for f in spec.lr_factors:
                        t = Trial(wl, n, m, "tune", round(m.lr * f, 10), spec.tune_seed)
                        done.append((t, get(t)))
                for t, rec in done:
                    add(t, rec)
                if best is None:
                    continue
                for sd in spec.seeds:
                    t = Trial(wl, n, m, "final", None, sd)
                    add(t, _finished(t.run_dir(out), wl.metric, _train_args(t, best["lr"], t.run_dir(out), spec.device)))
    return recs


def analyse(spec: Spec, trials: Sequence[dict]) -> dict:
    """Selection, per-link statistics and verdicts from the trials' records alone (what
    :func:`collect` returns, or the ``trials`` of a results file). A method whose
    tuning has not all run is left out; one whose every tuning trial failed is listed
    with that error."""
    by_key = {r["key"]: r for r in trials}
    links = [(b, crossover.parse_rate(b), lat, crossover.parse_time(lat))
             for b in spec.bandwidths for lat in spec.latencies]
    result: dict[str, Any] = {"workloads": {}}
    for wl in spec.workloads:
        per_n = {}
        for n in wl.nodes:
            methods, complete = {}, []
            for m in _methods_at(spec, n):
                try:
                    best, scores, tuned, closed = _tuning(spec, wl, n, m, lambda t: by_key.get(t.key))
                except NotRun:
                    continue  # not (all) run: no selection yet
                except RuntimeError:
                    scores = [{"lr": t.lr, "validation": None} for t in
                              (Trial(wl, n, m, "tune", round(m.lr * f, 10), spec.tune_seed) for f in spec.lr_factors)]
                    methods[m.name] = {"error": f"every tuning trial of {m.name} at n={n} on {wl.name} failed",
                                       "tuning": scores}
                    continue
                lr = best["lr"]
                budget = {"tune": {"runs": 0, "steps": 0, "cpu_s": 0.0}, "final": {"runs": 0, "steps": 0, "cpu_s": 0.0}}
                finals = [Trial(wl, n, m, "final", None, sd) for sd in spec.seeds]
                if all(t.key in by_key for t in finals):
                    complete.append(m.name)
                for t in [t for t, _ in tuned] + finals:
                    rec = by_key.get(t.key)
                    if rec is None or (t.stage == "final" and rec.get("lr") != lr):
                        continue
                    bud = budget[t.stage]
                    bud["runs"] += 1
                    bud["steps"] += rec.get("steps") or 0
                    bud["cpu_s"] = round(bud["cpu_s"] + rec.get("cpu_s", 0.0), 3)
                seeds = {}
                for t in finals:
                    rec = by_key.get(t.key)
                    if rec is None or rec["status"] != "ok" or rec.get("lr") != lr:
                        continue
                    res = rec["result"]
                    seeds[str(t.seed)] = {"trial": t.key, "final": _score(rec, wl.metric), "wire": res["wire"],
                                          "params": res["params"], "holds": holds(res, wl),
                                          "links": _seed_links(res, wl, links)}
                failed = [t.seed for t in finals if by_key.get(t.key, {}).get("status") == "failed"]
                finals_ok = [v["final"] for v in seeds.values() if v["final"] is not None]
                methods[m.name] = {"lr": lr, "tuning": scores, "grid": {"closed": closed,
                                                                        "extensions": [x["lr"] for x in scores
                                                                                       if x.get("extension")]},
                                   "seeds": seeds, "links": _link_stats(seeds, links, len(spec.seeds)),
                                   "links_crossed": _link_stats(seeds, links, len(spec.seeds), crossed=True),
                                   "final": mean_ci(finals_ok) if finals_ok else None, "budget": budget,
                                   "seeds_run": f"{len(seeds)}/{len(spec.seeds)}", "seeds_failed": failed,
                                   "flags": list(m.run_flags), "source": m.source,
                                   "overrides": {k: {"value": v, "reason": why} for k, v, why in m.overrides},
                                   "wire": next(iter(seeds.values()))["wire"] if seeds else None}
            if methods:
                # the field the verdicts cover: the methods with every final run finished (ok or failed)
                per_n[str(n)] = {"methods": methods, "verdicts": _verdicts(methods, links),
                                 "verdicts_crossed": _verdicts(methods, links, "links_crossed"),
                                 "field": {"planned": [m.name for m in _methods_at(spec, n)], "complete": complete}}
                if spec.stragglers:
                    per_n[str(n)]["stragglers"] = _straggler_verdicts(
                        spec.stragglers, wl, n, methods, links, len(spec.seeds),
                        lambda sd: by_key[sd["trial"]]["result"])
        params = next((sd["params"] for nd in per_n.values() for r in nd["methods"].values()
                       for sd in r.get("seeds", {}).values() if sd.get("params")), None)
        result["workloads"][wl.name] = {"nodes": per_n, "target": wl.target, "metric": wl.metric, "params": params,
                                        "higher_is_better": wl.higher_is_better, "task": wl.task,
                                        "epochs": wl.epochs, "tune_epochs": wl.tune_epochs,
                                        "samples_per_node": wl.samples_per_node, "batch_size": wl.batch_size,
                                        "model": wl.model, "data": wl.data, "context": wl.context,
                                        "recipe": list(wl.recipe), "hold_tolerance": wl.hold_tolerance,
                                        "model_options": dict(wl.model_options)}
    result["protocol"] = {"lr_factors": list(spec.lr_factors), "tune_seed": spec.tune_seed, "seeds": list(spec.seeds),
                          "validation_fraction": bench_data.VALIDATION_FRACTION,
                          "text_eval_bytes": bench_data.TEXT_EVAL_BYTES, "device": spec.device,
                          "selection": "best validation metric at the end of tune_epochs; ties to the smaller lr",
                          "grid_extensions": spec.grid_extensions, "grid_factor": GRID_FACTOR,
                          "criterion": "held"}
    result["links"] = [f"{b}@{lat}" for b, _, lat, _ in links]
    # every trial of one data set must have evaluated on the same split: sessions resumed on
    # machines whose default text corpus differs (another Python) would otherwise mix data
    digests: dict[str, set] = {}
    for r in trials:
        if r.get("data"):
            digests.setdefault(r["data"]["name"], set()).add(r["data"]["eval_digest"])
    result["warnings"] = [f"the trials of {name} evaluated on {len(d)} different data sets (sessions on machines "
                          "with different data, e.g. another Python's standard library as the text corpus): "
                          "their figures do not compare" for name, d in digests.items() if len(d) > 1]
    planned = plan(spec)
    result["coverage"] = {"planned": len(planned), "finished": len(trials),
                          "cpu_s": round(sum(r.get("cpu_s", 0.0) for r in trials), 1)}
    return result


def _verdicts(methods: dict, links: list, field: str = "links") -> dict:
    """Per link: the fastest method (``field``: the per-link statistics judged, the held
    criterion's or ``links_crossed``), the second, the margin and whether the lead is
    beyond the intervals."""
    out = {}
    for blabel, _, llabel, _ in links:
        key = f"{blabel}@{llabel}"
        ranked = sorted(((name, r[field][key]["time_s"]) for name, r in methods.items()
                         if field in r and r[field][key]["all_reached"]), key=lambda x: x[1]["mean"])
        if not ranked:
            out[key] = {"winner": None}
            continue
        w, ws = ranked[0]
        v = {"winner": w, "time_s": ws["mean"], "second": None, "margin_s": None, "separated": None}
        if len(ranked) > 1:
            s, ss = ranked[1]
            # with one seed there is no interval, so no claim of separation either way
            known = ws["hi"] is not None and ss["lo"] is not None
            v.update(second=s, second_time_s=ss["mean"], margin_s=ss["mean"] - ws["mean"],
                     separated=(ws["hi"] < ss["lo"]) if known else None)
        out[key] = v
    return out


def rescore(res: dict, bandwidths: Sequence[str] | None = None, latencies: Sequence[str] | None = None,
            stragglers: Sequence[str] | None = None) -> dict:
    """The analysis of a results file scored again from its trials' curves, without training:
    each method's time and bytes to the target by both criteria (held, and ever crossed:
    the criterion of results made before) and the verdicts, at the file's links or at
    ``bandwidths`` x ``latencies`` (a modelled time needs only a run's recorded bytes,
    message rounds and compute: a link the run was never scored at is scored now), and
    under the file's straggler settings or ``stragglers`` (node-speed specs: the same
    trials, each point's compute multiplied by the setting's slowest node, which every
    synchronous step waits for). A results file without its trials is returned as it is."""
    import copy

    by_key = {t["key"]: t for t in res.get("trials") or [] if t.get("result")}
    if not by_key:
        return res
    bws = list(bandwidths) if bandwidths else list(dict.fromkeys(k.split("@")[0] for k in res["links"]))
    lats = list(latencies) if latencies else list(dict.fromkeys(k.split("@")[1] for k in res["links"]))
    links = [(b, crossover.parse_rate(b), lat, crossover.parse_time(lat)) for b in bws for lat in lats]
    out = {**res, "workloads": copy.deepcopy(res["workloads"]), "links": [f"{b}@{lat}" for b in bws for lat in lats]}
    n_seeds = len(res["protocol"]["seeds"])
    for w in out["workloads"].values():
        goal = Goal.of(w)
        w.setdefault("hold_tolerance", goal.hold_tolerance)
        for n, nd in w["nodes"].items():
            for r in nd["methods"].values():
                if "seeds" not in r:
                    continue
                for sd in r["seeds"].values():
                    rec = by_key.get(sd.get("trial"))
                    if rec is not None:
                        sd["links"] = _seed_links(rec["result"], goal, links)
                        sd["holds"] = holds(rec["result"], goal)
                r["links"] = _link_stats(r["seeds"], links, n_seeds)
                r["links_crossed"] = _link_stats(r["seeds"], links, n_seeds, crossed=True)
            nd["verdicts"] = _verdicts(nd["methods"], links)
            nd["verdicts_crossed"] = _verdicts(nd["methods"], links, "links_crossed")
            settings = list(stragglers) if stragglers is not None else list(nd.get("stragglers") or [])
            if settings:
                nd["stragglers"] = _straggler_verdicts(settings, goal, int(n), nd["methods"], links,
                                                       n_seeds, lambda sd: (by_key.get(sd.get("trial")) or {}).get("result"))
    out["rescored"] = {"links": out["links"], "from": res["links"]}
    return out


# ----------------------------------------------------------------------------- the time model, calibrated


@dataclass(frozen=True)
class Calibration:
    """What the link model (``experiments/race.py``'s ``modelled_time``: compute, codec,
    bytes over the bandwidth, latency per message round) leaves out, fitted on runs
    measured on shaped links: ``eval_s`` seconds per evaluation (the per-epoch test pass
    and its fp32 all-reduces) and ``message_s`` seconds per message round (each send's
    fixed cost: framing, the kernel's queueing, the ranks' wake-ups)."""

    eval_s: float = 0.0
    message_s: float = 0.0

    def extra(self, evals: float, rounds: float) -> float:
        return self.eval_s * evals + self.message_s * rounds


def message_rounds(step: int, calls: dict, n: int) -> float:
    """Message rounds up to ``step``: a ring all-reduce is 2(n - 1) rounds, a neighbour exchange 1."""
    return step * sum(k * crossover.rounds_of(op, n) for op, k in calls.items())


def calibrated_time(point: dict, calls: dict, n: int, bw: float, lat: float, cal: Calibration) -> float:
    """The modelled time of a point plus the calibration's terms: one evaluation per epoch
    up to the point (``point["epoch"]``, else none), ``cal.message_s`` per message round."""
    from experiments import race

    return race.modelled_time(point, calls, n, bw, lat) + cal.extra(point.get("epoch") or 0.0,
                                                                    message_rounds(point["step"], calls, n))


def fit_calibration(samples: Sequence[tuple[float, float, float]]) -> Calibration:
    """Least squares of ``measured - modelled = eval_s x evals + message_s x rounds`` over
    ``samples`` of ``(evals, rounds, measured - modelled)``, both terms at least 0 (a term the
    data would make negative is dropped and the other fitted alone)."""
    sxx = sum(a * a for a, _, _ in samples)
    syy = sum(b * b for _, b, _ in samples)
    sxy = sum(a * b for a, b, _ in samples)
    sxr = sum(a * r for a, _, r in samples)
    syr = sum(b * r for _, b, r in samples)

    def sse(e: float, c: float) -> float:
        return sum((r - e * a - c * b) ** 2 for a, b, r in samples)

    det = sxx * syy - sxy * sxy
    if det > 1e-12 * max(1.0, sxx * syy):
        e, c = (sxr * syy - syr * sxy) / det, (syr * sxx - sxr * sxy) / det
        if e >= 0 and c >= 0:
            return Calibration(e, c)
    alone = [Calibration(max(0.0, sxr / sxx) if sxx else 0.0, 0.0),
             Calibration(0.0, max(0.0, syr / syy) if syy else 0.0)]
    return min(alone, key=lambda k: sse(k.eval_s, k.message_s))


def calibration(measured: dict, results: dict) -> dict:
    """The time model calibrated on the runs measured on shaped links
    (``experiments/benchmark_netns.py``'s results) and its error per method at the target,
    before and after. Beside it, the model the verdicts rest on: the simulated trial's modelled
    time at the same link (``sim_before``), and that time with the same fitted terms
    added (``sim_after``); ``median_sim_after`` above :data:`MODEL_ERROR_LIMIT` makes
    the part's verdict at that bandwidth the measured one (:func:`measured_verdict`). At each bandwidth the two terms of :class:`Calibration` are fitted on
    every evaluation of every other method's run (leave one method out: a method's error
    after calibration comes from a fit that did not see it); the error is modelled over
    measured time less 1 at the first evaluation that reached the target."""
    trials = {t["key"]: t for t in results.get("trials") or []}
    n = int(measured.get("nodes") or 0)
    out: dict[str, Any] = {}
    for bw in measured.get("bandwidths", []):
        rows = {}
        for name, per in measured.get("runs", {}).items():
            run = per.get(bw)
            rec = trials.get((run or {}).get("trial"))
            if not run or not run.get("ok") or rec is None or not run.get("points"):
                continue
            calls = rec["result"]["calls_per_step"]
            pts = [(p.get("epoch") or 0.0, message_rounds(p["step"], calls, n), p["time_s"] - p["model_s"])
                   for p in run["points"] if p.get("time_s") and p.get("model_s") is not None]
            tt = run.get("to_target") or {}
            at = None if tt.get("step") is None else (tt.get("epoch") or 0.0, message_rounds(tt["step"], calls, n),
                                                        tt["model_s"], tt["time_s"])
            rows[name] = {"samples": pts, "at": at}
        per_method = {}
        for name, r in rows.items():
            if r["at"] is None:
                continue
            cal = fit_calibration([x for other, o in rows.items() if other != name for x in o["samples"]])
            evals, rounds, model, real = r["at"]
            sim = (measured["runs"][name].get(bw) or {}).get("simulated_time_s")
            per_method[name] = {"before": model / real - 1.0, "after": (model + cal.extra(evals, rounds)) / real - 1.0,
                                "eval_s": cal.eval_s, "message_s": cal.message_s, "measured_s": real,
                                "simulated_s": sim,
                                "sim_calibrated_s": None if sim is None else sim + cal.extra(evals, rounds),
                                "sim_before": None if sim is None else sim / real - 1.0,
                                "sim_after": None if sim is None else (sim + cal.extra(evals, rounds)) / real - 1.0}
        whole = fit_calibration([x for r in rows.values() for x in r["samples"]])
        med = lambda xs: sorted(xs)[len(xs) // 2] if len(xs) % 2 else sum(sorted(xs)[len(xs) // 2 - 1:len(xs) // 2 + 1]) / 2  # noqa: E731
        sims = [abs(v["sim_after"]) for v in per_method.values() if v["sim_after"] is not None]
        out[bw] = {"eval_s": whole.eval_s, "message_s": whole.message_s, "methods": per_method,
                   "median_before": med([abs(v["before"]) for v in per_method.values()]) if per_method else None,
                   "median_after": med([abs(v["after"]) for v in per_method.values()]) if per_method else None,
                   "median_sim_before": med([abs(v["sim_before"]) for v in per_method.values()
                                             if v["sim_before"] is not None]) if sims else None,
                   "median_sim_after": med(sims) if sims else None}
    return out


#: the median error of the verdicts' time model, after calibration, above which a part's
#: verdict at a measured bandwidth is the measured one
MODEL_ERROR_LIMIT = 0.25


def measured_verdict(measured: dict, cal: dict) -> str:
    """Where the calibrated model of the simulated trials stays off by more than
    :data:`MODEL_ERROR_LIMIT` (median over the measured methods) at a bandwidth, the
    part's verdict at that bandwidth from the measured times (Markdown): the measured
    methods ranked by their measured time to the target, beside the model's times and
    ranks. A run that did not reach the target ranks last. Empty where the model holds."""
    out = []
    for bw, c in cal.items():
        lim = c.get("median_sim_after")
        if lim is None or lim <= MODEL_ERROR_LIMIT:
            continue
        rows = []
        for name, per in measured.get("runs", {}).items():
            run = per.get(bw)
            if not run:
                continue
            t = (run.get("to_target") or {}).get("time_s") if run.get("ok") else None
            v = c["methods"].get(name) or {}
            # calibrated where the run reached the target (its evaluations and rounds known)
            rows.append((name, t, v.get("sim_calibrated_s", run.get("simulated_time_s"))))
        if not rows:
            continue
        inf = float("inf")
        by_measured = sorted(rows, key=lambda r: (r[1] is None, r[1] if r[1] is not None else inf))
        model_rank = {r[0]: i + 1 for i, r in enumerate(sorted(rows, key=lambda r: (r[2] is None, r[2] or inf)))}
        table = ["| measured rank | method | time to target, measured | simulated trial, modelled and calibrated "
                 "| modelled rank |", "|---|---|---|---|---|"]
        for i, (name, t, model) in enumerate(by_measured):
            table.append(f"| {i + 1} | {name} | {_fmt_s(t) if t is not None else 'not reached'} | "
                         f"{_fmt_s(model)} | {model_rank[name]} |")
        lead, model_lead = by_measured[0][0], min(model_rank, key=model_rank.get)
        moved = [n for i, (n, _, _) in enumerate(by_measured) if model_rank[n] != i + 1]
        out += [f"**At {bw} this part's verdict is the measured one**: the simulated trials' model, calibrated, "
                f"is off by a median {lim:.0%} over the {len(rows)} measured methods (above "
                f"{MODEL_ERROR_LIMIT:.0%}). Measured, {lead} reaches the target first"
                + (f"; the model put {model_lead} first" if model_lead != lead else ", as the model has it")
                + (f"; {len(moved)} of {len(rows)} places differ from the model's order." if moved
                   else "; the model's order holds.")
                + " Methods not measured keep their modelled standing in the tables below, which rest on the model.",
                "", *table, ""]
    return "\n".join(out).strip()


def calibration_section(measured: dict, results: dict) -> str:
    """The calibrated model's error per method (Markdown), from :func:`calibration`."""
    cal = calibration(measured, results)
    if not any(c["methods"] for c in cal.values()):
        return ""
    bws = [b for b in cal if cal[b]["methods"]]
    names = list(dict.fromkeys(m for b in bws for m in cal[b]["methods"]))
    pct = lambda x: "-" if x is None else f"{x:+.0%}"  # noqa: E731
    rows = ["| method | " + " | ".join(f"{b}: same run, before | after | simulated trial, before | after"
                                       for b in bws) + " |",
            "|---|" + "---|---|---|---|" * len(bws)]
    for m in names:
        cells = []
        for b in bws:
            v = cal[b]["methods"].get(m)
            cells += [pct(v and v["before"]), pct(v and v["after"]), pct(v and v["sim_before"]),
                      pct(v and v["sim_after"])]
        rows.append(f"| {m} | " + " | ".join(cells) + " |")
    lines = ["The link model leaves out each evaluation (the per-epoch test pass and its fp32 all-reduces) and a "
             "fixed cost per message round. Both are fitted at each bandwidth by least squares on every evaluation "
             "of the measured runs (the measured time less the modelled one), each method's error after "
             "calibration from a fit on the other methods only. Error: modelled over measured time to the target, "
             "less 1, for two models: the same run's (its own bytes and measured compute) and the simulated "
             "trial's, which the verdicts rest on (its compute measured in the one-process simulation).", ""]
    for b in bws:
        c = cal[b]
        off = (c["median_sim_after"] or 0) > MODEL_ERROR_LIMIT
        lines.append(f"- {b}: {c['eval_s']:.3g} s per evaluation, {c['message_s'] * 1e3:.3g} ms per message round "
                     f"(fitted on every method); median |error| of the same run's model "
                     f"{pct(c['median_before']).lstrip('+')} before, {pct(c['median_after']).lstrip('+')} after; of "
                     f"the simulated trials' {pct(c['median_sim_before']).lstrip('+')} before, "
                     f"{pct(c['median_sim_after']).lstrip('+')} after"
                     + (f" (above {MODEL_ERROR_LIMIT:.0%}: the verdict at {b} is the measured one, below)" if off else "")
                     + ".")
    lines += ["", *rows, "", "The ranks' CPU contention is not a term of the model yet: the measured runs give the "
              "1-minute load they ran under (above)."]
    verdict = measured_verdict(measured, cal)
    if verdict:
        lines += ["", verdict]
    return "\n".join(lines)


#: the code the benchmark's figures measure (experiments/_provenance.py records their state)
SOURCES = ["experiments/benchmark.py", "experiments/bench_data.py", "experiments/race.py", "experiments/training.py",
           "gossip"]


# ----------------------------------------------------------------------------- report


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else (f"{x:.3g} s" if x < 1000 else f"{x:.0f} s")


def _fmt_ci(st: dict | None, fmt=_fmt_s) -> str:
    if st is None:
        return "not reached"
    if st["lo"] is None:
        return fmt(st["mean"])
    return f"{fmt(st['mean'])} [{fmt(max(0.0, st['lo']))}, {fmt(st['hi'])}]"


def _fmt_metric(metric: str, x: float | None) -> str:
    return leaderboard.fmt_metric(metric, x)


def verdict_table(res: dict) -> str:
    """For each workload, node count and link: the winner, its time, the second, the margin."""
    lines = ["| workload | nodes | link | fastest to target | time (mean, 95 % CI) | second | margin | lead beyond CIs |",
             "|---|---|---|---|---|---|---|---|"]
    for wname, w in res["workloads"].items():
        for n, nd in w["nodes"].items():
            n = leaderboard.field_label(n, nd)
            for key, v in nd["verdicts"].items():
                if v["winner"] is None:
                    lines.append(f"| {wname} | {n} | {key} | none reached the target | - | - | - | - |")
                    continue
                wst = nd["methods"][v["winner"]]["links"][key]["time_s"]
                sep = "-" if v["separated"] is None else ("yes" if v["separated"] else "no")
                lines.append(f"| {wname} | {n} | {key} | {v['winner']} | {_fmt_ci(wst)} | {v['second'] or '-'} | "
                             f"{_fmt_s(v['margin_s'])} | {sep} |")
    return "\n".join(lines)


def straggler_tables(res: dict) -> str:
    """For each straggler setting (one node slower, log-normal speeds): the verdict table of
    every workload, node count and link, each synchronous step waiting for the slowest node."""
    settings = sorted({s for w in res["workloads"].values() for nd in w["nodes"].values()
                       for s in nd.get("stragglers", {})})
    parts = []
    for setting in settings:
        lines = [f"### Node speeds {setting}", "",
                 "| workload | nodes | slowest | link | fastest to target | time (mean, 95 % CI) | second | margin | "
                 "lead beyond CIs |", "|---|---|---|---|---|---|---|---|---|"]
        for wname, w in res["workloads"].items():
            for n, nd in w["nodes"].items():
                st = nd.get("stragglers", {}).get(setting)
                if st is None:
                    continue
                label = leaderboard.field_label(n, nd)
                for key, v in st["verdicts"].items():
                    if v["winner"] is None:
                        lines.append(f"| {wname} | {label} | {st['slowest']:.3g}x | {key} | none reached the target "
                                     f"| - | - | - | - |")
                        continue
                    wst = st["methods"][v["winner"]]["links"][key]["time_s"]
                    sep = "-" if v["separated"] is None else ("yes" if v["separated"] else "no")
                    lines.append(f"| {wname} | {label} | {st['slowest']:.3g}x | {key} | {v['winner']} | {_fmt_ci(wst)} "
                                 f"| {v['second'] or '-'} | {_fmt_s(v['margin_s'])} | {sep} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def method_tables(res: dict) -> str:
    from experiments import race

    parts = []
    for wname, w in res["workloads"].items():
        for n, nd in w["nodes"].items():
            keys = res["links"]
            better = "higher" if w.get("higher_is_better", "acc" in w["metric"]) else "lower"
            parts.append(f"#### {wname}, {n} nodes (target {_fmt_metric(w['metric'], w['target'])} {w['metric']}, "
                         f"{better} is better)\n")
            head = ["method", "wire", "selected lr", f"final {w['metric']} (mean, 95 % CI)",
                    "bytes/node to target", *[f"time @ {k}" for k in keys], "budget: runs, steps, CPU s"]
            rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            for name, r in nd["methods"].items():
                if "error" in r:
                    rows.append(f"| {name} | " + " | ".join(["-"] * (len(head) - 2)) + f" | {r['error']} |")
                    continue
                fin = r["final"]
                fmtm = lambda x: _fmt_metric(w["metric"], x)  # noqa: E731
                final = "-" if fin is None else (fmtm(fin["mean"]) if fin["lo"] is None else
                                                 f"{fmtm(fin['mean'])} [{fmtm(fin['lo'])}, {fmtm(fin['hi'])}]")
                if r.get("seeds_failed"):
                    final += f" ({len(r['seeds_failed'])} seeds failed)"
                first = r["links"][keys[0]] if keys else None  # the bytes to target are the same at every link
                b = r["budget"]
                if b["final"]["runs"] == 0:  # selected, final runs still to come: nothing is "not reached" yet
                    byts, times = "final runs not run yet", ["-"] * len(keys)
                else:
                    byts = ("- (no link)" if first is None else "not reached" if first["bytes"] is None
                            else tables.fmt_bytes(first["bytes"]["mean"]))
                    times = [_fmt_ci(r["links"][k]["time_s"]) + ("" if r["links"][k]["all_reached"]
                                                                   else f" ({r['links'][k]['reached']} seeds)")
                             for k in keys]
                budget = (f"tune {b['tune']['runs']}, {b['tune']['steps']}, {b['tune']['cpu_s']:.0f}; "
                          f"final {b['final']['runs']}, {b['final']['steps']}, {b['final']['cpu_s']:.0f}")
                rows.append("| " + " | ".join([name, r["wire"] or "-", f"{r['lr']:g}", final, byts, *times, budget])
                            + " |")
            parts.append("\n".join(rows) + "\n")
    return "\n".join(parts)


def _algo_opts(flags: Sequence[str]) -> tuple[str | None, dict[str, str], list[str]]:
    """A method's flags read: its ``--algo``, its ``--algo-opt KEY=VALUE`` settings and the
    rest of its flags (the variant: ``--bits``, ``--compressor``, ...)."""
    algo, opts, rest = None, {}, []
    it = iter(range(len(flags)))
    for i in it:
        a = flags[i]
        nxt = flags[i + 1] if i + 1 < len(flags) else None
        if a == "--algo" and nxt is not None:
            algo = nxt
            next(it, None)
        elif a.startswith("--algo="):
            algo = a.split("=", 1)[1]
        elif a == "--algo-opt" and nxt is not None:
            k, _, v = nxt.partition("=")
            opts[k] = v
            next(it, None)
        else:
            rest.append(a)
    return algo, opts, rest


def _defaults(algo: str | None) -> dict[str, str]:
    """The options of gossip's ``algo`` with their defaults (the paper's, as gossip gives
    them), and its local optimizer; empty if it is not an algorithm of this gossip."""
    import dataclasses

    from gossip import algorithms

    try:
        cls = algorithms.config_class(algo)
    except Exception:  # noqa: BLE001 - an algorithm this gossip no longer has
        return {}
    out = {"optimizer": algorithms.local_optimizer_default(algo)}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            v = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            v = f.default_factory()  # type: ignore[misc]
        else:
            continue
        out[f.name] = "none" if v is None else _option_text(v)
    return out


def _option_text(v: Any) -> str:
    from experiments.bench_spec import option_text

    return option_text(v)


def _options(res: dict) -> tuple[list[str], list[str]]:
    """The rows of :func:`options_table` (none where no method records its flags) and
    each option set in a method's flags with no reason, as "method (key=value)"."""
    seen: dict[str, dict] = {}
    for w in res["workloads"].values():
        for nd in w["nodes"].values():
            for name, r in nd["methods"].items():
                if "flags" in r and name not in seen:
                    seen[name] = r
    if not seen:
        return [], []
    rows = ["| method | algorithm | variant (flags) | options as run | overrides, with their reasons |",
            "|---|---|---|---|---|"]
    unexplained = []
    for name, r in seen.items():
        algo, opts, rest = _algo_opts(r["flags"])
        defaults = _defaults(algo)
        given = dict(zip(rest, rest[1:]))
        variant = given.get("--compressor") or (f"quant:bits={given['--bits']}" if "--bits" in given else None)
        if variant and "compressor" in defaults and "compressor" not in opts:
            defaults["compressor"] = f"{variant} (the variant's flags)"
        reasons = r.get("overrides") or {}
        cells, why = [], []
        for k, v in {**defaults, **{k: v for k, v in opts.items() if k not in defaults}}.items():
            if k in opts and (k in reasons or opts[k] != v):
                mark = "override" if k in reasons else "no reason recorded"
                cells.append(f"**{k}={opts[k]}** ({mark}; default {v if k in defaults else '-'})")
                if k in reasons:
                    why.append(f"{k}: {reasons[k]['reason']}")
                else:
                    unexplained.append(f"{name} ({k}={opts[k]})")
            else:
                cells.append(f"{k}={opts.get(k, v)}")
        rows.append(f"| {name} | {algo or '?'} | {' '.join(rest) or '-'} | {', '.join(cells) or '-'} | "
                    f"{'; '.join(why) or '-'} |")
    return rows, unexplained


def options_table(res: dict) -> str:
    """Every method's options as run: its algorithm, the flags that make it the variant
    named (bits, compressor), and each option of the algorithm at its paper default or
    set by an override, which is marked and given with its reason. An option set in the
    flags with no reason (results made before the spec's overrides) is marked as such."""
    rows, unexplained = _options(res)
    if not rows:
        return ""
    lines = ["Every option is its algorithm's paper default (as gossip gives it), except the learning rate (tuned) "
             "and the options marked: an override, with the reason the spec states, or, in results made before "
             "the spec required a reason, an option set in the method's flags.", "", *rows]
    if unexplained:
        lines += ["", f"**Set away from the default without a stated reason** (these results predate the rule; the "
                      f"spec now refuses it): {', '.join(unexplained)}."]
    return "\n".join(lines)


def _grids(res: dict) -> list[tuple]:
    """Each (workload, nodes, method) whose tuned rate lies at an edge of the rates tried
    or whose grid was extended: (workload, nodes, method, rates tried, selected,
    extensions, state), the state "interior", "the next rate diverged" or "open: ..."."""
    out = []
    for wname, w in res["workloads"].items():
        for n, nd in w["nodes"].items():
            for name, r in nd["methods"].items():
                if "lr" not in r:
                    continue
                tried = sorted(x["lr"] for x in r["tuning"])
                grid = r.get("grid")
                ext = (grid or {}).get("extensions") or []
                if not ext and r["lr"] not in (tried[0], tried[-1]):
                    continue
                if grid is None:
                    state = "open: selected at the edge (made before grids were closed)"
                else:
                    state = grid["closed"] if grid["closed"] in ("interior", "the next rate diverged") else \
                        f"open: {grid['closed']}"
                out.append((wname, n, name, tried, r["lr"], ext, state))
    return out


def protocol_kept(res: dict) -> str:
    """One cell: whether a part was run under the protocol the report states: every
    option a paper default or an override with its reason, and no selected rate at the
    open edge of its grid ("kept"); otherwise what departs from it."""
    unexplained = _options(res)[1]
    opened = collections.Counter(g[-1].removeprefix("open: ") for g in _grids(res) if g[-1].startswith("open"))
    why = ([f"options set with no reason ({', '.join(unexplained)})"] if unexplained else []) + \
        [f"{k} grid{'s' if k != 1 else ''} open ({state})" for state, k in opened.items()]
    return "kept" if not why else "not kept: " + "; ".join(why)


def grid_table(res: dict) -> str:
    """Per workload and node count, each method whose tuned rate lies at an edge of the
    rates tried, or whose grid was extended: the rates tried, the pick, the extensions
    and why the grid is closed (or that it is open)."""
    rows = ["| workload | nodes | method | rates tried | selected | extensions | grid |", "|---|---|---|---|---|---|---|"]
    grids = _grids(res)
    for wname, n, name, tried, lr, ext, state in grids:
        rows.append(f"| {wname} | {n} | {name} | {', '.join(f'{x:g}' for x in tried)} | {lr:g} | "
                    f"{', '.join(f'{x:g}' for x in ext) or '-'} | {state} |")
    n_open = sum(g[-1].startswith("open") for g in grids)
    proto = res["protocol"]
    k = proto.get("grid_extensions")
    head = (f"When the selected rate is the smallest or the largest tried, the tuner tries the next rate a factor "
            f"{proto.get('grid_factor', GRID_FACTOR):g} beyond it, up to {k} times, until the pick is interior or "
            "the next rate diverges." if k is not None else
            "These results were tuned on the spec's grid alone: a rate selected at its edge was not extended (the "
            "runner now extends it by a factor 2, up to 3 times, until the pick is interior or the next rate "
            "diverges).")
    if len(rows) == 2:
        return head + " Every selected rate is interior to the rates tried."
    return head + f" Grids still open: {n_open}.\n\n" + "\n".join(rows)


def criteria_table(res: dict) -> str:
    """The verdicts by both criteria, for this release: the first crossing of a run that
    holds the target (the ranking) and of any run that ever crossed it (the criterion
    before), and the methods the held criterion takes out of the ranking."""
    rows = ["| workload | nodes | link | fastest, held | fastest, ever crossed |", "|---|---|---|---|---|"]
    dropped = []
    for wname, w in res["workloads"].items():
        for n, nd in w["nodes"].items():
            old = nd.get("verdicts_crossed")
            if old is None:
                continue
            for key, v in nd["verdicts"].items():
                o = old.get(key, {})
                cell = lambda x: f"{x['winner']} ({_fmt_s(x['time_s'])})" if x.get("winner") else "none"  # noqa: E731
                rows.append(f"| {wname} | {n} | {key} | {cell(v)} | {cell(o)}{'' if o.get('winner') == v.get('winner') else ' (differs)'} |")
            for name, r in nd["methods"].items():
                if "links_crossed" not in r:
                    continue
                lost = [k for k in r["links"] if r["links_crossed"][k]["all_reached"] and not r["links"][k]["all_reached"]]
                if lost:
                    ends = [_fmt_metric(w["metric"], sd["final"]) for sd in r["seeds"].values() if not sd.get("holds")]
                    dropped.append(f"{name} at {wname}/{n} nodes (final {', '.join(ends)})")
    if len(rows) == 2:
        return ""
    tol = {f"{w['metric']} {w.get('hold_tolerance', Workload.hold_tolerance):g}" for w in res["workloads"].values()}
    return ("A run holds the target when its test metric crosses it and its final metric ends no further than the "
            f"tolerance ({', '.join(sorted(tol))}) from it; its time to target is its first crossing. The ranking "
            "uses runs that hold; the right column is the criterion used before (every seed ever crossed the "
            "target), given for this release only." + ("" if not dropped else
            " Ranked before, not now (a seed crossed the target and ended below it less the tolerance): "
            + "; ".join(dropped) + ".") + "\n\n" + "\n".join(rows))


#: the performance profile's range of tau (MLCommons AlgoPerf's choice, arXiv:2306.07179) and its
#: bootstrap: draws over each method's seeds, the seed of the draws
TAU_MAX = 4.0
PROFILE_DRAWS = 1000


def profiles(results: Sequence[dict], tau_max: float = TAU_MAX, draws: int = PROFILE_DRAWS, seed: int = 0) -> dict:
    """Performance profiles as MLCommons AlgoPerf scores training algorithms (Dahl et al.,
    "Benchmarking Neural Network Training Algorithms", arXiv:2306.07179): a cell is one
    workload, node count and link; a method's time there is its mean time to the target
    over the protocol's seeds if every seed holds the target (infinite otherwise); its ratio
    is that time over the best method's in the cell. rho(tau) is the fraction of the cells
    (those where the method was run and some method held the target) with a ratio at most
    tau; the score is the area under rho over tau in [1, tau_max], divided by tau_max - 1
    (1: the fastest everywhere; 0: never within tau_max of the fastest). The interval is
    the 2.5 and 97.5 percentiles of ``draws`` bootstrap draws, each resampling every
    method's seeds with replacement at each workload and node count (one draw of seeds for
    all the links of a run, whose times come from the same runs). ``results``: rescored
    results (:func:`rescore`), one per part of the benchmark."""
    import numpy as np

    rng = np.random.default_rng(seed)
    groups = []
    for res in results:
        n_seeds = len(res["protocol"]["seeds"])
        keys = res["links"]
        for wname, w in res["workloads"].items():
            for n, nd in w["nodes"].items():
                names, times = [], []
                for name, r in nd["methods"].items():
                    t = np.full((n_seeds, len(keys)), np.inf)
                    for i, sd in enumerate(list((r.get("seeds") or {}).values())[:n_seeds]):
                        for j, k in enumerate(keys):
                            x = sd["links"].get(k, {}).get("time_s")
                            t[i, j] = np.inf if x is None else x
                    if len(r.get("seeds") or {}) < n_seeds:
                        t[:] = np.inf  # a method without its full set of seeds is ranked nowhere
                    names.append(name)
                    times.append(t)
                if names:
                    groups.append((f"{wname}/n{n}", names, np.stack(times)))
    everyone = list(dict.fromkeys(x for _, names, _ in groups for x in names))
    col = {x: i for i, x in enumerate(everyone)}

    def score(t: "np.ndarray", names: list[str], num, den, ratios=None) -> None:
        """``t``: [..., methods, links] mean times; accumulates the area and the cells."""
        best = t.min(axis=-2, keepdims=True)
        valid = np.isfinite(best)  # a cell where some method holds the target
        with np.errstate(invalid="ignore", divide="ignore"):
            r = np.where(valid, t / np.where(valid, best, 1.0), np.inf)
        area = np.clip((tau_max - np.maximum(r, 1.0)) / (tau_max - 1.0), 0.0, 1.0)
        idx = [col[x] for x in names]
        num[..., idx] += area.sum(axis=-1)
        den[..., idx] += np.broadcast_to(valid, r.shape).sum(axis=-1)
        if ratios is not None:
            for i, x in enumerate(names):
                ratios[x] += [float(v) for v, ok in zip(r[i], valid[0]) if ok]

    num, den = np.zeros(len(everyone)), np.zeros(len(everyone))
    bnum, bden = np.zeros((draws, len(everyone))), np.zeros((draws, len(everyone)))
    ratios: dict[str, list[float]] = {x: [] for x in everyone}
    for _, names, t in groups:
        m, k, _ = t.shape
        score(t.mean(axis=1), names, num, den, ratios)
        pick = rng.integers(0, k, size=(draws, m, k))
        drawn = t[np.arange(m)[None, :, None], pick].mean(axis=2)  # [draws, methods, links]
        score(drawn, names, bnum, bden)
    with np.errstate(invalid="ignore", divide="ignore"):
        point, boot = num / den, bnum / bden
    out = {}
    for x, i in col.items():
        if den[i] == 0:
            continue
        b = boot[:, i][np.isfinite(boot[:, i])]
        out[x] = {"score": float(point[i]), "lo": float(np.percentile(b, 2.5)) if b.size else None,
                  "hi": float(np.percentile(b, 97.5)) if b.size else None, "cells": int(den[i]),
                  "wins": sum(1 for v in ratios[x] if v <= 1.0),
                  "ratios": sorted(v for v in ratios[x] if math.isfinite(v))}
    ranked = dict(sorted(out.items(), key=lambda kv: -kv[1]["score"]))
    return {"tau_max": tau_max, "draws": draws, "groups": [g for g, _, _ in groups], "methods": ranked,
            "cells": int(max(den)) if len(den) else 0}


def profile_plot(prof: dict, path: Path) -> Path | None:
    """The performance profile: rho(tau) against tau for every method, at ``path``; None
    (and nothing written) without matplotlib (``pip install gossip[analysis]``)."""
    from experiments import race

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    tau_max = prof["tau_max"]
    for i, (name, m) in enumerate(prof["methods"].items()):
        xs = [1.0] + [min(r, tau_max) for r in m["ratios"] if r <= tau_max] + [tau_max]
        ys = [sum(1 for r in m["ratios"] if r <= 1.0) / m["cells"]]
        ys += [sum(1 for r in m["ratios"] if r <= x) / m["cells"] for x in xs[1:]]
        ax.step(xs, ys, where="post", label=f"{name} ({m['score']:.2f})", **race.line_style(i))
    ax.set_xlim(1.0, tau_max)
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel("tau: time to target within this factor of the fastest method's")
    ax.set_ylabel("fraction of cells (workload, nodes, link)")
    ax.set_title("Performance profiles (runs that hold the target); score: area, normalised", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def profile_section(prof: dict, figure: str | None, drawn: bool | None) -> str:
    """The scores and, where drawn, the plot (``figure``: its link relative to the page);
    ``drawn`` False (matplotlib missing): a line saying how to get it; None: no plot."""
    if not prof["methods"]:
        return "No cell where a method holds the target: no profile."
    rows = ["| rank | method | score (95 % bootstrap interval) | fastest in | cells |", "|---|---|---|---|---|"]
    for i, (name, m) in enumerate(prof["methods"].items(), 1):
        ci = "" if m["lo"] is None else f" [{m['lo']:.3f}, {m['hi']:.3f}]"
        rows.append(f"| {i} | {name} | {m['score']:.3f}{ci} | {m['wins']} | {m['cells']} |")
    head = (f"The score of each method is the area under its performance profile over tau in [1, {prof['tau_max']:g}], "
            f"divided by {prof['tau_max'] - 1:g} (as MLCommons AlgoPerf scores training algorithms, arXiv:2306.07179): "
            "rho(tau) is the fraction of the cells (workload, node count, link) where the method's mean time to "
            "the target, over seeds that all hold it, is within a factor tau of the fastest method's. A method "
            "counts only the cells where it was run and some method held the target. The interval: the 2.5 and "
            f"97.5 percentiles of {prof['draws']} bootstrap draws resampling each method's seeds (one draw for all "
            f"the links of a run). Cells: {', '.join(prof['groups'])}.")
    plot = (f"![performance profile]({figure})" if drawn and figure else "" if drawn is None else
            "The profile's plot needs matplotlib (`pip install gossip[analysis]`); it was not drawn.")
    return head + "\n\n" + (plot + "\n\n" if plot else "") + "\n".join(rows)


def _size_label(res: dict) -> str:
    """A part's workload and model size, e.g. ``gpt (2 layers, width 64; 120,576 parameters)``."""
    (wname, w), = res["workloads"].items()
    opts = ", ".join(f"{k}={_option_text(v)}" for k, v in (w.get("model_options") or {}).items())
    size = f"{w['params']:,} parameters" if w.get("params") else "parameters not recorded"
    return f"{wname} ({opts}; {size})" if opts else f"{wname} ({size})"


def size_section(parts: Sequence[dict], tau_max: float = TAU_MAX, draws: int = PROFILE_DRAWS) -> str:
    """How the ranking moves with the model's size: ``parts`` are rescored results, each of
    one workload at one size, smallest first (the same links and node counts). Each size's
    score is its own performance profile's (:func:`profiles` over that part's cells alone);
    the table gives each method's score and rank at every size and how far its rank moved
    from the smallest to the largest, then the leaders and the rank correlation."""
    import numpy as np

    if len(parts) < 2:
        return ""
    for res in parts:
        if len(res["workloads"]) != 1:
            raise ValueError(f"size_section: a part holds one workload at one size, not {sorted(res['workloads'])}")
    labels = [_size_label(res) for res in parts]
    profs = [profiles([res], tau_max=tau_max, draws=draws)["methods"] for res in parts]
    ranks = [{name: i for i, name in enumerate(p, 1)} for p in profs]
    everyone = list(dict.fromkeys([*profs[-1], *(x for p in profs for x in p)]))

    def cell(p: dict, r: dict, name: str) -> str:
        m = p.get(name)
        if m is None:
            return "-"
        ci = "" if m["lo"] is None else f" [{m['lo']:.2f}, {m['hi']:.2f}]"
        return f"{m['score']:.2f}{ci} ({r[name]})"

    rows = ["| method | " + " | ".join(f"score (rank) at {x}" for x in labels) + " | rank moved |",
            "|---|" + "---|" * len(labels) + "---|"]
    moved = {}
    for name in everyone:
        a, b = ranks[0].get(name), ranks[-1].get(name)
        if a is not None and b is not None:
            moved[name] = a - b
        step = "-" if name not in moved else "=" if moved[name] == 0 else f"{moved[name]:+d}"
        rows.append(f"| {name} | " + " | ".join(cell(p, r, name) for p, r in zip(profs, ranks)) + f" | {step} |")
    both = list(moved)
    lines = []
    for label, p in zip(labels, profs):
        top = [x for x, m in p.items() if m["score"] == max(v["score"] for v in p.values())] if p else []
        lines.append(f"at {label}: {', '.join(top) or 'no method holds the target'}")
    text = ["Each size's score is its own part's performance profile (over that part's cells alone: its links "
            f"at its node counts; the area over tau in [1, {tau_max:g}] with the seeds' 95 % bootstrap "
            "interval, rank in brackets); a positive move is a method ranked higher at the largest size than at "
            "the smallest. Leaders " + "; ".join(lines) + "."]
    if len(both) >= 3:
        ra = np.argsort(np.argsort([ranks[0][x] for x in both]))
        rb = np.argsort(np.argsort([ranks[-1][x] for x in both]))
        rho = float(np.corrcoef(ra, rb)[0, 1]) if np.std(ra) and np.std(rb) else float("nan")
        far = sorted((x for x in both if abs(moved[x]) >= 3), key=lambda x: -abs(moved[x]))
        text.append(f"Spearman's rank correlation between the smallest and the largest size over the {len(both)} "
                    f"methods ranked at both: {rho:.2f}."
                    + (" Moved three places or more: " + ", ".join(f"{x} ({moved[x]:+d})" for x in far) + "."
                       if far else " No method moved three places or more."))
    return " ".join(text) + "\n\n" + "\n".join(rows)


def _first_curve(res: dict, r: dict) -> tuple[list[dict], dict] | None:
    """The first seed's curve of a method and its calls per step: from the results'
    trials, or (results files written before they held their trials) from the seed."""
    if not r.get("seeds"):
        return None
    sd = next(iter(r["seeds"].values()))
    if "curve" in sd:
        return sd["curve"], sd["calls_per_step"]
    rec = {t["key"]: t for t in res.get("trials", [])}.get(sd.get("trial"))
    if rec is None:
        return None
    return _points(rec["result"]), rec["result"]["calls_per_step"]


def plots(res: dict, out: Path, prefix: str) -> list[Path]:
    """Per workload and node count: metric against bytes, and against modelled time per
    bandwidth (at the first latency); the first seed's curve of each method."""
    from experiments import race

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    bws = sorted({k.split("@")[0] for k in res["links"]}, key=crossover.parse_rate)
    lat0 = res["links"][0].split("@")[1] if res["links"] else "0"  # no link: the bytes panel alone
    for wname, w in res["workloads"].items():
        for n, nd in w["nodes"].items():
            fig, axes = plt.subplots(1, 1 + len(bws), figsize=(4.5 * (1 + len(bws)), 3.6), squeeze=False)
            for i, (name, r) in enumerate(nd["methods"].items()):
                got = _first_curve(res, r)
                if got is None:
                    continue
                curve, calls = got
                ys = [p["metric"] for p in curve]
                style = race.line_style(i)
                axes[0][0].plot([max(1, p["bytes"]) for p in curve], ys, label=name, **style)
                for ax, b in zip(axes[0][1:], bws):
                    rate, lat = crossover.parse_rate(b), crossover.parse_time(lat0)
                    ax.plot([race.modelled_time(p, calls, int(n), rate, lat) for p in curve], ys, label=name, **style)
            axes[0][0].set_xlabel("bytes sent per node")
            for ax, title in zip(axes[0], ["bytes", *[f"{b}, latency {lat0}" for b in bws]]):
                ax.set_xscale("log")
                ax.axhline(w["target"], color="grey", lw=0.8, ls="--")
                ax.set_ylabel(w["metric"])
                ax.set_title(f"{wname}, n={n}: {title}", fontsize=9)
                ax.grid(alpha=0.3)
                if title != "bytes":
                    ax.set_xlabel("modelled time (s)")
            axes[0][-1].legend(fontsize=6)
            fig.tight_layout()
            path = out / f"{prefix}-{wname}-n{n}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            made.append(path)
    return made


def _workload_lines(res: dict) -> list[str]:
    lines = []
    proto = res["protocol"]
    for wname, w in res["workloads"].items():
        better = "higher" if w.get("higher_is_better", "acc" in w["metric"]) else "lower"
        size = f"{w['params']:,} parameters" if w.get("params") else "parameters not recorded"
        if w.get("task") == "lm":
            carve = (f"the validation carve is the {proto.get('text_eval_bytes', '?'):,} bytes of training text just "
                     "before the test tail (the corpus's last bytes)")
            data = (f"`{w['data']}` corpus, {w['samples_per_node']:,} windows of {w['context']} + 1 bytes per node, "
                    "spread evenly over the training text")
        else:
            carve = f"the validation carve is {proto['validation_fraction']:.0%} of the training samples, fixed seed"
            data = f"`{w['data']}`, {w['samples_per_node']:,} training samples per node"
        lines.append(f"- **{wname}**: model `{w['model']}` ({size}), data {data}; batch {w.get('batch_size', '?')} "
                     f"per node, {w['tune_epochs']} epochs to tune, {w['epochs']} for the final runs; recipe "
                     f"`{' '.join(w.get('recipe') or []) or '-'}`"
                     + (f"; model options {', '.join(f'{k}={_option_text(v)}' for k, v in w['model_options'].items())}"
                        if w.get("model_options") else "")
                     + f"; target {_fmt_metric(w['metric'], w['target'])} "
                     f"{w['metric']} ({better} is better), held within {w.get('hold_tolerance', Workload.hold_tolerance):g}; "
                     f"{carve}; node counts "
                     f"{', '.join(w['nodes']) or 'none run yet'}.")
    return lines


def cost_table(res: dict) -> str:
    """Measured cost per workload and node count: trials, CPU seconds per trial (tuning
    and final apart), the 1-minute load the trials ran under."""
    trials = res.get("trials") or []
    if not trials:
        return ""
    groups: dict[tuple[str, int], dict[str, list]] = {}
    for r in trials:
        g = groups.setdefault((r["workload"], r["nodes"]), {"tune": [], "final": [], "load": []})
        g[r["stage"]].append(r.get("cpu_s", 0.0))
        g["load"] += [x for x in r.get("load") or [] if x is not None]
    rows = ["| workload | nodes | trials | CPU s per tuning trial | CPU s per final trial | CPU minutes | "
            "1-min load during |", "|---|---|---|---|---|---|---|"]
    for (w, n), g in groups.items():
        mean = lambda xs: f"{sum(xs) / len(xs):.0f}" if xs else "-"  # noqa: E731
        load = f"{min(g['load']):.1f} to {max(g['load']):.1f}" if g["load"] else "not recorded"
        rows.append(f"| {w} | {n} | {len(g['tune']) + len(g['final'])} | {mean(g['tune'])} | {mean(g['final'])} | "
                    f"{(sum(g['tune']) + sum(g['final'])) / 60:.1f} | {load} |")
    return "\n".join(rows)


def estimate_section(spec: Spec, measured: dict, prov: dict, source: str, jobs: int = 14) -> str:
    """What the whole of ``spec`` would cost, from the trials measured in a results file."""
    planned = plan(spec)
    est = estimate(spec, measured.get("trials", []), planned)
    loads = sorted(x for r in measured.get("trials", []) for x in (r.get("load") or []) if x is not None)
    at_end = [x[0] for x in (prov.get("load_before"), prov.get("load_after")) if x]
    load = (f"the trials ran at a 1-minute load of {loads[0]:.1f} to {loads[-1]:.1f}" if loads else
            f"the trials' own load was not recorded, the 1-minute load was {max(at_end):.1f} when the file was "
            "written" if at_end else "load not recorded")
    # a results file resumed over sessions holds trials of each: name every session's date and machine
    where = list(dict.fromkeys(
        f"{str(x.get('date', '?'))[:10]} on {x.get('machine', {}).get('cores', '?')} cores of "
        f"{x.get('machine', {}).get('cpu', '?')}" for x in [*(measured.get("sessions") or []), prov]))
    lines = [f"Estimated from the CPU time per epoch of the trials in `{source}` (collected "
             f"{' and '.join(where)}, {load}: "
             "CPU seconds taken on a crowded machine are inflated, so this errs high; a node count not measured "
             "scales from the nearest measured one in proportion to the nodes):", "",
             "| part of the spec | trials | CPU minutes | minutes on " + str(jobs) + " cores |", "|---|---|---|---|"]
    for g, v in est["groups"].items():
        lines.append(f"| {g} | {v['trials']} | {v['cpu_s'] / 60:.0f} | {v['cpu_s'] / 60 / jobs:.1f} |")
    lines.append(f"| **all of `{spec.source}`** | {len(planned)} | {est['cpu_s'] / 60:.0f} | "
                 f"{est['cpu_s'] / 60 / jobs:.1f} |")
    return "\n".join(lines)


def figure_paths(res: dict, out: Path, prefix: str) -> list[Path]:
    """The figures :func:`plots` draws, in its order, without drawing them."""
    return [out / f"{prefix}-{wname}-n{n}.png" for wname, w in res["workloads"].items() for n in w["nodes"]]


def report(res: dict, md: Path, fig_dir: Path, title: str | None = None, extra: str = "", *,
           write: bool = True, bandwidths: Sequence[str] | None = None,
           latencies: Sequence[str] | None = None, stragglers: Sequence[str] | None = None) -> str:
    """The Markdown page: the options as run, protocol, verdict table (runs that hold the
    target) and the one by the criterion before, the tuning grids, the performance profile,
    per-method tables, cost, figures, provenance; ``extra`` (Markdown) goes before the
    figures. The analysis is scored again from the trials (:func:`rescore`), at
    ``bandwidths`` x ``latencies`` if given, and under the ``stragglers`` settings if
    given. ``write=False``: the page's text only (its figures those already drawn),
    nothing written."""
    res = {**rescore(res, bandwidths, latencies, stragglers), "provenance": res.get("provenance", {})}
    prof = profiles([res])
    prof_path = fig_dir / f"{md.stem}-profile.png"
    if write:
        fig_dir.mkdir(parents=True, exist_ok=True)
        figs = plots(res, fig_dir, md.stem)
        drawn = (profile_plot(prof, prof_path) is not None) if prof["methods"] else None
    else:
        figs = [f for f in figure_paths(res, fig_dir, md.stem) if f.exists()]
        drawn = True if prof_path.exists() else None
    prof_rel = f"{os.path.relpath(fig_dir, md.parent)}/{prof_path.name}"
    p = res.get("provenance", {})
    m = p.get("machine", {})
    proto = res["protocol"]
    cov = res.get("coverage")
    sessions = res.get("sessions") or []
    lines = [
        f"# {title or 'The benchmark: every method on the same budget'}",
        "",
        "<!-- generated by experiments/benchmark.py report from the results file; do not edit by hand -->",
        "",
        f"Made by `{_provenance.as_module(p.get('command', '?'))}` at commit `{(p.get('commit') or '?')[:10]}`"
        f"{' (dirty tree)' if p.get('dirty') else ''} on {p.get('date', '?')}, {m.get('cpu', '?')} "
        f"({m.get('cores', '?')} cores, memcpy {m.get('memcpy_gbps', '?')} GB/s), load {p.get('load_before', '?')} "
        f"before and {p.get('load_after', '?')} after, torch {p.get('torch', '?')}"
        + (f"; it resumed {len(sessions)} earlier session(s) ("
           + ", ".join(f"{(x.get('date') or '?')[:10]} at `{(x.get('commit') or '?')[:10]}`" for x in sessions)
           + ")" if sessions else "") + "."
        + (f" The results file was then converted {p['converted']}, from the same run directories."
           if p.get("converted") else ""),
        "",
    ]
    lines += [f"**Warning**: {w}." for w in res.get("warnings") or []] + ([""] if res.get("warnings") else [])
    if cov:
        lines += [f"Trials finished: {cov['finished']} of the {cov['planned']} the spec plans, "
                  f"{cov['cpu_s'] / 60:.0f} CPU minutes in all."
                  + ("" if cov["finished"] >= cov["planned"] else
                     " Methods whose tuning has not all run are not listed; a method with fewer final seeds than "
                     "the protocol's is ranked nowhere."), ""]
    opts = options_table(res)
    if opts:
        kept = protocol_kept(res)
        lines += ["## Options as run", "",
                  "This part kept the protocol below: every option as stated, every grid closed." if kept == "kept"
                  else f"This part did not keep the protocol below in full ({kept.removeprefix('not kept: ')}).", "",
                  opts, ""]
    rescored = res.get("rescored") or {}
    added = [k for k in rescored.get("links", []) if k not in rescored.get("from", [])]
    ext = proto.get("grid_extensions")
    lines += [
        "## Protocol",
        "",
        "Fixed before any result was read, the same for every method:",
        "",
        f"- Each method: learning rate on the grid {proto['lr_factors']} x its default, one tuning run each "
        f"(seed {proto['tune_seed']}) at the short horizon, on the training data less a validation carve; every "
        "other option is the method's paper default or an override with its reason (the table above); "
        + (f"a rate selected at the edge of the rates tried extends the grid by a factor "
           f"{proto.get('grid_factor', GRID_FACTOR):g}, up to {ext} times (below); " if ext is not None else
           "the grid was not extended where the pick lay at its edge (below); ")
        + f"selection: {proto['selection']}.",
        f"- The selected setting runs with seeds {proto['seeds']} on the whole training data; the test split is "
        "read only by these final runs (tuning runs are not handed it).",
        "- Time to target is modelled per link from each run's bytes, message rounds and measured compute and "
        "codec time; mean and 95 % Student-t interval over seeds. A run reaches the target when its test metric "
        "crosses it and its final metric holds it (within the workload's tolerance); the time is its first "
        "crossing. A method is ranked at a link only if every seed holds the target. The lead is beyond the "
        "intervals when the winner's upper bound lies below the second's lower bound."
        + (f" The links {', '.join(added)} were scored from the runs' recorded bytes, rounds and compute after "
           "the runs (no training again)." if added else ""),
        f"- Every trial computes on `{proto.get('device', 'cpu')}`; every node count trains on the same data per "
        "node.",
        "",
        "Workloads:",
        "",
        *_workload_lines(res),
        "",
        "## Verdict",
        "",
        *([] if res["links"] else ["No link to model: the spec's links list no bandwidth or no latency, so no "
                                   "time to target is modelled and no method is ranked.", ""]),
        verdict_table(res),
        "",
        *(["## Held against ever crossed", "", criteria_table(res), ""] if criteria_table(res) else []),
        "## Tuning grids",
        "",
        grid_table(res),
        "",
        "## Performance profile",
        "",
        profile_section(prof, prof_rel, drawn),
        "",
        *(["## Verdict with unequal nodes", "",
           "The same trials, each synchronous step waiting for the slowest node: the compute time of every "
           "point multiplied by the setting's largest multiplier at that node count (docs/heterogeneous.md).",
           "", straggler_tables(res), ""] if straggler_tables(res) else []),
        "## Per method",
        "",
        method_tables(res),
    ]
    cost = cost_table(res)
    if cost:
        lines += ["## Cost", "", "CPU time of the trials as measured (each trial single-threaded; "
                  "a figure taken under a load above the machine's cores is inflated):", "", cost, ""]
    if extra:
        lines += [extra, ""]
    if figs:
        lines += ["## Figures", ""]
        rel = os.path.relpath(fig_dir, md.parent)
        lines += [f"![{f.stem}]({rel}/{f.name})\n" for f in figs]
    text = "\n".join(lines) + "\n"
    if write:
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(text, encoding="utf-8")
    return text


def estimate(spec: Spec, trials: Sequence[dict], planned: Sequence[Trial]) -> dict:
    """CPU seconds the planned trials will take, from measured ones: per workload and node
    count, the measured CPU seconds per epoch (a node count not measured scales from the
    nearest one measured, in proportion to the nodes)."""
    per: dict[tuple[str, int], list[float]] = {}
    for r in trials:
        epochs = next((int(a) for k, a in zip(r["args"], r["args"][1:]) if k == "--epochs"), None)
        if r.get("status") == "ok" and epochs:
            per.setdefault((r["workload"], r["nodes"]), []).append(r["cpu_s"] / epochs)
    rate = {k: sum(v) / len(v) for k, v in per.items()}
    out: dict[str, Any] = {"groups": {}, "cpu_s": 0.0}
    for t in planned:
        wl = t.workload
        got = [(n, r) for (w, n), r in rate.items() if w == wl.name]
        if not got:
            raise SpecError(f"--estimate: no measured trial of workload {wl.name!r}")
        n0, r0 = min(got, key=lambda x: abs(math.log(x[0] / t.nodes)))
        cpu = r0 * t.nodes / n0 * (wl.tune_epochs if t.stage == "tune" else wl.epochs)
        g = out["groups"].setdefault(f"{wl.name} n={t.nodes}", {"trials": 0, "cpu_s": 0.0})
        g["trials"] += 1
        g["cpu_s"] += cpu
        out["cpu_s"] += cpu
    return out


#: the page's section on running the benchmark (``report --running``)
RUNNING = """## Running it

```
python -m experiments.benchmark plan --spec experiments/benchmark.toml            # the trials, one a line
python -m experiments.benchmark run --spec experiments/benchmark.toml --out runs/bench --jobs 2
python -m experiments.benchmark report --results runs/bench/benchmark.json --md runs/bench/report.md
make results-tables                                   # re-render the docs' tables from experiments/results/
```

- **Checked before anything runs.** `run` and `plan` read every field of the spec first: its
  type and range, the methods' `--algo` and the workloads' models (gossip.train's), a batch that
  each node's share of the data fills, rates in tc's units read as tc reads them (`100mbps` is
  megabytes per second; `100M` and `100MB` are refused), and latencies with a unit. A method's
  `flags` may not set what the workload gives every method alike (`--epochs`, `--max-steps`,
  `--batch-size`, `--simulate`, the data and the model) nor what the protocol sets (`--lr`,
  `--seed`, `--device`, `--out`, `--config`). Then every trial's arguments are parsed by
  gossip.train itself. A bad field is one line naming the file and the field, e.g.
  `spec.toml: methods.signum.flags: --epochs sets the workload's budget ...`; exit 2, nothing run.
- **The protocol in the spec.** A method's `flags` name its algorithm and variant (`--bits`,
  `--compressor`); every option of the algorithm keeps its paper default unless the method lists it
  in `overrides = {KEY = {value = V, reason = "why"}}`, run as `--algo-opt KEY=V`. An override
  without a reason, or an `--algo-opt` in the flags, is refused in one line. The report opens with
  every method's options as run, each override marked with its reason. A workload's
  `hold_tolerance` (default 0.005, in the metric's units: half a point of accuracy) is how far
  from the target a run's final metric may end and still hold it: a run reaches the target when
  its test metric crosses it and it holds it, and its time to target is the first crossing. Its
  `model_options` (e.g. `{layers = 2, width = 64, heads = 4}`) is the model's size knob, run as
  `--model-opt KEY=V`. `grid_extensions` (default 3): when the selected rate is the smallest or
  largest tried, the tuner tries the next rate a factor 2 beyond it, up to that many times, until
  the pick is interior or the next rate diverges; the report lists each extension.
- **Dry run.** `run --dry-run` (and `plan`) check the spec and every trial's arguments, print each
  workload's parameter count (the model built on torch's meta device: no weights allocated) and
  the trials, `run --dry-run` with each one's command line, and run nothing.
  `experiments/benchmark-gpu.toml` runs a byte-level GPT of about 25 M parameters (8 layers of width
  512) at 4 and 16 nodes on one GPU (`device = "cuda"`); its dry run is checked on the CPU. gossip's
  vectorized simulation batches classification models only, so its nodes run one after another on
  the GPU (`--simulate-mode auto` says so in the run's log).
- **Scored again without training.** `report --links-from SPEC` scores every run at that spec's
  links from its recorded bytes, message rounds and compute: a link added to the spec needs no
  training again. `report --stragglers-from SPEC` adds the verdicts under that spec's straggler
  settings from the same trials (every synchronous step waits for the slowest node), so a results
  file made before the settings existed gets their tables.
- **Resumable.** A trial whose run directory holds its record (`trial.json`, with the trial's
  figures) is never redone; an interrupted `run` goes on where it stopped, and widening the spec
  (a seed, a method) runs only what is new. A record counts only if it ran the arguments the
  spec now asks for (a changed horizon or recipe runs the trial again).
- **In parts, on other machines.** `--workloads`, `--nodes` and `--methods` keep a part of the spec
  (each kept method still gets its whole grid and every seed: the protocol is the same). The
  results file (`--results`, default `OUT/benchmark.json`) holds every finished trial's figures
  and is all that `report` needs. `--resume FILE` (repeatable) takes the trials of an earlier
  session's results file as finished, so a session on another machine continues from the file
  alone, and the report names every session. `--stop-after SECONDS` starts no trial after that
  time; SIGTERM (a `timeout` running out) abandons the running trials, which are run again next
  time, and the results file is still written:

  ```
  timeout -k 30 480 python -m experiments.benchmark run --spec experiments/benchmark.toml \\
      --out runs/bench --nodes 4 --jobs 14 --stop-after 390 --results results/benchmark.json \\
      --resume experiments/results/benchmark-mnist1d-n4-n16.json
  ```
- **Cost.** `plan --estimate RESULTS --jobs N` estimates the CPU time of (a part of) the spec from
  the trials measured in a results file; the table below is that estimate for the whole spec.
  Trials run with `gossip.train --no-node-eval`: the accuracy of each node's own model at every
  epoch's end, which the benchmark never reads, was a fifth to a third of the CPU time of a
  16-node tuning trial (six methods measured, 2 epochs). Every figure the benchmark reads (the
  metric, bytes and steps) is the same bit for bit with or without it, so a trial recorded
  without the flag still counts as finished.
- **Selection needs the tuning.** A method's final runs start as soon as its own tuning has
  finished, so with `--jobs` the methods complete one after another and a cut run leaves whole
  methods; the report lists only methods whose tuning has all run, and ranks a method at a link
  only if every seed of the protocol reached the target.
- **Measured on shaped links.** `sudo python -m experiments run benchmark_netns --results RESULTS
  --out runs/bench-netns --netns-results NETNS` runs each method's final trial of seed 0 again
  as 4 torchrun ranks in network namespaces, each link shaped with tc to 10 and 100 Mbit/s
  (as the race's netns mode does), and stops it at the target; `report --netns NETNS` adds the
  measured times next to the modelled ones. It needs root and a quiet machine (wall-clock times).
  `--methods A,B --resume NETNS` measures a few methods at a time and keeps the earlier runs, so
  the field can be measured in several quiet windows; an interrupted run keeps what finished. A
  method whose simulated trial never reached the target at a link is not measured there (the
  report lists it; `--also-unreached` measures it anyway)."""


# ----------------------------------------------------------------------------- CLI


def _csv(text: str | None, kind=str) -> list | None:
    if not text:
        return None
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecError(f"expected a comma-separated list, got {text!r}") from None


def _filters(a: argparse.Namespace, spec: Spec) -> dict:
    f = {"workloads": _csv(a.workloads), "nodes": _csv(a.nodes, int), "methods": _csv(a.methods)}
    known = {"workloads": [w.name for w in spec.workloads], "methods": [m.name for m in spec.methods],
             "nodes": sorted({n for w in spec.workloads for n in w.nodes})}
    for k, v in f.items():
        bad = [x for x in v or () if x not in known[k]]
        if bad:
            raise SpecError(f"--{k} {','.join(map(str, bad))}: not in the spec; it has {', '.join(map(str, known[k]))}")
    return f


def _print_plan(spec: Spec, trials: Sequence[Trial], out: Path | None = None) -> None:
    """The plan: each workload's model and parameter count, then every trial (with ``out``,
    each one's gossip.train command line, a final run's rate written as the selection)."""
    counts = parameter_counts(spec)
    for wl in spec.workloads:
        opts = ", ".join(f"{k}={_option_text(v)}" for k, v in wl.model_options)
        print(f"workload {wl.name}: model {wl.model}" + (f" ({opts})" if opts else "")
              + f", {counts[wl.name]:,} parameters; nodes {', '.join(map(str, wl.nodes))}; "
              f"{wl.epochs} epochs ({wl.tune_epochs} to tune); device {spec.device}")
    for t in trials:
        line = (f"{t.workload.name} n={t.nodes} {t.method.name} {t.stage} "
                f"{'lr=' + format(t.lr, 'g') if t.lr else 'lr=selected'} seed={t.seed}")
        if out is not None:
            args = _train_args(t, t.lr if t.lr else t.method.lr, t.run_dir(out), spec.device)
            if not t.lr:
                args[args.index("--lr") + 1] = "SELECTED"
            line += ": python -m gossip.train " + " ".join(args)
        print(line)
    print(f"{len(trials)} trials" + (f" (and up to {spec.grid_extensions} more per method where a grid is extended)"
                                     if spec.grid_extensions else ""))


class _Kept:
    """An earlier provenance record, written again as it was (``collect --provenance-of``)."""

    def __init__(self, prov: dict) -> None:
        self.prov = prov

    def finish(self) -> dict:
        return self.prov


def stamp(prov: dict, commit: str) -> dict:
    """Fill in the commit and the sources' ids of a provenance record made on a machine
    without a git checkout (a copy of the tree), from this checkout's git at ``commit``;
    the record says it was stamped. Refused for a record that has a commit."""
    if prov.get("commit"):
        raise SpecError(f"stamp: the results already record commit {prov['commit'][:10]}; nothing to fill in")
    full = _provenance.git("rev-parse", "--verify", f"{commit}^{{commit}}")
    if full is None:
        raise SpecError(f"stamp: --commit {commit!r} is not a commit of this checkout")
    ids = _provenance.source_ids(prov.get("sources") or SOURCES, rev=full)
    prov.update(commit=full, dirty=None, source_ids=ids,
                stamped="commit and source ids filled in afterwards with `experiments/benchmark.py stamp`: the "
                        "machine that ran it had a copy of the tree at that commit and no git checkout")
    return prov


def read_results(path: Path) -> tuple[dict, dict]:
    try:
        return _provenance.read(path)
    except OSError as e:
        raise SpecError(f"{path}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:
        raise SpecError(str(e)) from None


def read_benchmark_results(path: Path) -> tuple[dict, dict]:
    """``(results, provenance)`` of a benchmark results file; SpecError (one line naming
    ``--results PATH``) if it cannot be read or is not one."""
    try:
        results, prov = _provenance.read(path)
    except OSError as e:
        raise SpecError(f"--results {path}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:
        raise SpecError(str(e)) from None
    if not isinstance(results, dict) or "workloads" not in results or "protocol" not in results:
        raise SpecError(f"--results {path}: not a benchmark results file (no 'workloads' and 'protocol')")
    return results, prov


def _write_results(spec: Spec, out: Path, path: Path, record, sessions: list, counts: dict | None) -> dict:
    trials = collect(spec, out)
    # what `python -m experiments verify` witnesses: each group's final run of the first seed,
    # at the selected learning rate (not the tuning trials, nor the other seeds)
    for rec in trials:
        if rec.get("stage") == "final" and rec.get("seed") == spec.seeds[0]:
            _provenance.record_config(rec.get("args", []))
    res = analyse(spec, trials)
    res.update(spec=spec.raw, counts=counts, sessions=sessions, trials=trials)
    _provenance.write(path, res, record)
    return res


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run every unfinished trial, then write the results file")
    r.add_argument("--spec", required=True)
    r.add_argument("--out", required=True, help="the run directories, one per trial")
    r.add_argument("--results", default=None, help="the results file (default: OUT/benchmark.json)")
    r.add_argument("--jobs", type=int, default=1, help="trials run at a time, each in its own process with "
                   "OMP_NUM_THREADS=1 unless set (default 1: in this process)")
    r.add_argument("--resume", action="append", default=[], metavar="RESULTS",
                   help="a results file of an earlier session: its trials count as finished (repeatable)")
    r.add_argument("--dry-run", action="store_true",
                   help="check the spec and every trial's arguments, print the plan (each workload's parameter "
                        "count, every trial, its command line) and run nothing")
    r.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                   help="start no trial after this many seconds (running ones finish); SIGTERM stops at once")
    pl = sub.add_parser("plan", help="list the trials the spec asks for")
    pl.add_argument("--spec", required=True)
    pl.add_argument("--estimate", default=None, metavar="RESULTS",
                    help="estimate the CPU time from the trials measured in this results file")
    pl.add_argument("--jobs", type=int, default=1, help="with --estimate: the wall time on this many cores")
    for q in (r, pl):
        q.add_argument("--workloads", default=None, help="comma-separated: only these workloads")
        q.add_argument("--nodes", default=None, help="comma-separated: only these node counts")
        q.add_argument("--methods", default=None, help="comma-separated: only these methods")
    co = sub.add_parser("collect", help="write the results file from the run directories, running nothing")
    co.add_argument("--spec", required=True)
    co.add_argument("--out", required=True)
    co.add_argument("--results", default=None, help="the results file (default: OUT/benchmark.json)")
    co.add_argument("--provenance-of", default=None, metavar="RESULTS",
                    help="keep the provenance record of this earlier results file made from the same run "
                         "directories (converting it to this layout), instead of recording this command")
    st = sub.add_parser("stamp", help="fill in the commit of a results file made where there was no git checkout")
    st.add_argument("--results", required=True)
    st.add_argument("--commit", required=True, help="the commit the run's tree was (its sources' ids are read here)")
    rp = sub.add_parser("report", help="write the Markdown page and figures from a results file")
    src = rp.add_mutually_exclusive_group(required=True)
    src.add_argument("--results", help="the results file (its trials and analysis; no run directory needed)")
    src.add_argument("--out", help="a benchmark's directory holding benchmark.json")
    rp.add_argument("--md", default=None, help="the page to write (default: report.md beside the results file)")
    rp.add_argument("--figures", default=None, help="folder of the figures (default: beside --md)")
    rp.add_argument("--title", default=None, help="the page's title")
    rp.add_argument("--estimate", nargs=2, default=None, metavar=("SPEC", "RESULTS"),
                    help="add what the whole of SPEC would cost, from the trials measured in RESULTS")
    rp.add_argument("--running", action="store_true", help="add the section on running the benchmark")
    rp.add_argument("--links-from", default=None, metavar="SPEC",
                    help="score the runs at this spec's links (from their recorded bytes, rounds and compute; "
                         "no training) instead of the results file's")
    rp.add_argument("--stragglers-from", default=None, metavar="SPEC",
                    help="add the verdicts under this spec's straggler settings, modelled from the same trials "
                         "(each synchronous step waits for the slowest node; no training)")
    rp.add_argument("--netns", default=None, metavar="RESULTS",
                    help="add the runs measured in the netns cluster (experiments/benchmark_netns.py's results)")
    a = p.parse_args(argv)
    try:
        if a.cmd == "plan":
            spec = load_spec(a.spec)
            trials = plan(spec, **_filters(a, spec))
            _check_trials(spec, Path("OUT"))
            if a.estimate:
                res, _ = read_results(Path(a.estimate))
                est = estimate(spec, res.get("trials", []), trials)
                for g, v in est["groups"].items():
                    print(f"{g}: {v['trials']} trials, {v['cpu_s'] / 60:.1f} CPU minutes")
                jobs = max(1, a.jobs)
                print(f"{len(trials)} trials, {est['cpu_s'] / 60:.1f} CPU minutes: about "
                      f"{est['cpu_s'] / 60 / jobs:.1f} minutes on {jobs} cores")
                return 0
            _print_plan(spec, trials)
            return 0
        if a.cmd == "run":
            spec = load_spec(a.spec)  # every field checked, in a fraction of a second
            filters = _filters(a, spec)
            out = Path(a.out)
            _check_trials(spec, out)  # every trial's arguments, as gossip.train reads them, before any runs
            if a.dry_run:
                _print_plan(spec, plan(spec, **filters), out)
                return 0
            path = Path(a.results) if a.results else out / "benchmark.json"
            record = _provenance.start(SOURCES, argv=["experiments/benchmark.py", *argv])
            sessions = _import_records([Path(x) for x in a.resume], out)
            counts = run(spec, out, jobs=max(1, a.jobs), stop_after=a.stop_after, **filters)
            res = _write_results(spec, out, path, record, sessions, counts)
            cov = res["coverage"]
            part = {t.key for t in plan(spec, **filters)}
            done = sum(r["key"] in part for r in res["trials"])
            print(f"benchmark: {counts['ran']} ran ({counts['failed']} failed), {counts['skipped']} already "
                  f"finished; {cov['finished']} of {cov['planned']} planned trials done"
                  + (f" ({done} of the {len(part)} asked for)" if len(part) < cov["planned"] else "")
                  + f"; results in {path}", flush=True)
            if counts["stopped"]:  # SIGTERM: leave now, abandoned workers and their threads included
                sys.stderr.flush()
                os._exit(128 + 15)
            return 0
        if a.cmd == "stamp":
            path = Path(a.results)
            results, prov = read_results(path)
            stamp(prov, a.commit)
            _provenance.write(path, results, _Kept(prov))
            print(f"benchmark: {path} stamped with commit {prov['commit'][:10]}")
            return 0
        if a.cmd == "collect":
            spec = load_spec(a.spec)
            out = Path(a.out)
            path = Path(a.results) if a.results else out / "benchmark.json"
            if a.provenance_of:
                _, old = read_results(Path(a.provenance_of))
                record = _Kept({**old, "converted": f"to the layout with trials by `experiments/benchmark.py "
                                                   f"{' '.join(argv)}`"})
            else:
                record = _provenance.start(SOURCES, argv=["experiments/benchmark.py", *argv])
            res = _write_results(spec, out, path, record, [], None)
            print(f"benchmark: {res['coverage']['finished']} of {res['coverage']['planned']} planned trials "
                  f"collected into {path}")
            return 0
        results, prov = read_benchmark_results(Path(a.results) if a.results else Path(a.out) / "benchmark.json")
        res = {**results, "provenance": prov}
        md = Path(a.md) if a.md else (Path(a.results).parent if a.results else Path(a.out)) / "report.md"
        extra = RUNNING if a.running else ""
        if a.estimate:
            measured, mprov = read_results(Path(a.estimate[1]))
            extra += "\n\n### What the whole spec costs\n\n" + estimate_section(
                load_spec(a.estimate[0]), measured, mprov, a.estimate[1])
        if a.netns:
            measured, nprov = read_results(Path(a.netns))
            if not isinstance(measured, dict) or "runs" not in measured or "bandwidths" not in measured:
                raise SpecError(f"--netns {a.netns}: not a results file of experiments/benchmark_netns.py")
            cal = calibration_section(measured, results)
            extra = (tables.benchmark_netns_section(measured, nprov)
                     + (f"\n\n### The time model, calibrated\n\n{cal}" if cal else "") + "\n\n" + extra)
        links = load_spec(a.links_from) if a.links_from else None
        slow = load_spec(a.stragglers_from).stragglers if a.stragglers_from else None
        report(res, md, Path(a.figures) if a.figures else md.parent, title=a.title, extra=extra.strip(),
               bandwidths=links.bandwidths if links else None, latencies=links.latencies if links else None,
               stragglers=slow)
        print(f"benchmark: report in {md}")
        return 0
    except (SpecError, crossover.CrossoverError) as e:
        print(f"benchmark: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
