#!/usr/bin/env python3
"""The neutral benchmark: every method tuned on the same budget, several seeds, per link and node count.

    python experiments/benchmark.py run --spec experiments/benchmark.toml --out runs/bench
    python experiments/benchmark.py report --out runs/bench --md docs/benchmark.md
    python experiments/benchmark.py plan --spec experiments/benchmark.toml      # what would run

``run`` is resumable: a trial whose run directory holds a finished run (its
``summary.json`` with a final metric, and the driver's ``trial.json``) is never redone,
so an interrupted benchmark continues where it stopped, and widening the spec (another
seed, another method) runs only what is new.

The protocol, fixed before any result is read (docs/benchmark.md states it too):

1. **Tuning, the same budget for everyone.** Each method gets the same number of trial
   runs: its learning rate on a grid of ``lr_factors`` times its paper's (or the
   project's documented) default, at a short horizon (``tune_epochs``), seed
   ``tune_seed``. Every other option keeps the method's paper default. The trials train
   on the training set less a fixed 10 % carve and are evaluated on that carve
   (``experiments/bench_data.py``): the test split is never handed to a tuning run.
2. **Selection** on the validation metric at the end of the short horizon (higher
   accuracy, or lower loss), ties to the smaller learning rate. A trial that fails or
   diverges ranks last.
3. **Final runs** of the selected setting with every seed in ``seeds``, on the whole
   training set, evaluated on the test split.
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
embedded default data set).

Output under ``--out``: one run directory per trial
(``<workload>/n<N>/<method>/tune-lr<LR>`` and ``.../seed<S>``, ordinary gossip run
directories), ``benchmark.json`` (every trial, the selection, the per-link statistics,
the verdicts and the provenance), and with ``report``: the Markdown page and the
figures (metric against bytes and against modelled time per link).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(REPO), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

import _provenance  # noqa: E402
import bench_data  # noqa: E402
import race  # noqa: E402
from gossip import crossover, rundir  # noqa: E402

__all__ = ["Spec", "SOURCES", "load_spec", "plan", "run", "analyse", "report", "main"]

_TRIAL = "trial.json"


class SpecError(ValueError):
    """A benchmark spec that cannot be run; one line naming the key."""


@dataclass(frozen=True)
class Workload:
    name: str
    data: str  # base of bench_data: mnist1d or synthetic
    model: str
    samples_per_node: int
    epochs: int
    tune_epochs: int
    batch_size: int
    target: float
    metric: str = "test_acc"
    recipe: tuple[str, ...] = ()
    nodes: tuple[int, ...] = (4,)

    @property
    def higher_is_better(self) -> bool:
        return "acc" in self.metric


@dataclass(frozen=True)
class Method:
    name: str
    flags: tuple[str, ...]
    lr: float
    #: node counts this method is run at (default: every node count of the workload);
    #: methods whose per-node bytes grow with n leave out 64
    max_nodes: int | None = None
    source: str = ""


@dataclass(frozen=True)
class Spec:
    workloads: tuple[Workload, ...]
    methods: tuple[Method, ...]
    seeds: tuple[int, ...] = (0, 1, 2)
    tune_seed: int = 0
    lr_factors: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0)
    bandwidths: tuple[str, ...] = ("10mbit", "100mbit", "1gbit")
    latencies: tuple[str, ...] = ("0", "10ms", "50ms")
    source: str = ""
    raw: dict = field(default_factory=dict, compare=False)


def _need(table: dict, key: str, where: str, kind: type | tuple[type, ...]) -> Any:
    if key not in table:
        raise SpecError(f"{where}: missing key {key!r}")
    v = table[key]
    if not isinstance(v, kind) or isinstance(v, bool):
        raise SpecError(f"{where}.{key} = {v!r}: expected {getattr(kind, '__name__', kind)}")
    return v


def load_spec(path: str | Path) -> Spec:
    """Read and validate a TOML spec (see ``experiments/benchmark.toml``)."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise SpecError(f"--spec {path}: cannot read it ({e.strerror or e})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise SpecError(f"--spec {path}: not valid TOML ({e})") from None
    wls = []
    for name, t in (raw.get("workloads") or {}).items():
        where = f"workloads.{name}"
        nodes = tuple(_need(t, "nodes", where, list))
        if not nodes or not all(isinstance(n, int) and n >= 1 for n in nodes):
            raise SpecError(f"{where}.nodes = {nodes!r}: expected a list of positive integers")
        if t.get("data", "mnist1d") not in ("mnist1d", "synthetic"):
            raise SpecError(f"{where}.data = {t.get('data')!r}: expected 'mnist1d' or 'synthetic'")
        wl = Workload(name=name, data=t.get("data", "mnist1d"), model=_need(t, "model", where, str),
                      samples_per_node=_need(t, "samples_per_node", where, int), epochs=_need(t, "epochs", where, int),
                      tune_epochs=_need(t, "tune_epochs", where, int), batch_size=int(t.get("batch_size", 32)),
                      target=float(_need(t, "target", where, (int, float))), metric=t.get("metric", "test_acc"),
                      recipe=tuple(str(x) for x in t.get("recipe", ())), nodes=nodes)
        if not 1 <= wl.tune_epochs <= wl.epochs:
            raise SpecError(f"{where}: tune_epochs = {wl.tune_epochs} must lie in [1, epochs = {wl.epochs}]")
        wls.append(wl)
    if not wls:
        raise SpecError(f"--spec {path}: no [workloads.NAME] table")
    methods = []
    for name, t in (raw.get("methods") or {}).items():
        where = f"methods.{name}"
        lr = float(_need(t, "lr", where, (int, float)))
        if not lr > 0:
            raise SpecError(f"{where}.lr = {lr}: must be positive")
        methods.append(Method(name=name, flags=tuple(str(x) for x in _need(t, "flags", where, list)), lr=lr,
                              max_nodes=t.get("max_nodes"), source=str(t.get("source", ""))))
    if not methods:
        raise SpecError(f"--spec {path}: no [methods.NAME] table")
    seeds = tuple(raw.get("seeds", (0, 1, 2)))
    factors = tuple(float(f) for f in raw.get("lr_factors", (0.25, 0.5, 1.0, 2.0, 4.0)))
    if not seeds or not factors or any(f <= 0 for f in factors):
        raise SpecError(f"--spec {path}: seeds and lr_factors must be non-empty (lr_factors positive)")
    links = raw.get("links", {})
    for label in links.get("bandwidth", ()):
        crossover.parse_rate(label)
    return Spec(workloads=tuple(wls), methods=tuple(methods), seeds=seeds, tune_seed=int(raw.get("tune_seed", 0)),
                lr_factors=factors, bandwidths=tuple(links.get("bandwidth", Spec.bandwidths)),
                latencies=tuple(str(x) for x in links.get("latency", Spec.latencies)), source=str(path), raw=raw)


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Trial:
    workload: Workload
    nodes: int
    method: Method
    stage: str  # "tune" or "final"
    lr: float | None  # None: the tuning's selection, known once the tuning has run
    seed: int

    def run_dir(self, out: Path, lr: float | None = None) -> Path:
        base = out / self.workload.name / f"n{self.nodes}" / self.method.name.replace(":", "-")
        if self.stage == "tune":
            return base / f"tune-lr{self.lr:.4g}"
        return base / f"seed{self.seed}"


