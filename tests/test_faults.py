"""Faults between real torchrun processes: every rank's message is true, nothing is lost.

- A worker killed with SIGKILL: the others stop within ``--timeout`` + 5 s, the ranks
  that print name the killed rank (or say that the peer they waited on closed its
  connection), and every checkpoint written before the kill still loads.
- A worker stopped with SIGSTOP: its neighbours stop at the timeout naming it; a rank
  further away names only peers it really waited on, and never claims a crash it
  cannot know of.
- Ctrl-C (SIGINT to the whole process group, as a terminal sends it): exit 130,
  checkpoints intact.

Each rank that prints says one line prefixed with its rank; the full detail (gloo's
own text, the traceback) is in ``error-rank<k>.log`` in the run directory.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gossip import checkpoint
from gossip import train as gossip_train
from tests.conftest import child_env, default_sigint

pytestmark = pytest.mark.multiprocess

TIMEOUT = 4  # --timeout of the runs: how long a rank waits for a silent peer
# a ring of 4 (rank 2's neighbours are 1 and 3; rank 0 is not one of them); the emulated
# latency makes each step slow enough to act between steps
RUN = ["-m", "gossip.train", "--algo", "dcd", "--bits", "8", "--topology", "ring", "--data", "synthetic",
       "--model", "logreg", "--epochs", "50", "--max-steps", "400", "--checkpoint-every", "5",
       "--emulate-latency", "20", "--no-progress", "--timeout", str(TIMEOUT)]
NEIGHBOURS = {0: {1, 3}, 1: {0, 2}, 2: {1, 3}, 3: {0, 2}}
LINE = re.compile(r"^\[rank (\d)\] gossip\.train: (?:error: )?(.*)$")
STOPPED = gossip_train.STOPPED


def _start(out: Path, cwd: Path, run: list[str] = RUN, nproc: int = 4) -> subprocess.Popen:
    # --monitor-interval: torchrun's agent stops the surviving workers (SIGTERM) once it
    # sees one fail; polling every 5 s leaves the survivors time to say why they stopped
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "--monitor-interval", "5", *run, "--out", str(out)]
    return subprocess.Popen(cmd, cwd=cwd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=default_sigint,
                            text=True, start_new_session=True)


def _workers(proc: subprocess.Popen) -> dict[int, int]:
    """rank -> pid of torchrun's worker processes (read from their environment)."""
    out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout
    found = {}
    for pid in map(int, out.split()):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for kv in env:
            if kv.startswith(b"RANK="):
                found[int(kv[5:])] = pid
    return found


def _wait_for_checkpoint(proc: subprocess.Popen, out: Path, step: int, nproc: int = 4) -> None:
    deadline = time.monotonic() + 240
    while not all((out / f"ckpt-step{step}-rank{r}.pt").exists() for r in range(nproc)):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no checkpoint of step {step} appeared"
        time.sleep(0.05)


def _error_lines(stderr: str) -> dict[int, str]:
    found: dict[int, str] = {}
    for ln in stderr.splitlines():
        m = LINE.match(ln)
        if m:
            assert int(m.group(1)) not in found, f"rank {m.group(1)} printed two lines:\n{stderr}"
            found[int(m.group(1))] = m.group(2)
    return found


def _checkpoints_load(out: Path) -> int:
    files = sorted(out.glob("ckpt-step*-rank*.pt"))
    for f in files:
        checkpoint.load_checkpoint(f)  # verifies the checksum: raises on a damaged file
    return len(files)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_killed_worker_is_named_and_checkpoints_survive(tmp_path):
    out = tmp_path / "run"
    proc = _start(out, tmp_path)
    try:
        _wait_for_checkpoint(proc, out, 5)
        pids = _workers(proc)
        assert sorted(pids) == [0, 1, 2, 3], pids
        os.kill(pids[2], signal.SIGKILL)
        t_kill = time.monotonic()
        _, stderr = proc.communicate(timeout=120)
        took = time.monotonic() - t_kill
    finally:
        _stop(proc)
    assert proc.returncode != 0
    assert took < TIMEOUT + 5 + 5, took  # the agent's 5 s poll comes on top
    said = _error_lines(stderr)
    assert said, stderr[-3000:]
    assert 2 not in said
    for rank, msg in said.items():  # true: a peer this rank talks to closed the connection
        if msg == STOPPED:
            continue  # torchrun stopped it before it noticed: it says so
        m = re.search(r"rank %d lost the connection to (rank (\d)|ranks \[([\d, ]+)\]), which closed it" % rank, msg)
        assert m, msg
        peers = {int(m.group(2))} if m.group(2) else {int(x) for x in m.group(3).split(",")}
        assert peers <= NEIGHBOURS[rank], msg
        assert "gloo" not in msg.lower() and "Traceback" not in msg
        assert f"details in {out / f'error-rank{rank}.log'}" in msg
        log = (out / f"error-rank{rank}.log").read_text()
        assert f"rank {rank} of 4" in log and "backend: " in log  # gloo's own text is kept there
    assert any("rank 2" in msg for msg in said.values()), said  # a neighbour names the killed rank
    assert _checkpoints_load(out) >= 4


