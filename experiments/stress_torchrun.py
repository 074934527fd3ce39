#!/usr/bin/env python3
"""Run gossip.train under torchrun again and again; count the workers that abort.

    python -m experiments run stress_torchrun --minutes 20 --load 1 --cache empty
    python -m experiments run stress_torchrun --runs 40 --job suite --pythonpath /path/to/other/checkout

Jobs (``--job``):

- ``suite`` (default): the torchrun commands of ``tests/test_train.py``, argument for
  argument, in the order the tests run them: world 2 ECD at 6 bits (the full run, the run
  stopped by ``--max-steps 9``, its ``--resume``), then world 4 DCD at 8 bits on a ring;
- ``logreg``: a short job alternating the world sizes of ``--nproc`` (dcd at 8 bits, or
  allreduce at world 2; a few steps, a checkpoint);
- ``adpsgd``: AD-PSGD on 4 ranks of a ring, rank 0 four times slower, whose passive
  ranks answer their neighbours from a background thread that must be joined before
  the process group goes (:func:`adpsgd_command`).

Each torchrun invocation is one *run*, launched the way the tests launch it (``--tee 3``
and a ``--log-dir``, so each rank's own stdout and stderr are kept). A run whose worker
died of SIGABRT or printed "terminate called without an active exception" is an
*abort*; any other non-zero exit is a *failure*. The workers run with
``PYTHONFAULTHANDLER=1`` (the Python stack of every thread on SIGABRT) and, with
``--cores``, core dumps on (RLIMIT_CORE unlimited; the kernel's core_pattern decides where
they go: a relative pattern such as ``core`` puts them in the run's directory) and
``gdb -batch`` writes every thread's native backtrace next to each core found.

``--cache empty`` gives every run an empty ``TORCHINDUCTOR_CACHE_DIR`` (a first compile,
the compile-worker pool), ``warm`` one directory shared by all runs, ``keep`` the
caller's. ``--omp 1`` pins ``OMP_NUM_THREADS=1`` as the tests do, ``unset`` removes it,
``keep`` leaves the caller's. ``--load N`` starts N busy processes for the duration, as
the rest of a test suite does. A failing run's logs stay under ``--out`` (torchrun's
stderr, each rank's stdout/stderr, cores and backtraces); a clean run's are deleted.
A line per run, then per-command counts and the totals with the wall time.
``--pythonpath`` runs another checkout (e.g. one before a fix) for a comparison.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from experiments import _cli

ABORT_TEXT = "terminate called without an active exception"
QUICK = ["--data", "synthetic", "--epochs", "2", "--batch-size", "64", "--no-progress"]
ECD6 = ["--algo", "ecd", "--bits", "6", "--topology", "complete", *QUICK]


def suite_commands(work: Path) -> list[tuple[str, int, list[str]]]:
    """tests/test_train.py's torchrun commands: (name, world size, gossip.train args)."""
    return [
        ("w2-full", 2, [*ECD6, "--out", str(work / "dist")]),
        ("w2-max-steps-9", 2, [*ECD6, "--out", str(work / "part"), "--max-steps", "9"]),
        ("w2-resume", 2, [*ECD6, "--resume", str(work / "part")]),
        ("w4-ring", 4, ["--algo", "dcd", "--bits", "8", "--topology", "ring", "--out", str(work / "run"), *QUICK]),
    ]


def logreg_command(k: int, nproc: int, work: Path) -> tuple[str, int, list[str]]:
    if nproc == 2 and k % 2:
        algo = ["--algo", "allreduce"]
    else:
        algo = ["--algo", "dcd", "--bits", "8", "--topology", "ring" if nproc > 2 else "complete"]
    return (f"logreg-w{nproc}-{algo[1]}", nproc,
            [*algo, "--data", "synthetic", "--model", "logreg", "--epochs", "1", "--max-steps", "12",
             "--checkpoint-every", "6", "--no-progress", "--out", str(work / f"run{k}")])


def adpsgd_command(k: int, work: Path) -> tuple[str, int, list[str]]:
    """AD-PSGD under torchrun with no barrier: 4 ranks, one slow, a few steps."""
    return ("adpsgd-w4", 4, ["--algo", "adpsgd", "--topology", "ring", "--node-speed", "slow:nodes=1,factor=4",
                             "--data", "synthetic", "--model", "logreg", "--epochs", "1", "--max-steps", "12",
                             "--no-progress", "--out", str(work / f"run{k}")])


def _burn(stop_at: float) -> None:
    x = 0
    while time.time() < stop_at:
        x = (x * 1103515245 + 12345) % 2**31


def _cores_on() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _backtraces(cwd: Path) -> None:
    """gdb's `thread apply all bt` of every core under cwd, next to it."""
    if shutil.which("gdb") is None:
        return
    for core in sorted(p for p in cwd.rglob("core*") if p.is_file() and p.suffix not in (".txt", ".py")):
        r = subprocess.run(["gdb", "-batch", "-nx", "-ex", "set pagination off", "-ex", "info threads",
                            "-ex", "thread apply all bt", sys.executable, str(core)],
                           capture_output=True, text=True, timeout=300)
        (core.parent / (core.name + "-bt.txt")).write_text(r.stdout + r.stderr)


