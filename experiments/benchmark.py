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


def _train_args(t: Trial, lr: float, run_dir: Path, device: str = "cpu") -> list[str]:
    wl = t.workload
    role = "val" if t.stage == "tune" else "test"
    epochs = wl.tune_epochs if t.stage == "tune" else wl.epochs
    data = bench_data.dataset_name(wl.data, wl.samples_per_node * t.nodes, role, wl.context)
    return ["--simulate", str(t.nodes), "--data", data, "--model", wl.model, "--epochs", str(epochs),
            "--batch-size", str(wl.batch_size), *wl.recipe, *t.method.flags, "--lr", f"{lr:g}",
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
    from experiments import race

    run_dir = t.run_dir(out)
    args = _train_args(t, lr, run_dir, device)
    served = len(bench_data.SERVED)
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    cpu0, wall0 = time.process_time(), time.perf_counter()
    rc, err = race.train_in_process(args)
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
    """A method whose tuning has not (all) run yet."""


def _selected_lr(spec: Spec, wl: Workload, n: int, m: Method, out: Path) -> tuple[float, list[dict]]:
    """The learning rate the tuning selected, with the tuning trials' scores. NotRun
    while a tuning trial is unfinished; RuntimeError if every one failed."""
    scores = []
    for f in spec.lr_factors:
        t = Trial(wl, n, m, "tune", round(m.lr * f, 10), spec.tune_seed)
        rec = _finished(t.run_dir(out), wl.metric, _train_args(t, t.lr, t.run_dir(out), spec.device))
        if rec is None:
            raise NotRun(f"the tuning of {m.name} at n={n} on {wl.name} has not finished")
        scores.append({"lr": t.lr, "validation": _score(rec, wl.metric)})
    ok = [s for s in scores if s["validation"] is not None]
    if not ok:
        raise RuntimeError(f"benchmark: every tuning trial of {m.name} at n={n} on {wl.name} failed")
    sign = 1.0 if wl.higher_is_better else -1.0
    best = max(ok, key=lambda s: (sign * s["validation"], -s["lr"]))
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

    def ready(t: Trial) -> float | None | bool:
        """The trial's learning rate if it can start now; False if it must wait; None if
        it is finished (or can never run: its whole tuning failed)."""
        if t.stage == "tune":
            return t.lr
        if t.group not in selected:
            try:
                selected[t.group] = _selected_lr(spec, t.workload, t.nodes, t.method, out)[0]
            except NotRun:
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
        tuning = {t.group for t in [*todo, *running] if t.stage == "tune"}
        for t in list(todo):
            if t.stage == "final" and t.group in tuning:
                continue  # its tuning is still to run or running
            lr = ready(t)
            if lr is None:
                todo.remove(t)
            elif lr is not False:
                todo.remove(t)
                return t, lr
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


def _to_target(result: dict, wl: Workload, bw: float, lat: float,
               slowest: float = 1.0) -> tuple[float | None, float | None]:
    """Modelled time and bytes to the target at a link; ``slowest``: the compute time's
    multiplier (a straggler setting's slowest node, whom every synchronous step waits for)."""
    from experiments import race

    for p in _points(result):
        if _reached(p["metric"], wl.target, wl.higher_is_better):
            if slowest != 1.0:
                p = {**p, "compute_s": p["compute_s"] * slowest}
            return race.modelled_time(p, result["calls_per_step"], result["world_size"], bw, lat), p["bytes"]
    return None, None


def _straggler_verdicts(spec: Spec, wl: Workload, n: int, methods: dict, links: list) -> dict:
    """For each of the spec's straggler settings at ``n`` nodes: its slowest multiplier, each
    method's time to target per link (every seed's compute slowed by it) and the verdicts."""
    from gossip import speeds

    out = {}
    for setting in spec.stragglers:
        slowest = float(speeds.parse(setting, n).multipliers.max())
        slowed = {}
        for name, r in methods.items():
            if "seeds" not in r:
                continue
            stats = {}
            for blabel, bw, llabel, lat in links:
                key = f"{blabel}@{llabel}"
                times = [_to_target(sd["result"], wl, bw, lat, slowest)[0] for sd in r["seeds"].values()]
                reached = [x for x in times if x is not None]
                stats[key] = {"reached": f"{len(reached)}/{len(spec.seeds)}", "all_reached": len(reached) == len(spec.seeds),
                              "time_s": mean_ci(reached) if reached else None}
            slowed[name] = {"links": stats}
        out[setting] = {"slowest": slowest, "methods": slowed, "verdicts": _verdicts(slowed, links)}
    return out


def collect(spec: Spec, out: Path) -> list[dict]:
    """The records of the spec's finished trials under ``out`` (the final runs of the
    learning rate their tuning selected only), in the plan's order."""
    recs = []
    for t in plan(spec):
        if t.stage == "tune":
            lr = t.lr
        else:
            try:
                lr = _selected_lr(spec, t.workload, t.nodes, t.method, out)[0]
            except (NotRun, RuntimeError):
                continue
        rec = _finished(t.run_dir(out), t.workload.metric, _train_args(t, lr, t.run_dir(out), spec.device))
        if rec is not None:
            rec = {k: v for k, v in rec.items() if k != "imported_from"}
            # where it wrote is this machine's business, not the trial's (the key names the trial)
            args = rec.get("args", [])
            rec["args"] = [a for i, a in enumerate(args) if a != "--out" and (i == 0 or args[i - 1] != "--out")]
            recs.append({**rec, "key": t.key})
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
                tune = [Trial(wl, n, m, "tune", round(m.lr * f, 10), spec.tune_seed) for f in spec.lr_factors]
                if any(t.key not in by_key for t in tune):
                    continue  # not (all) run: no selection yet
                scores = [{"lr": t.lr, "validation": _score(by_key[t.key], wl.metric)} for t in tune]
                ok = [x for x in scores if x["validation"] is not None]
                if not ok:
                    methods[m.name] = {"error": f"every tuning trial of {m.name} at n={n} on {wl.name} failed",
                                       "tuning": scores}
                    continue
                sign = 1.0 if wl.higher_is_better else -1.0
                lr = max(ok, key=lambda x: (sign * x["validation"], -x["lr"]))["lr"]
                budget = {"tune": {"runs": 0, "steps": 0, "cpu_s": 0.0}, "final": {"runs": 0, "steps": 0, "cpu_s": 0.0}}
                finals = [Trial(wl, n, m, "final", None, sd) for sd in spec.seeds]
                if all(t.key in by_key for t in finals):
                    complete.append(m.name)
                for t in tune + finals:
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
                                          "params": res["params"], "links": {}}
                    if spec.stragglers:
                        seeds[str(t.seed)]["result"] = res
                    for blabel, bw, llabel, lat in links:
                        t_s, by = _to_target(res, wl, bw, lat)
                        seeds[str(t.seed)]["links"][f"{blabel}@{llabel}"] = {"time_s": t_s, "bytes": by}
                failed = [t.seed for t in finals if by_key.get(t.key, {}).get("status") == "failed"]
                finals_ok = [v["final"] for v in seeds.values() if v["final"] is not None]
                stats = {}
                for blabel, _, llabel, _ in links:
                    key = f"{blabel}@{llabel}"
                    reached = [v["links"][key]["time_s"] for v in seeds.values() if v["links"][key]["time_s"] is not None]
                    byts = [v["links"][key]["bytes"] for v in seeds.values() if v["links"][key]["bytes"] is not None]
                    stats[key] = {"reached": f"{len(reached)}/{len(spec.seeds)}",
                                  "all_reached": len(reached) == len(spec.seeds),
                                  "time_s": mean_ci(reached) if reached else None,
                                  "bytes": mean_ci(byts) if byts else None}
                methods[m.name] = {"lr": lr, "tuning": scores, "seeds": seeds, "links": stats,
                                   "final": mean_ci(finals_ok) if finals_ok else None, "budget": budget,
                                   "seeds_run": f"{len(seeds)}/{len(spec.seeds)}", "seeds_failed": failed,
                                   "flags": list(m.flags), "source": m.source,
                                   "wire": next(iter(seeds.values()))["wire"] if seeds else None}
            if methods:
                # the field the verdicts cover: the methods with every final run finished (ok or failed)
                per_n[str(n)] = {"methods": methods, "verdicts": _verdicts(methods, links),
                                 "field": {"planned": [m.name for m in _methods_at(spec, n)], "complete": complete}}
                if spec.stragglers:
                    per_n[str(n)]["stragglers"] = _straggler_verdicts(spec, wl, n, methods, links)
                    for r in methods.values():  # the curves were needed only for the settings above
                        for sd in r.get("seeds", {}).values():
                            sd.pop("result", None)
        params = next((sd["params"] for nd in per_n.values() for r in nd["methods"].values()
                       for sd in r.get("seeds", {}).values() if sd.get("params")), None)
        result["workloads"][wl.name] = {"nodes": per_n, "target": wl.target, "metric": wl.metric, "params": params,
                                        "higher_is_better": wl.higher_is_better, "task": wl.task,
                                        "epochs": wl.epochs, "tune_epochs": wl.tune_epochs,
                                        "samples_per_node": wl.samples_per_node, "batch_size": wl.batch_size,
                                        "model": wl.model, "data": wl.data, "context": wl.context,
                                        "recipe": list(wl.recipe)}
    result["protocol"] = {"lr_factors": list(spec.lr_factors), "tune_seed": spec.tune_seed, "seeds": list(spec.seeds),
                          "validation_fraction": bench_data.VALIDATION_FRACTION,
                          "text_eval_bytes": bench_data.TEXT_EVAL_BYTES, "device": spec.device,
                          "selection": "best validation metric at the end of tune_epochs; ties to the smaller lr"}
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