def _methods_at(spec: Spec, n: int) -> list[Method]:
    return [m for m in spec.methods if m.max_nodes is None or n <= m.max_nodes]


def plan(spec: Spec) -> list[Trial]:
    """Every trial the spec asks for: each method's grid, then its seeds."""
    trials = []
    for wl in spec.workloads:
        for n in wl.nodes:
            for m in _methods_at(spec, n):
                trials += [Trial(wl, n, m, "tune", round(m.lr * f, 10), spec.tune_seed) for f in spec.lr_factors]
                trials += [Trial(wl, n, m, "final", None, s) for s in spec.seeds]
    return trials


def _train_args(t: Trial, lr: float, run_dir: Path) -> list[str]:
    wl = t.workload
    role = "val" if t.stage == "tune" else "test"
    epochs = wl.tune_epochs if t.stage == "tune" else wl.epochs
    data = bench_data.dataset_name(wl.data, wl.samples_per_node * t.nodes, role)
    return ["--simulate", str(t.nodes), "--data", data, "--model", wl.model, "--epochs", str(epochs),
            "--batch-size", str(wl.batch_size), *wl.recipe, *t.method.flags, "--lr", f"{lr:g}",
            "--seed", str(t.seed), "--log-every", "1", "--no-progress", "--overwrite", "--out", str(run_dir)]


