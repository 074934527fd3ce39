"""Where a one-epoch vectorized simulation spends the time outside its steps.

    python -m experiments run sim_epoch_profile [--nodes 1024] [--models logreg,mlp,cnn1d]
                                            [--device cpu|cuda] [--json PATH] [--pstats DIR]

``experiments/bench_sim.py`` reports the share of a one-epoch run at 1,024 nodes that
lies outside the steps; this script says what that share is made of. For each model
it builds the run as ``bench_sim.py`` does (D-PSGD on a ring, SGD with momentum 0.9,
batch 32, the same data set), then runs one epoch (``Run.train``) twice:

1. timed by phase: the set-up (``loop.Run``: nodes, optimizers, loaders), the steps,
   the epoch's evaluation (``evaluation.evaluate_vectorized``), the metrics records
   (``log.eval``: one per node), the final checkpoint (``Run.checkpoint``: written,
   fsync-ed and hashed; on a GPU copied to the host first), the summary
   (``Run.finish``) and the rest of ``Run.train`` (the config record, opening the
   logs, the epoch line). On a GPU each phase's clock is read after a
   ``torch.cuda.synchronize()``, so work queued by one phase is not charged to the next.
2. under ``cProfile`` (which slows Python-bound code, so only the order counts): the
   functions of ``gossip`` that take the most time outside the steps, by their
   cumulative time.

The results JSON records the command, commit, machine and load (docs/simulation.md's
table is rendered from it); ``--pstats DIR`` also keeps each profile for ``pstats``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

from experiments import _provenance
from experiments import tables
from experiments import bench_sim

from gossip.train import evaluation  # noqa: E402
from experiments import _cli

PHASES = ("setup", "steps", "evaluation", "records", "checkpoint", "summary", "rest")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timer(fn, key: str, acc: dict[str, float], device: str):
    def wrapped(*a, **k):
        _sync(device)
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _sync(device)
            acc[key] += time.perf_counter() - t0
    return wrapped


def phases(n: int, model: str, device: str, ds) -> dict:
    """One epoch, each phase's wall time (seconds) and its share of the whole."""
    acc = {p: 0.0 for p in PHASES}
    with tempfile.TemporaryDirectory() as tmp:
        _sync(device)
        t0 = time.perf_counter()
        run = bench_sim.build(n, model, "vectorized", ds, Path(tmp) / "run", device)
        _sync(device)
        acc["setup"] = time.perf_counter() - t0
        run.step = _timer(run.step, "steps", acc, device)  # type: ignore[method-assign]
        run.log.eval = _timer(run.log.eval, "records", acc, device)  # type: ignore[method-assign]
        run.checkpoint = _timer(run.checkpoint, "checkpoint", acc, device)  # type: ignore[method-assign]
        run.finish = _timer(run.finish, "summary", acc, device)  # type: ignore[method-assign]
        real_eval = evaluation.evaluate_vectorized
        evaluation.evaluate_vectorized = _timer(real_eval, "evaluation", acc, device)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                t1 = time.perf_counter()
                run.train()
                _sync(device)
                train_s = time.perf_counter() - t1
        finally:
            evaluation.evaluate_vectorized = real_eval
        steps = run.progress.step
    total = acc["setup"] + train_s
    acc["rest"] = max(0.0, total - sum(v for k, v in acc.items() if k != "rest"))
    return {"model": model, "nodes": n, "params": run.dim, "steps": steps, "total_s": total,
            "phases_s": acc, "outside_share": 1.0 - acc["steps"] / total}


def _where(fn: tuple) -> str:
    file, line, name = fn
    parts = Path(file).parts
    if "gossip" in parts:
        file = "/".join(parts[len(parts) - 1 - parts[::-1].index("gossip"):])
    elif file.startswith("~") or file.startswith("<"):
        return name
    else:
        file = Path(file).name
    return f"{file}:{line}({name})"


