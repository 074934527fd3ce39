"""Runs survive restarts and refuse ranks that disagree.

- ``torchrun --max-restarts N ... --resume auto``: a worker killed with SIGKILL after a
  checkpoint; torchrun restarts the workers, they continue from the newest checkpoint,
  and the run ends bit-identical to an uninterrupted one, each step logged once.
- ``--resume auto`` starts fresh in an empty ``--out`` and continues a stopped run.
- torchrun ranks started with different run-defining flags all stop with one line
  naming the differing keys and a rank holding each value.
- Every registered algorithm, resumed under torchrun, ends with the metrics and the
  summary of an uninterrupted run, byte counts included (wall-clock fields aside).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import topologies
from gossip import algorithms, checkpoint
from tests.conftest import child_env, run_process, torchrun, torchrun_jobs, why
from tests.test_train import train

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


#: a restart needs no ring: two ranks on the complete graph, the fewest processes to
#: start in each of the three launches below (the reference, the killed one, its restart)
RESTART = [a if a != "ring" else "complete" for a in RUN]


def test_elastic_restart_after_sigkill_ends_bit_identical(tmp_path):
    """On 2 ranks, one of them killed after the checkpoint of step 20; the reference is
    the uninterrupted run simulated in this process with the ranks' thread count (one),
    which computes the ranks' numbers bit for bit (tests/test_train.py checks it)."""
    ref = tmp_path / "uninterrupted"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        r = train("--simulate", "2", "--simulate-mode", "loop", *RESTART[2:], "--out", str(ref))
    finally:
        torch.set_num_threads(threads)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "restarted"
    # the emulated latency makes the steps slow enough to kill a worker mid-run
    cmd = _torchrun(2, "--max-restarts", "3") + RESTART + ["--out", str(out), "--resume", "auto",
                                                            "--emulate-latency", "20"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "ckpt-step20-rank1.pt").exists():
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
    # the reference ran without the emulated latency: the restart and the latency
    # together change no number
    assert torch.equal(torch.cat([_params(out, 60, rank) for rank in range(2)]), _params(ref, 60, 0))
    for rank in range(2):
        assert _train_steps(out, rank) == list(range(1, 61))  # each step once


def test_resume_auto_starts_fresh_then_continues(tmp_path):
    """The CLI's main() in this process (the real processes of --resume auto are the
    elastic restart's above)."""
    out = tmp_path / "run"
    base = ["--simulate", "4"] + RUN[2:]
    r = train(*base, "--out", str(out), "--resume", "auto", "--max-steps", "20")
    assert r.returncode == 0, r.stderr[-3000:]
    r = train(*base, "--out", str(out), "--resume", "auto", "--max-steps", "40")
    assert r.returncode == 0, r.stderr[-3000:]
    r = train(*base, "--out", str(tmp_path / "ref"), "--max-steps", "40")
    assert r.returncode == 0, r.stderr[-3000:]
    assert torch.equal(_params(out, 40, 0), _params(tmp_path / "ref", 40, 0))
    assert _train_steps(out, 0) == list(range(1, 41))


def test_resume_auto_needs_out():
    r = train("--simulate", "4", "--resume", "auto")
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


# ----------------------------------------------------------------------------- every family
#: the algorithms that run only in the simulation (each refuses torchrun and --resume in
#: one line, checked below); an entry leaves this set when it runs under torchrun
NOT_UNDER_TORCHRUN = {"adpsgd": "asynchronous: under torchrun each rank saves at its own moment, exchanges in flight"}


def _every_algorithm(out: Path) -> list[tuple[str, list[str]]]:
    """One small run per registered algorithm on 2 ranks: 6 steps, a checkpoint at step 3,
    and a communication round every 2 steps where the family has local steps (so the
    resume falls between two rounds)."""
    jobs = []
    for name in algorithms.available():
        if name in NOT_UNDER_TORCHRUN:
            continue
        argv = ["--algo", name, "--data", "synthetic", "--model", "logreg", "--batch-size", "16",
                "--max-steps", "6", "--checkpoint-every", "3", "--log-every", "1", "--no-progress",
                "--out", str(out / name)]
        if algorithms.is_decentralized(name):
            try:
                topologies.build(algorithms.default_topology(name), 2)
            except ValueError:  # a ring needs 3 nodes
                argv += ["--topology", "complete"]
        if "local_steps" in {f.name for f in dataclasses.fields(algorithms.config_class(name))}:
            argv += ["--algo-opt", "local_steps=2"]
        jobs.append((name, argv))
        if name == "diloco":  # the overlapped outer step: round 1's exchange is in flight at step 3
            eager = [str(out / "diloco-eager") if a == str(out / name) else a for a in argv]
            jobs.append(("diloco-eager", [*eager, "--algo-opt", "outer_delay=1"]))
    return jobs


def _timeless(record):
    """A metrics record or summary without its wall-clock fields (time, *_s)."""
    if isinstance(record, dict):
        return {k: _timeless(v) for k, v in record.items() if k != "time" and not k.endswith("_s")}
    return record


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