def _finished(run_dir: Path, metric: str) -> dict | None:
    """The trial record of a finished trial in ``run_dir``, else None."""
    try:
        rec = rundir.read_json(run_dir / _TRIAL)
        summary = rundir.read_json(rundir.summary_path(run_dir))
    except Exception:  # noqa: BLE001 - absent or unreadable: not finished
        return None
    if rec.get("status") == "failed" or summary.get(f"final_{metric}") is not None:
        return rec
    return None


def _run_trial(t: Trial, lr: float, out: Path) -> dict:
    run_dir = t.run_dir(out)
    args = _train_args(t, lr, run_dir)
    served = len(bench_data.SERVED)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    rc, err = race._train(args)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    what = bench_data.SERVED[served:] if len(bench_data.SERVED) > served else [None]
    rec = {"workload": t.workload.name, "nodes": t.nodes, "method": t.method.name, "stage": t.stage, "lr": lr,
           "seed": t.seed, "args": args, "cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
           "data": what[-1], "status": "ok" if rc == 0 else "failed",
           "error": None if rc == 0 else (err.strip().splitlines() or ["?"])[-1]}
    if rc == 0:
        summary = rundir.read_json(rundir.summary_path(run_dir))
        rec["steps"] = summary.get("steps")
    else:
        rec["steps"] = 0
        run_dir.mkdir(parents=True, exist_ok=True)
    rundir.write_json(run_dir / _TRIAL, rec)
    return rec


def _selected_lr(spec: Spec, wl: Workload, n: int, m: Method, out: Path) -> tuple[float, list[dict]]:
    """The learning rate the tuning selected, with the tuning trials' scores."""
    scores = []
    for f in spec.lr_factors:
        t = Trial(wl, n, m, "tune", round(m.lr * f, 10), spec.tune_seed)
        rec = _finished(t.run_dir(out), wl.metric)
        score = None
        if rec is not None and rec["status"] == "ok":
            summary = rundir.read_json(rundir.summary_path(t.run_dir(out)))
            score = summary.get(f"final_{wl.metric}")
            if score is not None and not math.isfinite(score):
                score = None
        scores.append({"lr": t.lr, "validation": score})
    ok = [s for s in scores if s["validation"] is not None]
    if not ok:
        raise RuntimeError(f"benchmark: every tuning trial of {m.name} at n={n} on {wl.name} failed")
    sign = 1.0 if wl.higher_is_better else -1.0
    best = max(ok, key=lambda s: (sign * s["validation"], -s["lr"]))
    return best["lr"], scores


def _pending(spec: Spec, out: Path, stage: str) -> tuple[list[tuple[Trial, float]], int]:
    """The trials of ``stage`` not yet finished (with their learning rate), and how many are."""
    todo, done = [], 0
    for t in plan(spec):
        if t.stage != stage:
            continue
        lr = t.lr if stage == "tune" else _selected_lr(spec, t.workload, t.nodes, t.method, out)[0]
        rec = _finished(t.run_dir(out), t.workload.metric)
        if rec is not None and rec.get("lr") == lr:
            done += 1
        else:
            todo.append((t, lr))
    return todo, done


def _trial_in_child(t: Trial, lr: float, out: Path) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return _run_trial(t, lr, out)


def run(spec: Spec, out: Path, *, jobs: int = 1, log=print) -> dict:
    """Run every trial not yet finished, the tuning before the final runs (which need
    its selection); ``jobs`` trials at a time in worker processes (1: in this process).
    Returns {"ran": k, "skipped": k, "failed": k}."""
    out.mkdir(parents=True, exist_ok=True)
    counts = {"ran": 0, "skipped": 0, "failed": 0}
    for stage in ("tune", "final"):
        todo, done = _pending(spec, out, stage)
        counts["skipped"] += done

        def note(i: int, t: Trial, lr: float, rec: dict) -> None:
            counts["ran"] += 1
            counts["failed"] += rec["status"] != "ok"
            log(f"benchmark: {stage} [{i}/{len(todo)}] {t.workload.name} n={t.nodes} {t.method.name} lr={lr:g} "
                f"seed={t.seed}: {rec['status']} in {rec['wall_s']:.1f} s"
                + (f" ({rec['error']})" if rec["error"] else ""), flush=True)

        if jobs <= 1:
            for i, (t, lr) in enumerate(todo, 1):
                note(i, t, lr, _run_trial(t, lr, out))
            continue
        import concurrent.futures as cf
        import multiprocessing as mp

        with cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
            futs = {pool.submit(_trial_in_child, t, lr, out): (t, lr) for t, lr in todo}
            for i, f in enumerate(cf.as_completed(futs), 1):
                note(i, *futs[f], f.result())
    return counts


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


