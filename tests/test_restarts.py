"""Runs survive restarts and refuse ranks that disagree.

- ``torchrun --max-restarts N ... --resume auto``: a worker killed with SIGKILL after a
  checkpoint; torchrun restarts the workers, they continue from the newest checkpoint,
  and the run ends bit-identical to an uninterrupted one, each step logged once.
- ``--resume auto`` starts fresh in an empty ``--out`` and continues a stopped run.
- torchrun ranks started with different run-defining flags all stop with one line
  naming the differing keys and a rank holding each value.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from gossip import checkpoint
from tests.conftest import child_env, run_process, torchrun, why

RUN = ["-m", "gossip.train", "--algo", "ecd", "--bits", "8", "--topology", "ring", "--data", "synthetic",
       "--model", "logreg", "--epochs", "50", "--max-steps", "60", "--checkpoint-every", "20", "--log-every", "1",
       "--no-progress"]


def _torchrun(n: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), *extra]


def _params(run_dir: Path, step: int, rank: int) -> torch.Tensor:
    return checkpoint.load_checkpoint(checkpoint.checkpoint_path(run_dir, step, rank))["optimizer"]["params"]


def _train_steps(run_dir: Path, rank: int) -> list[int]:
    lines = (run_dir / f"metrics-rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(x)["step"] for x in lines if json.loads(x)["kind"] == "train"]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_elastic_restart_after_sigkill_ends_bit_identical(tmp_path):
    ref = tmp_path / "uninterrupted"
    r = torchrun(4, *RUN, "--out", str(ref), timeout=300, cwd=tmp_path)
    assert r.returncode == 0, why(r)
    out = tmp_path / "restarted"
    # the emulated latency makes the steps slow enough to kill a worker mid-run
    cmd = _torchrun(4, "--max-restarts", "3") + RUN + ["--out", str(out), "--resume", "auto",
                                                        "--emulate-latency", "20"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "ckpt-step20-rank3.pt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint of step 20 appeared"
            time.sleep(0.05)
        # torchrun's agent runs in proc; its children are the workers
        workers = [w for w in _children(proc.pid) if b"gossip.train" in Path(f"/proc/{w}/cmdline").read_bytes()]
        assert workers, "found no worker processes to kill"
        os.kill(workers[-1], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-3000:]
    assert "exitcode: -9" in stderr  # the agent saw the killed worker and restarted
    for rank in range(4):
        # the reference ran without the emulated latency: the restart and the latency
        # together change no number
        assert torch.equal(_params(out, 60, rank), _params(ref, 60, rank))
        assert _train_steps(out, rank) == list(range(1, 61))  # each step once


def test_resume_auto_starts_fresh_then_continues(tmp_path):
    out = tmp_path / "run"
    base = [sys.executable, "-m", "gossip.train", "--simulate", "4"] + RUN[2:]
    r = run_process(base + ["--out", str(out), "--resume", "auto", "--max-steps", "20"],
                    timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_process(base + ["--out", str(out), "--resume", "auto", "--max-steps", "40"], timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_process(base + ["--out", str(tmp_path / "ref"), "--max-steps", "40"], timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert torch.equal(_params(out, 40, 0), _params(tmp_path / "ref", 40, 0))
    assert _train_steps(out, 0) == list(range(1, 41))


def test_resume_auto_needs_out(tmp_path):
    r = run_process([sys.executable, "-m", "gossip.train", "--simulate", "4", "--resume", "auto"],
                    timeout=120, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["gossip.train: error: --resume auto continues the run in --out: give --out DIR"]


def test_ranks_started_with_different_flags_refuse_in_one_line(tmp_path):
    """Each rank gets its own --lr and --seed from its LOCAL_RANK."""
    script = (f"exec {sys.executable} -m gossip.train --algo allreduce --data synthetic --model logreg "
              f"--max-steps 3 --no-progress --out {tmp_path / 'run'} --lr 0.0$((LOCAL_RANK + 1)) --seed $LOCAL_RANK")
    r = run_process(_torchrun(2, "--no-python") + ["sh", "-c", script], timeout=120, cwd=tmp_path)
    assert r.returncode != 0
    said = "the ranks were started with different configs; lr: 0.01 on rank 0, 0.02 on rank 1; seed: 0 on rank 0, 1 on rank 1"
    for rank in (0, 1):  # every rank says it, on a line of its own
        assert r.stderr.count(f"[rank {rank}] gossip.train: error: {said}") == 1, r.stderr
    assert not (tmp_path / "run").exists()  # nothing written