#: run by every rank: each job from its start, then (once every rank has ended every run)
#: what a kill -9 after the checkpoint of step 3 leaves of each run directory (the final
#: checkpoints and the summary moved to the reference folder, the metrics copied there),
#: then each job resumed: both halves in one launch, torch imported once per rank (each
#: run a process group of its own, as tests/test_train.py's world2 runs and resumes)
_RUN_THEN_RESUME = """
import json, os, shutil, sys, time
from pathlib import Path
from gossip.train import main

jobs, out, ref = json.load(open(sys.argv[1]))
out, ref, rank = Path(out), Path(ref), int(os.environ["RANK"])

def barrier(phase):  # a file per rank: no process group outlives the runs' own
    Path(f"{ref}-{phase}-rank{rank}").touch()
    while not all(Path(f"{ref}-{phase}-rank{r}").exists() for r in (0, 1)):
        time.sleep(0.05)

codes = {name: main(argv) for name, argv in jobs}
barrier("ran")  # every rank has ended every run
for name, _ in jobs:
    (ref / name).mkdir(parents=True, exist_ok=True)
    shutil.copy(out / name / f"metrics-rank{rank}.jsonl", ref / name / f"metrics-rank{rank}.jsonl")
    os.replace(out / name / f"ckpt-step6-rank{rank}.pt", ref / name / f"ckpt-step6-rank{rank}.pt")
    if rank == 0:  # rank 0 wrote the summary
        shutil.copy(out / name / "summary.json", ref / name / "summary.json")
        (out / name / "summary.json").unlink()
barrier("moved")  # no rank resumes before every rank's files are gone
codes.update({"resumed " + name: main(argv + ["--resume", str(out / name)]) for name, argv in jobs})
print("exit codes " + json.dumps(codes), flush=True)
"""


@pytest.mark.multiprocess
def test_every_algorithm_resumes_with_the_bytes_of_an_uninterrupted_run(tmp_path):
    """Each family runs 6 steps on 2 ranks; then its final checkpoint and summary are
    taken away, as a kill -9 after the checkpoint of step 3 leaves the run directory, and
    the run is resumed from step 3 (in the same launch). Metrics (byte counts included)
    and the summary equal the uninterrupted run's, less wall-clock fields; so do the
    final model and optimizer state. The families come from the registry: a new one
    cannot skip this."""
    out = tmp_path / "runs"
    ref = tmp_path / "uninterrupted"
    jobs = _every_algorithm(out)
    script = tmp_path / "run_then_resume.py"
    script.write_text(_RUN_THEN_RESUME)
    listing = tmp_path / "jobs.json"
    listing.write_text(json.dumps([[[name, argv] for name, argv in jobs], str(out), str(ref)]))
    r = torchrun(2, str(script), str(listing), timeout=400, cwd=tmp_path)
    assert r.returncode == 0, why(r)
    codes = [json.loads(line[len("exit codes "):]) for line in r.stdout.splitlines() if line.startswith("exit codes ")]
    want = {k: 0 for name, _ in jobs for k in (name, "resumed " + name)}
    assert codes == [want, want], why(r)
    wrong = {}
    for name, _ in jobs:
        got, want = out / name, ref / name
        for rank in (0, 1):
            new, old = (d.joinpath(f"metrics-rank{rank}.jsonl").read_text().splitlines() for d in (got, want))
            kept = [x for x in old if json.loads(x)["step"] <= 3]
            if new[:len(kept)] != kept:  # resumed, not started afresh: the first 3 steps' lines as written
                wrong[name] = f"rank {rank}'s metrics of steps 1-3 were rewritten"
            elif [_timeless(json.loads(x)) for x in new] != [_timeless(json.loads(x)) for x in old]:
                a, b = next((a, b) for a, b in zip((_timeless(json.loads(x)) for x in new),
                                                   (_timeless(json.loads(x)) for x in old)) if a != b)
                wrong[name] = (f"rank {rank}'s metrics of step {a['step']} differ: "
                               + ", ".join(f"{k} {a.get(k)} != {b.get(k)}" for k in b if a.get(k) != b.get(k)))
            elif not _same(*(checkpoint.load_checkpoint(d / f"ckpt-step6-rank{rank}.pt")["optimizer"]
                            for d in (got, want))):
                wrong[name] = f"rank {rank}'s model or optimizer state at step 6 differs"
        a, b = (_timeless(json.loads((d / "summary.json").read_text())) for d in (got, want))
        if name not in wrong and a != b:
            wrong[name] = "summary differs: " + ", ".join(f"{k} {a.get(k)} != {b.get(k)}" for k in a if a.get(k) != b.get(k))
    assert not wrong, "\n".join(f"{k}: {v}" for k, v in wrong.items())


@pytest.mark.parametrize("name", sorted(NOT_UNDER_TORCHRUN))
def test_an_algorithm_left_out_above_refuses_a_torchrun_resume_in_one_line(name, tmp_path):
    """What the every-algorithm resume test leaves out must say so itself, in one line on
    every rank, rather than resume from checkpoints that are no one state of the run (its
    simulation resumes exactly: tests/test_heterogeneous.py)."""
    args = ["--algo", name, "--topology", "complete", "--data", "synthetic", "--model", "logreg",
            "--max-steps", "2", "--no-progress"]
    # the run and its resume in one launch of 2 ranks (each through the CLI's main())
    r, codes = torchrun_jobs(2, [("run", [*args, "--out", str(tmp_path / "dist")]),
                                 ("resume", [*args, "--resume", str(tmp_path / "dist")])], timeout=240, cwd=tmp_path)
    assert r.returncode == 0 and codes["run"] == [0, 0], why(r)
    assert len(codes["resume"]) == 2 and 0 not in codes["resume"], why(r)
    errors = [line for line in r.stderr.strip().splitlines() if "error:" in line]
    assert sorted(line.split(" gossip.train: error:")[0] for line in errors) == ["[rank 0]", "[rank 1]"], why(r)
    lines = {line.split("] ", 1)[-1] for line in errors}
    assert len(lines) == 1, why(r)
    line = lines.pop()
    assert name in line and "--resume" in line and "torchrun" in line, line
