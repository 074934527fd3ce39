"""Run gossip.train commands as a user does and record them with their provenance.

Shared by the study runner (experiments/study.py, for a ``summary`` study such as
experiments/studies/lm_recipes.toml) and experiments/powersgd_lstm.py: each command runs
in a process of its own (its wall clock is what a user waits, start-up and data loading
included), and its record holds the command, the summary's figures, the wall clock and
the load average before and after; the scripts add the results file's provenance
(commit, machine, load) with experiments/_provenance.py.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from experiments import _provenance  # noqa: E402  (the scripts' provenance, through this module)


def run_train(args: list[str], out: Path) -> dict:
    """``python -m gossip.train ARGS --out OUT``; its summary's figures, wall clock and load.

    The record names the run directory as the record of the command names ``--out``
    (``_provenance.portable``: relative to the repository, or ``OUT/...`` outside it), and
    the scripts give ``out`` as ``--out``'s folder joined with a run's name."""
    cmd = [sys.executable, "-m", "gossip.train", *args, "--out", str(out), "--overwrite", "--no-progress"]
    _provenance.record_config(args)  # what `python -m experiments verify` witnesses
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    load1 = os.getloadavg()[0]
    rec = {"command": "python -m gossip.train " + shlex.join(args), "wall_s": round(wall, 1),
           "load_average": [round(load0, 2), round(load1, 2)], "exit": r.returncode, "out": f"{_provenance.portable(str(out.parent))}/{out.name}"}
    if r.returncode != 0:
        rec["error"] = (r.stderr.strip().splitlines() or [""])[-1]
        return rec
    s = json.loads((out / "summary.json").read_text())
    for k in ("params", "steps", "final_train_loss", "final_test_loss", "final_test_bpb", "final_test_ppl",
              "bytes_sent_per_node_per_step", "bytes_sent_per_node_total", "wall_time_s", "compressor"):
        rec[k] = s.get(k)
    return rec