def one_run(name: str, nproc: int, args: list[str], work: Path, env: dict, cores: bool,
            timeout: float) -> tuple[str, int, str]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=work))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "--log-dir", str(run_dir / "logs"), "--tee", "3", "-m", "gossip.train", *args]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=run_dir,
                           preexec_fn=_cores_on if cores else None)
        rc, err = r.returncode, r.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = -999, f"timed out after {timeout:g} s\n" + (e.stderr or b"").decode(errors="replace")
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").rglob("*.log"))
    text = err + logs
    if rc == 0 and ABORT_TEXT not in text:
        shutil.rmtree(run_dir, ignore_errors=True)
        return "ok", rc, ""
    kind = "abort" if (ABORT_TEXT in text or "exitcode: -6" in text or "SIGABRT" in text) else "failure"
    (run_dir / "torchrun-stderr.txt").write_text(err)
    (run_dir / "command.txt").write_text(" ".join(cmd) + "\n")
    if cores:
        _backtraces(run_dir)
    return kind, rc, str(run_dir)


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run stress_torchrun``."""
    p.add_argument("--job", choices=("suite", "logreg", "adpsgd"), default="suite",
                   help="what each run runs (default suite)")
    p.add_argument("--runs", type=int, default=0, help="stop after this many runs (0: use --minutes)")
    p.add_argument("--minutes", type=float, default=10.0, help="stop after this long (default 10)")
    p.add_argument("--nproc", default="2,4", help="--job logreg: world sizes, taken in turn (default 2,4)")
    p.add_argument("--load", type=int, default=1, help="busy processes beside the runs (default 1)")
    p.add_argument("--cache", choices=("empty", "warm", "keep"), default="keep",
                   help="TORCHINDUCTOR_CACHE_DIR: empty per run, one warm dir, or the caller's (default keep)")
    p.add_argument("--omp", choices=("1", "unset", "keep"), default="1",
                   help="OMP_NUM_THREADS for the workers (default 1, as the tests)")
    p.add_argument("--cores", action="store_true", help="core dumps on, gdb backtraces of the cores found")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one torchrun run may take (default 300)")
    p.add_argument("--pythonpath", default=None, help="checkout to run instead of this one")
    p.add_argument("--out", type=Path, default=Path("runs/stress"), help="where failing runs' logs stay")


def main(argv: list[str] | None = None) -> int:
    p, args = _cli.parse(argv, options, __doc__, "stress_torchrun")
    if args.runs <= 0 and args.minutes <= 0:
        p.error("give --runs N or --minutes M")
    sizes = [int(x) for x in args.nproc.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix="stress-", dir=args.out)).resolve()
    env = dict(os.environ)
    root = args.pythonpath or str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"
    if args.omp == "1":
        env["OMP_NUM_THREADS"] = "1"
    elif args.omp == "unset":
        env.pop("OMP_NUM_THREADS", None)
    if args.cache == "warm":
        env["TORCHINDUCTOR_CACHE_DIR"] = str(out / "inductor-cache")
    core_pattern = Path("/proc/sys/kernel/core_pattern")
    print(f"stress_torchrun: job {args.job}, cache {args.cache}, OMP_NUM_THREADS "
          f"{env.get('OMP_NUM_THREADS', 'unset')}, load {args.load}, checkout {root}, logs {out}"
          + (f", core_pattern {core_pattern.read_text().strip()!r}" if args.cores and core_pattern.exists() else ""),
          flush=True)
    t0 = time.time()
    stop_at = t0 + 60 * args.minutes if args.runs <= 0 else float("inf")
    burners = [mp.Process(target=_burn, args=(min(stop_at, t0 + 24 * 3600),), daemon=True) for _ in range(args.load)]
    for b in burners:
        b.start()
    counts = {"ok": 0, "abort": 0, "failure": 0}
    per_name: dict[str, dict[str, int]] = {}
    queue: list[tuple[str, int, list[str]]] = []
    k = 0
    try:
        while (args.runs <= 0 or k < args.runs) and time.time() < stop_at:
            if not queue:
                work = Path(tempfile.mkdtemp(prefix=f"job{k}-", dir=out))
                queue = suite_commands(work) if args.job == "suite" else [
                    adpsgd_command(k, work) if args.job == "adpsgd" else logreg_command(k, sizes[k % len(sizes)], work)]
            name, nproc, cmd_args = queue.pop(0)
            run_env = dict(env)
            if args.cache == "empty":
                run_env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-", dir=out)
            t1 = time.time()
            kind, rc, where = one_run(name, nproc, cmd_args, out, run_env, args.cores, args.timeout)
            if args.cache == "empty":
                shutil.rmtree(run_env["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
            counts[kind] += 1
            per_name.setdefault(name, {"ok": 0, "abort": 0, "failure": 0})[kind] += 1
            k += 1
            if kind != "ok" and name == "w2-max-steps-9":
                queue = [q for q in queue if q[0] != "w2-resume"]  # nothing to resume
            note = "" if kind == "ok" else f"  logs: {where}"
            print(f"run {k:4d}  {name:15s} world {nproc}  {kind:7s} exit {rc:4d}  {time.time() - t1:5.1f} s  "
                  f"load {os.getloadavg()[0]:.1f}{note}", flush=True)
            if not queue and args.job == "suite":
                shutil.rmtree(work, ignore_errors=True)
    finally:
        for b in burners:
            if b.is_alive():
                os.kill(b.pid, signal.SIGTERM)
    for name, c in per_name.items():
        print(f"  {name:15s} {sum(c.values()):4d} runs: {c['ok']} ok, {c['abort']} aborted, {c['failure']} failed")
    print(f"stress_torchrun: {k} runs in {(time.time() - t0) / 60:.1f} min: {counts['ok']} ok, "
          f"{counts['abort']} aborted (SIGABRT), {counts['failure']} other failures; job {args.job}, "
          f"cache {args.cache}, checkout {root}", flush=True)
    return 0 if counts["abort"] == 0 and counts["failure"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