def _curve(run_dir: Path, metric: str) -> dict:
    c = race.curve(run_dir)
    if metric != "test_acc":  # race.curve reads test_acc; take the workload's metric instead
        recs = {r["step"]: r for r in rundir.read_metrics(rundir.metrics_path(run_dir, 0)) if r["kind"] == "eval"}
        for p in c["points"]:
            p["test_acc"] = recs[p["step"]][metric]
    summary = rundir.read_json(rundir.summary_path(run_dir))
    c["final"] = summary.get(f"final_{metric}")
    c["params"] = summary.get("params")
    return c


def _reached(value: float, target: float, higher: bool) -> bool:
    return value >= target if higher else value <= target


def _to_target(c: dict, wl: Workload, bw: float, lat: float) -> tuple[float | None, float | None]:
    for p in c["points"]:
        if _reached(p["test_acc"], wl.target, wl.higher_is_better):
            return race.modelled_time(p, c["calls_per_step"], c["world_size"], bw, lat), p["bytes"]
    return None, None


def analyse(spec: Spec, out: Path) -> dict:
    """Selection, per-link statistics and verdicts from the finished trials under ``out``."""
    links = [(b, crossover.parse_rate(b), lat, crossover.parse_time(lat))
             for b in spec.bandwidths for lat in spec.latencies]
    result: dict[str, Any] = {"workloads": {}}
    for wl in spec.workloads:
        per_n = {}
        for n in wl.nodes:
            methods = {}
            for m in _methods_at(spec, n):
                budget = {"tune": {"runs": 0, "steps": 0, "cpu_s": 0.0}, "final": {"runs": 0, "steps": 0, "cpu_s": 0.0}}
                try:
                    lr, scores = _selected_lr(spec, wl, n, m, out)
                except RuntimeError as e:
                    methods[m.name] = {"error": str(e)}
                    continue
                for t in [Trial(wl, n, m, "tune", s["lr"], spec.tune_seed) for s in scores] + \
                         [Trial(wl, n, m, "final", None, s) for s in spec.seeds]:
                    rec = _finished(t.run_dir(out), wl.metric)
                    if rec is not None:
                        b = budget[t.stage]
                        b["runs"] += 1
                        b["steps"] += rec.get("steps") or 0
                        b["cpu_s"] = round(b["cpu_s"] + rec.get("cpu_s", 0.0), 3)
                seeds = {}
                for s in spec.seeds:
                    rd = Trial(wl, n, m, "final", None, s).run_dir(out)
                    rec = _finished(rd, wl.metric)
                    if rec is None or rec["status"] != "ok" or rec.get("lr") != lr:
                        continue
                    c = _curve(rd, wl.metric)
                    seeds[s] = {"final": c["final"], "wire": c["wire"]["label"], "params": c["params"],
                                "curve": [{"step": p["step"], "metric": p["test_acc"], "bytes": p["bytes"],
                                           "compute_s": p["compute_s"], "codec_s": p["codec_s"]} for p in c["points"]],
                                "links": {}}
                    for blabel, bw, llabel, lat in links:
                        t_s, by = _to_target(c, wl, bw, lat)
                        seeds[s]["links"][f"{blabel}@{llabel}"] = {"time_s": t_s, "bytes": by}
                    seeds[s]["calls_per_step"] = c["calls_per_step"]
                finals = [v["final"] for v in seeds.values() if v["final"] is not None]
                stats = {}
                for blabel, _, llabel, _ in links:
                    key = f"{blabel}@{llabel}"
                    times = [v["links"][key]["time_s"] for v in seeds.values()]
                    reached = [x for x in times if x is not None]
                    byts = [v["links"][key]["bytes"] for v in seeds.values() if v["links"][key]["bytes"] is not None]
                    stats[key] = {"reached": f"{len(reached)}/{len(spec.seeds)}",
                                  "all_reached": len(reached) == len(spec.seeds) and len(seeds) == len(spec.seeds),
                                  "time_s": mean_ci(reached) if reached else None,
                                  "bytes": mean_ci(byts) if byts else None}
                methods[m.name] = {"lr": lr, "tuning": scores, "seeds": seeds, "links": stats,
                                   "final": mean_ci(finals) if finals else None, "budget": budget,
                                   "flags": list(m.flags), "source": m.source,
                                   "wire": next(iter(seeds.values()))["wire"] if seeds else None}
            per_n[str(n)] = {"methods": methods, "verdicts": _verdicts(methods, links)}
        params = next((sd["params"] for nd in per_n.values() for r in nd["methods"].values()
                       for sd in r.get("seeds", {}).values() if sd.get("params")), None)
        result["workloads"][wl.name] = {"nodes": per_n, "target": wl.target, "metric": wl.metric, "params": params,
                                        "epochs": wl.epochs, "tune_epochs": wl.tune_epochs,
                                        "samples_per_node": wl.samples_per_node, "model": wl.model, "data": wl.data}
    result["protocol"] = {"lr_factors": list(spec.lr_factors), "tune_seed": spec.tune_seed, "seeds": list(spec.seeds),
                          "validation_fraction": bench_data.VALIDATION_FRACTION,
                          "selection": "best validation metric at the end of tune_epochs; ties to the smaller lr"}
    result["links"] = [f"{b}@{lat}" for b, _, lat, _ in links]
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
    if x is None:
        return "-"
    return f"{x:.2%}" if "acc" in metric else f"{x:.4g}"