def test_a_stopped_worker_is_named_by_its_neighbours_and_nobody_is_blamed_falsely(tmp_path):
    out = tmp_path / "run"
    proc = _start(out, tmp_path)
    stopped = None
    try:
        _wait_for_checkpoint(proc, out, 5)
        pids = _workers(proc)
        stopped = pids[2]
        os.kill(stopped, signal.SIGSTOP)
        # the neighbours' waits expire (after TIMEOUT s) and each logs why it stopped;
        # only then may rank 2 go on (however long that takes on a busy machine)
        deadline = time.monotonic() + 120
        while not all((out / f"error-rank{r}.log").exists() for r in (1, 3)):
            if proc.poll() is not None:
                break  # the job ended: what it said is checked below
            assert time.monotonic() < deadline, "ranks 1 and 3 logged no error within 120 s"
            time.sleep(0.1)
        os.kill(stopped, signal.SIGCONT)  # then let torchrun's agent stop it
        _, stderr = proc.communicate(timeout=120)
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        _stop(proc)
    assert proc.returncode != 0
    said = _error_lines(stderr)
    for rank in (1, 3):  # the stopped rank's neighbours name it, by timeout
        assert rank in said, stderr[-3000:]
        assert f"rank {rank} got no answer from rank 2 within {TIMEOUT} s" in said[rank], said[rank]
    for rank, msg in said.items():
        if msg == STOPPED:
            continue
        named = {int(x) for x in re.findall(r"(?:from|to) rank (\d)", msg)}
        named |= {int(x) for grp in re.findall(r"(?:from|to) ranks \[([\d, ]+)\]", msg) for x in grp.split(",")}
        assert named and named <= NEIGHBOURS[rank], msg  # only peers it really waited on
        assert "crashed or exited" not in msg  # it cannot know that
    assert _checkpoints_load(out) >= 4


#: Ctrl-C needs no ring of 4 (nobody is blamed): two ranks, half the processes to start
RUN2 = [a if a != "ring" else "complete" for a in RUN]


def test_ctrl_c_under_torchrun_keeps_the_checkpoints_and_the_run_continues(tmp_path):
    out = tmp_path / "run"
    proc = _start(out, tmp_path, RUN2, nproc=2)
    try:
        _wait_for_checkpoint(proc, out, 5, nproc=2)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
        _, stderr = proc.communicate(timeout=120)
    finally:
        _stop(proc)
    assert proc.returncode != 0  # torchrun's own code (1) after its SignalException
    assert "[rank 0] gossip.train: interrupted" in stderr, stderr[-3000:]
    assert _checkpoints_load(out) >= 2
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        *RUN2, "--resume", str(out), "--max-steps", "12"],
                       cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_ctrl_c_of_a_simulated_run_exits_130_in_one_line(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, *RUN, "--simulate", "4", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=default_sigint,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (out / "ckpt-step5-rank0.pt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint of step 5 appeared"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        _stop(proc)
    assert proc.returncode == 130, (proc.returncode, stderr[-3000:])
    assert stderr.strip().splitlines() == ["gossip.train: interrupted"], stderr[-3000:]
    assert _checkpoints_load(out) >= 1
    assert "KeyboardInterrupt" in (out / "error-rank0.log").read_text()
