"""Run gossip.train commands as a user does and record them with their provenance.

Shared by experiments/lm_recipes.py and experiments/powersgd_lstm.py: each command runs
in a process of its own (its wall clock is what a user waits, start-up and data loading
included), and its record holds the command, the summary's figures, the wall clock and
the load average before and after, next to the commit and the machine.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def provenance() -> dict:
    return {
        "commit": _git("rev-parse", "--short=12", "HEAD") or None,
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "python": platform.python_version(),
    }


def run_train(args: list[str], out: Path) -> dict:
    """``python -m gossip.train ARGS --out OUT``; its summary's figures, wall clock and load."""
    cmd = [sys.executable, "-m", "gossip.train", *args, "--out", str(out), "--overwrite", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    load1 = os.getloadavg()[0]
    rec = {"command": "python -m gossip.train " + shlex.join(args), "wall_s": round(wall, 1),
           "load_average": [round(load0, 2), round(load1, 2)], "exit": r.returncode, "out": str(out)}
    if r.returncode != 0:
        rec["error"] = (r.stderr.strip().splitlines() or [""])[-1]
        return rec
    s = json.loads((out / "summary.json").read_text())
    for k in ("params", "steps", "final_train_loss", "final_test_loss", "final_test_bpb", "final_test_ppl",
              "bytes_sent_per_node_per_step", "bytes_sent_per_node_total", "wall_time_s", "compressor"):
        rec[k] = s.get(k)
    return rec


def write(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**payload, "provenance": provenance()}, indent=1) + "\n")