def verdict_table(res: dict) -> str:
    """For each workload, node count and link: the winner, its time, the second, the margin."""
    lines = ["| workload | nodes | link | fastest to target | time (mean, 95 % CI) | second | margin | lead beyond CIs |",
             "|---|---|---|---|---|---|---|---|"]
    for wname, w in res["workloads"].items():
        for n, nd in w["nodes"].items():
            for key, v in nd["verdicts"].items():
                if v["winner"] is None:
                    lines.append(f"| {wname} | {n} | {key} | none reached the target | - | - | - | - |")
                    continue
                wst = nd["methods"][v["winner"]]["links"][key]["time_s"]
                sep = "-" if v["separated"] is None else ("yes" if v["separated"] else "no")
                lines.append(f"| {wname} | {n} | {key} | {v['winner']} | {_fmt_ci(wst)} | {v['second'] or '-'} | "
                             f"{_fmt_s(v['margin_s'])} | {sep} |")
    return "\n".join(lines)


def method_tables(res: dict) -> str:
    parts = []
    for wname, w in res["workloads"].items():
        for n, nd in w["nodes"].items():
            keys = res["links"]
            parts.append(f"#### {wname}, {n} nodes (target {_fmt_metric(w['metric'], w['target'])} {w['metric']})\n")
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
                first = r["links"][keys[0]]
                byts = "not reached" if first["bytes"] is None else race._fmt_bytes(first["bytes"]["mean"])
                times = [_fmt_ci(r["links"][k]["time_s"]) + ("" if r["links"][k]["all_reached"]
                                                               else f" ({r['links'][k]['reached']} seeds)")
                         for k in keys]
                b = r["budget"]
                budget = (f"tune {b['tune']['runs']}, {b['tune']['steps']}, {b['tune']['cpu_s']:.0f}; "
                          f"final {b['final']['runs']}, {b['final']['steps']}, {b['final']['cpu_s']:.0f}")
                rows.append("| " + " | ".join([name, r["wire"] or "-", f"{r['lr']:g}", final, byts, *times, budget])
                            + " |")
            parts.append("\n".join(rows) + "\n")
    return "\n".join(parts)


