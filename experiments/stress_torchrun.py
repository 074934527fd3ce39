#!/usr/bin/env python3
"""Run gossip.train under torchrun again and again; count the workers that abort.

    python experiments/stress_torchrun.py --minutes 20 --nproc 2,4 --load 1 --out runs/stress
    python experiments/stress_torchrun.py --runs 50 --pythonpath /path/to/other/checkout

Each run is a short torchrun job (alternating the world sizes of ``--nproc``; dcd at
8 bits on a ring, or allreduce at world 2, a few steps, a checkpoint), with per-rank
logs kept by torchrun (``--log-dir``, ``--redirects 3``). A run whose worker died of
SIGABRT or printed "terminate called without an active exception" is an *abort*; any
other non-zero exit is a *failure*. ``--load N`` starts N busy processes for the
duration, as the test suite's parallel work does. The aborting ranks' logs are kept
under ``--out``; the rest are deleted. The last line gives the counts and the wall time.
``--pythonpath`` runs another checkout (e.g. one before a fix) for a comparison.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ABORT_TEXT = "terminate called without an active exception"


def _burn(stop_at: float) -> None:
    x = 0
    while time.time() < stop_at:
        x = (x * 1103515245 + 12345) % 2**31


def one_run(k: int, nproc: int, out: Path, env: dict) -> tuple[str, int, str]:
    work = Path(tempfile.mkdtemp(prefix=f"stress-{k}-", dir=out))
    if nproc == 2 and k % 2:
        algo = ["--algo", "allreduce"]
    else:
        algo = ["--algo", "dcd", "--bits", "8", "--topology", "ring" if nproc > 2 else "complete"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "--log-dir", str(work / "logs"), "--redirects", "3", "-m", "gossip.train", *algo,
           "--data", "synthetic", "--model", "logreg", "--epochs", "1", "--max-steps", "12",
           "--checkpoint-every", "6", "--no-progress", "--out", str(work / "run")]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    logs = "".join(p.read_text(errors="replace") for p in (work / "logs").rglob("*.log"))
    text = r.stderr + logs
    if r.returncode == 0:
        kind = "ok"
    elif ABORT_TEXT in text or "exitcode: -6" in text or "Signals.SIGABRT" in text:
        kind = "abort"
    else:
        kind = "failure"
    if kind == "ok":
        shutil.rmtree(work, ignore_errors=True)
    else:
        (work / "torchrun-stderr.txt").write_text(r.stderr)
    return kind, r.returncode, str(work)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=0, help="stop after this many runs (0: use --minutes)")
    p.add_argument("--minutes", type=float, default=10.0, help="stop after this long (default 10)")
    p.add_argument("--nproc", default="2,4", help="world sizes, taken in turn (default 2,4)")
    p.add_argument("--load", type=int, default=1, help="busy processes beside the runs (default 1)")
    p.add_argument("--pythonpath", default=None, help="checkout to run instead of this one")
    p.add_argument("--out", type=Path, default=Path("runs/stress"), help="where failing runs' logs stay")
    args = p.parse_args(argv)
    if args.runs <= 0 and args.minutes <= 0:
        p.error("give --runs N or --minutes M")
    sizes = [int(x) for x in args.nproc.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    root = args.pythonpath or str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.time()
    stop_at = t0 + 60 * args.minutes if args.runs <= 0 else float("inf")
    burners = [mp.Process(target=_burn, args=(min(stop_at, t0 + 24 * 3600),), daemon=True) for _ in range(args.load)]
    for b in burners:
        b.start()
    counts = {"ok": 0, "abort": 0, "failure": 0}
    k = 0
    try:
        while (args.runs <= 0 or k < args.runs) and time.time() < stop_at:
            kind, rc, where = one_run(k, sizes[k % len(sizes)], args.out, env)
            counts[kind] += 1
            k += 1
            note = "" if kind == "ok" else f"  logs: {where}"
            print(f"run {k:4d}  world {sizes[(k - 1) % len(sizes)]}  {kind:7s} exit {rc}{note}", flush=True)
    finally:
        for b in burners:
            if b.is_alive():
                os.kill(b.pid, signal.SIGTERM)
    print(f"stress_torchrun: {k} runs in {(time.time() - t0) / 60:.1f} min: {counts['ok']} ok, "
          f"{counts['abort']} aborted (SIGABRT), {counts['failure']} other failures; checkout {root}", flush=True)
    return 0 if counts["abort"] == 0 and counts["failure"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