def profile(n: int, model: str, device: str, ds, top: int, keep: Path | None) -> dict[str, list[dict]]:
    """One epoch under cProfile, the steps (``Run.step`` and what it calls) left out:
    the ``top`` functions of ``gossip`` by cumulative time (``"gossip"``), and the
    ``top`` functions of any package, built-ins included, by their own time (``"own"``:
    where the time is actually spent, e.g. hashing, copying to the host, fsync)."""
    prof = cProfile.Profile()
    with tempfile.TemporaryDirectory() as tmp:
        prof.enable()
        run = bench_sim.build(n, model, "vectorized", ds, Path(tmp) / "run", device)
        step = run.step

        def untimed() -> None:  # the steps are left out of the profile
            prof.disable()
            try:
                step()
                _sync(device)
            finally:
                prof.enable()

        run.step = untimed  # type: ignore[method-assign]
        with contextlib.redirect_stdout(io.StringIO()):
            run.train()
        _sync(device)
        prof.disable()
    st = pstats.Stats(prof)
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        st.dump_stats(keep / f"{model}-{n}.pstats")
    rows = [{"function": _where(fn), "calls": nc, "cumulative_s": ct, "own_s": tt, "in_gossip": _in_gossip(fn)}
            for fn, (_cc, nc, tt, ct, _callers) in st.stats.items()]
    return {"gossip": sorted((r for r in rows if r["in_gossip"]), key=lambda r: -r["cumulative_s"])[:top],
            "own": sorted(rows, key=lambda r: -r["own_s"])[:top]}


def _in_gossip(fn: tuple) -> bool:
    return "gossip" in Path(fn[0]).parts


def options(ap: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run sim_epoch_profile``."""
    ap.add_argument("--nodes", type=int, default=1024)
    ap.add_argument("--models", default="logreg,mlp,cnn1d")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top", type=int, default=12, help="functions listed per model")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    ap.add_argument("--pstats", metavar="DIR", help="keep each model's cProfile stats here")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap, a = _cli.parse(argv, options, __doc__, "sim_epoch_profile")
    if a.nodes < 2:
        ap.error(f"--nodes must be at least 2, got {a.nodes}")
    models = [m for m in a.models.split(",") if m]
    unknown = [m for m in models if m not in ("logreg", "mlp", "cnn1d")]
    if unknown:
        ap.error(f"--models: unknown {', '.join(unknown)}; accepted: logreg, mlp, cnn1d")
    if a.device == "cuda" and not torch.cuda.is_available():
        print("sim_epoch_profile: --device cuda, but no CUDA device is available", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    load0 = os.getloadavg()[0]
    print(f"load average (1 min) before: {load0:.2f}" + ("  WARNING: above 0.3, figures are not the machine's own"
                                                         if load0 > 0.3 else ""), flush=True)
    record = _provenance.start(_provenance.training_sources("experiments/sim_epoch_profile.py",
                                                            "experiments/bench_sim.py"),
                               argv=["experiments/sim_epoch_profile.py", *argv])
    ds = bench_sim.dataset(a.nodes)
    with tempfile.TemporaryDirectory() as tmp:  # first calls (imports, CUDA's context) are not the run's
        for model in models:
            warm = bench_sim.build(4, model, "vectorized", ds, Path(tmp) / model, a.device)
            warm.step()
            warm.log.close()
    rows = []
    for model in models:
        row = phases(a.nodes, model, a.device, ds)
        row.update(profile(a.nodes, model, a.device, ds, a.top, Path(a.pstats) if a.pstats else None))
        row["load_avg"] = os.getloadavg()[0]
        rows.append(row)
        ph = row["phases_s"]
        print(f"{model}, {a.nodes} nodes: total {row['total_s']:.2f} s, "
              + ", ".join(f"{p} {ph[p]:.2f} s" for p in PHASES) + f"; {row['outside_share']:.0%} outside the steps",
              flush=True)
        print("  own time:  " + tables.own_line(row))
        for t in row["gossip"][:6]:
            print(f"    {t['cumulative_s']:7.3f} s  {t['calls']:>7}  {t['function']}")
        if a.json:  # after every model: a run cut short keeps what it measured
            record.load_after = []  # finish() takes the load of this save, the latest
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps({
                "device": a.device, "gpu": torch.cuda.get_device_name(0) if a.device == "cuda" else None,
                "threads": a.threads, "rows": rows, "provenance": record.finish()}, indent=1) + "\n")
    print()
    print(tables.sim_epoch_profile_table(rows))
    if a.json:
        print(f"results: {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