def plots(res: dict, out: Path, prefix: str) -> list[Path]:
    """Per workload and node count: metric against bytes, and against modelled time per
    bandwidth (at the first latency); the first seed's curve of each method."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    bws = sorted({k.split("@")[0] for k in res["links"]}, key=crossover.parse_rate)
    lat0 = res["links"][0].split("@")[1]
    for wname, w in res["workloads"].items():
        for n, nd in w["nodes"].items():
            fig, axes = plt.subplots(1, 1 + len(bws), figsize=(4.5 * (1 + len(bws)), 3.6), squeeze=False)
            for i, (name, r) in enumerate(nd["methods"].items()):
                if not r.get("seeds"):
                    continue
                c = next(iter(r["seeds"].values()))
                ys = [p["metric"] for p in c["curve"]]
                style = race._style(i)
                axes[0][0].plot([max(1, p["bytes"]) for p in c["curve"]], ys, label=name, **style)
                for ax, b in zip(axes[0][1:], bws):
                    rate, lat = crossover.parse_rate(b), crossover.parse_time(lat0)
                    pts = [{"step": p["step"], "bytes": p["bytes"], "compute_s": p["compute_s"],
                            "codec_s": p["codec_s"]} for p in c["curve"]]
                    ax.plot([race.modelled_time(p, c["calls_per_step"], int(n), rate, lat) for p in pts], ys,
                            label=name, **style)
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


def report(res: dict, md: Path, fig_dir: Path) -> str:
    """The Markdown page: protocol, verdict table, per-method tables, figures, provenance."""
    fig_dir.mkdir(parents=True, exist_ok=True)
    figs = plots(res, fig_dir, "benchmark")
    p = res.get("provenance", {})
    m = p.get("machine", {})
    proto = res["protocol"]
    lines = [
        "# The benchmark: every method on the same budget",
        "",
        "<!-- generated by experiments/benchmark.py report from the results file; do not edit by hand -->",
        "",
        f"Made by `{p.get('command', '?')}` at commit `{(p.get('commit') or '?')[:10]}`"
        f"{' (dirty tree)' if p.get('dirty') else ''} on {p.get('date', '?')}, {m.get('cpu', '?')} "
        f"({m.get('cores', '?')} cores, memcpy {m.get('memcpy_gbps', '?')} GB/s), load {p.get('load_before', '?')} "
        f"before and {p.get('load_after', '?')} after, torch {p.get('torch', '?')}.",
        "",
        "## Protocol",
        "",
        f"- Each method: learning rate on the grid {proto['lr_factors']} x its default, one tuning run each "
        f"(seed {proto['tune_seed']}) at the short horizon, on the training set less a "
        f"{proto['validation_fraction']:.0%} validation carve; selection: {proto['selection']}.",
        f"- The selected setting runs with seeds {proto['seeds']} on the whole training set; the test split is "
        "read only by these final runs.",
        "- Time to target is modelled per link from each run's bytes, message rounds and measured compute and "
        "codec time; mean and 95 % Student-t interval over seeds; a method is ranked at a link only if every "
        "seed reached the target.",
        "",
        "## Verdict",
        "",
        verdict_table(res),
        "",
        "## Per method",
        "",
        method_tables(res),
    ]
    if figs:
        lines += ["## Figures", ""]
        rel = os.path.relpath(fig_dir, md.parent)
        lines += [f"![{f.stem}]({rel}/{f.name})\n" for f in figs]
    text = "\n".join(lines) + "\n"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(text, encoding="utf-8")
    return text


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run every unfinished trial, then write benchmark.json")
    r.add_argument("--spec", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--jobs", type=int, default=1, help="trials run at a time, each in its own process with "
                   "OMP_NUM_THREADS=1 unless set (default 1: in this process)")
    pl = sub.add_parser("plan", help="list the trials the spec asks for")
    pl.add_argument("--spec", required=True)
    rp = sub.add_parser("report", help="write the Markdown page and figures from benchmark.json")
    rp.add_argument("--out", required=True, help="the benchmark's directory (holds benchmark.json)")
    rp.add_argument("--md", default="docs/benchmark.md")
    rp.add_argument("--figures", default=None, help="folder of the figures (default: beside --md)")
    a = p.parse_args(argv)
    try:
        if a.cmd == "plan":
            spec = load_spec(a.spec)
            trials = plan(spec)
            for t in trials:
                print(f"{t.workload.name} n={t.nodes} {t.method.name} {t.stage} "
                      f"{'lr=' + format(t.lr, 'g') if t.lr else 'lr=selected'} seed={t.seed}")
            print(f"{len(trials)} trials")
            return 0
        if a.cmd == "run":
            spec = load_spec(a.spec)
            out = Path(a.out)
            record = _provenance.start(SOURCES, argv=["experiments/benchmark.py", *argv])
            counts = run(spec, out, jobs=max(1, a.jobs))
            res = analyse(spec, out)
            res["spec"] = spec.raw
            res["counts"] = counts
            res["provenance"] = record.finish()  # the file is the results with their provenance
            _provenance.write(out / "benchmark.json", {k: v for k, v in res.items() if k != "provenance"}, record)
            print(f"benchmark: {counts['ran']} ran ({counts['failed']} failed), {counts['skipped']} already "
                  f"finished; results in {out / 'benchmark.json'}")
            return 0
        results, prov = _provenance.read(Path(a.out) / "benchmark.json")
        res = {**results, "provenance": prov}
        md = Path(a.md)
        report(res, md, Path(a.figures) if a.figures else md.parent)
        print(f"benchmark: report in {md}")
        return 0
    except (SpecError, crossover.CrossoverError) as e:
        print(f"benchmark: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