def _verdicts(methods: dict, links: list) -> dict:
    out = {}
    for blabel, _, llabel, _ in links:
        key = f"{blabel}@{llabel}"
        ranked = sorted(((name, r["links"][key]["time_s"]) for name, r in methods.items()
                         if "links" in r and r["links"][key]["all_reached"]), key=lambda x: x[1]["mean"])
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


#: the code the benchmark's figures measure (experiments/_provenance.py records their state)
SOURCES = ["experiments/benchmark.py", "experiments/bench_data.py", "experiments/race.py", "gossip"]


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
                     f"`{' '.join(w.get('recipe') or []) or '-'}`; target {_fmt_metric(w['metric'], w['target'])} "
                     f"{w['metric']} ({better} is better); {carve}; node counts "
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
    m = prov.get("machine", {})
    loads = sorted(x for r in measured.get("trials", []) for x in (r.get("load") or []) if x is not None)
    at_end = [x[0] for x in (prov.get("load_before"), prov.get("load_after")) if x]
    load = (f"the trials ran at a 1-minute load of {loads[0]:.1f} to {loads[-1]:.1f}" if loads else
            f"the trials' own load was not recorded, the 1-minute load was {max(at_end):.1f} when the file was "
            "written" if at_end else "load not recorded")
    lines = [f"Estimated from the CPU time per epoch of the trials in `{source}` (collected "
             f"{str(prov.get('date', '?'))[:10]} on {m.get('cores', '?')} cores of {m.get('cpu', '?')}, {load}: "
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
           write: bool = True) -> str:
    """The Markdown page: protocol, verdict table, per-method tables, cost, figures,
    provenance; ``extra`` (Markdown) goes before the figures. ``write=False``: the
    page's text only (its figures those already drawn), nothing written."""
    if write:
        fig_dir.mkdir(parents=True, exist_ok=True)
        figs = plots(res, fig_dir, md.stem)
    else:
        figs = [f for f in figure_paths(res, fig_dir, md.stem) if f.exists()]
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
    lines += [
        "## Protocol",
        "",
        "Fixed before any result was read, the same for every method:",
        "",
        f"- Each method: learning rate on the grid {proto['lr_factors']} x its default, one tuning run each "
        f"(seed {proto['tune_seed']}) at the short horizon, on the training data less a validation carve; every "
        f"other option is the method's paper default; selection: {proto['selection']}.",
        f"- The selected setting runs with seeds {proto['seeds']} on the whole training data; the test split is "
        "read only by these final runs (tuning runs are not handed it).",
        "- Time to target is modelled per link from each run's bytes, message rounds and measured compute and "
        "codec time; mean and 95 % Student-t interval over seeds; a method is ranked at a link only if every "
        "seed reached the target. The lead is beyond the intervals when the winner's upper bound lies below the "
        "second's lower bound.",
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
make results-tables                                   # the README's verdict table, from the results file
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
      --resume experiments/results/benchmark.json
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
            for t in trials:
                print(f"{t.workload.name} n={t.nodes} {t.method.name} {t.stage} "
                      f"{'lr=' + format(t.lr, 'g') if t.lr else 'lr=selected'} seed={t.seed}")
            print(f"{len(trials)} trials")
            return 0
        if a.cmd == "run":
            spec = load_spec(a.spec)  # every field checked, in a fraction of a second
            filters = _filters(a, spec)
            out = Path(a.out)
            _check_trials(spec, out)  # every trial's arguments, as gossip.train reads them, before any runs
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
            extra = tables.benchmark_netns_section(measured, nprov) + "\n\n" + extra
        report(res, md, Path(a.figures) if a.figures else md.parent, title=a.title, extra=extra.strip())
        print(f"benchmark: report in {md}")
        return 0
    except (SpecError, crossover.CrossoverError) as e:
        print(f"benchmark: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
