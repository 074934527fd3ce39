#!/usr/bin/env python3
"""A gloo collective that finishes on the worker thread while the interpreter exits.

    python -m experiments run teardown_race --teardown destroy --runs 8    # aborts now and then
    python -m experiments run teardown_race --teardown shutdown --runs 12  # gossip.comm.shutdown: none

Each run is a world of 2 under torchrun. Both ranks import ``torch.distributed.nn.functional``
after ``init_process_group`` (as torch._dynamo does on a first compiled call), so that
module's default arguments keep the group alive. Rank 0 starts an ``all_reduce`` and drops
its Python references to the tensor and the work: only gloo's worker thread holds them.
Rank 1 joins that collective late: with ``--teardown destroy`` when rank 0 has called
``dist.destroy_process_group()`` and reached its last exit handler, with ``--teardown
shutdown`` when rank 0 calls ``gossip.comm.shutdown()``. Rank 0's last exit handler holds
the GIL in C for a while and this driver stops rank 0 for a moment (a ``gdb -batch``
attach, ``--no-stall`` to skip it), which is what lets the worker's release of the
tensor fall into interpreter finalization. Such a release needs the GIL; CPython then
ends the thread with ``pthread_exit`` inside a C++ destructor and the worker aborts
("terminate called without an active exception", SIGABRT). The last line gives the
counts; the aborting runs' output is kept under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from experiments import _cli

ABORT_TEXT = "terminate called without an active exception"

SCRIPT = r'''
import atexit, os, sys, time
GO, teardown = sys.argv[1], sys.argv[2]
def last_exit_handler():  # registered before torch's: runs last
    if os.environ["RANK"] == "0":
        if not os.path.exists(GO):
            open(GO, "w").close()  # rank 1 may join the collective now
        open(GO + ".pid", "w").write(str(os.getpid()))
        sum(range(150_000_000))  # holds the GIL in C meanwhile
atexit.register(last_exit_handler)
import torch, torch.distributed as dist
from gossip import comm
dist.init_process_group("gloo")
import torch.distributed.nn.functional  # after the group: its default arguments hold it
t = torch.ones(1 << 10)
if dist.get_rank() == 0:
    w = dist.all_reduce(t, async_op=True)
    del t, w  # only gloo's worker thread holds the work and its tensor
    if teardown == "shutdown":
        open(GO, "w").close()
        comm.shutdown()
    else:
        dist.destroy_process_group()
else:
    while not os.path.exists(GO):
        time.sleep(0.001)
    dist.all_reduce(t)
    comm.shutdown() if teardown == "shutdown" else dist.destroy_process_group()
print(f"rank {dist.get_rank() if dist.is_initialized() else os.environ['RANK']} exits", flush=True)
'''


def one_run(k: int, teardown: str, stall: bool, out: Path, env: dict) -> tuple[bool, int, str]:
    work = Path(tempfile.mkdtemp(prefix=f"{teardown}-{k}-", dir=out))
    (work / "race.py").write_text(SCRIPT)
    go = work / "go"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(work / "race.py"), str(go), teardown]
    with open(work / "output.txt", "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=work)
        pid_file = go.with_name("go.pid")
        deadline = time.time() + 120
        while stall and proc.poll() is None and time.time() < deadline and not pid_file.exists():
            time.sleep(0.2)
        if stall and proc.poll() is None and pid_file.exists() and shutil.which("gdb"):
            time.sleep(1.5)
            pid = pid_file.read_text().strip()
            if pid:
                subprocess.run(["gdb", "-p", pid, "-batch", "-ex", "thread apply all bt 3"],
                               capture_output=True, timeout=120)
        rc = proc.wait(timeout=300)
    text = (work / "output.txt").read_text(errors="replace")
    aborted = ABORT_TEXT in text or "exitcode  : -6" in text
    if not aborted and rc == 0:
        shutil.rmtree(work, ignore_errors=True)
    return aborted, rc, str(work)


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run teardown_race``."""
    p.add_argument("--teardown", choices=("destroy", "shutdown"), required=True,
                   help="destroy: dist.destroy_process_group(); shutdown: gossip.comm.shutdown()")
    p.add_argument("--runs", type=int, default=8, help="torchrun runs (default 8)")
    p.add_argument("--no-stall", action="store_true", help="do not stop rank 0 with a gdb attach")
    p.add_argument("--out", type=Path, default=Path("runs/teardown_race"), help="where failing runs stay")


def main(argv: list[str] | None = None) -> int:
    p, args = _cli.parse(argv, options, __doc__, "teardown_race")
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", PYTHONUNBUFFERED="1")
    t0, aborts, failures = time.time(), 0, 0
    for k in range(args.runs):
        aborted, rc, where = one_run(k, args.teardown, not args.no_stall, args.out.resolve(), env)
        aborts += aborted
        failures += (rc != 0 and not aborted)
        kind = "abort" if aborted else ("ok" if rc == 0 else "failure")
        print(f"run {k + 1:3d}  {args.teardown}  {kind:7s} exit {rc}" + ("" if kind == "ok" else f"  {where}"),
              flush=True)
    print(f"teardown_race: {args.runs} runs in {(time.time() - t0) / 60:.1f} min, teardown {args.teardown}: "
          f"{aborts} aborted (SIGABRT), {failures} other failures", flush=True)
    return 0 if aborts == 0 and failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
