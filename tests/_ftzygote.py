"""A fork server for the ``--fault-tolerance`` tests: gossip's training CLI imported once,
then one forked worker per request.

tests/test_fault_tolerance.py starts about forty workers; each ``python -m gossip.train``
spends seconds of CPU importing torch before it does anything, which on a small machine
is most of the file's time and skews the start of workers meant to start together. A
forked child has every module already imported and starts in a fraction of a second; it
then runs :func:`gossip.train.main` exactly as ``python -m gossip.train`` does, with its
own environment, working directory and output files.

Protocol (one JSON object a line on stdin, one answer a line on stdout):
``{"argv": [...], "env": {...}, "cwd": DIR, "out": FILE, "err": FILE or null, "rc": FILE}``
forks a worker whose stdout goes to ``out`` and stderr to ``err`` (or to ``out`` as well);
the answer is its pid. Once the worker has exited, its exit code (negative: the signal
that ended it, as :attr:`subprocess.Popen.returncode`) is written to ``rc``. torchft is
left to each worker to import (its log level is read from the environment then). Every
import here leaves the process with one thread, which is what makes forking it safe.
"""

from __future__ import annotations

import json
import os
import select
import sys

import torch
import torch._dynamo  # noqa: F401 - what a torch optimizer imports when it is first built (seconds)
import torch.distributed  # noqa: F401

import gossip.comm  # noqa: F401
import gossip.train.fault_tolerance  # noqa: F401 - the slow imports, once, before any fork
import gossip.train.loop  # noqa: F401
import gossip.train

torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # the rest of its lazy imports


def _child(req: dict) -> None:
    """In the forked worker: its environment, directory and files, then the CLI."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        out = os.open(req["out"], flags, 0o644)
        err = os.open(req["err"], flags, 0o644) if req.get("err") else out
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.argv = ["gossip.train", *req["argv"]]
        code = gossip.train.main(req["argv"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - said on the worker's stderr, as the interpreter would
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - the exit code matters more
                pass
        os._exit(code)


def _reap(rc_files: dict[int, str]) -> None:
    """Every exited worker's code to its rc file (written whole: a temporary file renamed)."""
    while rc_files:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = rc_files.pop(pid, None)
        if path is not None:
            with open(path + ".tmp", "w") as f:
                f.write(str(os.waitstatus_to_exitcode(status)))
            os.replace(path + ".tmp", path)


def main() -> None:
    rc_files: dict[int, str] = {}
    stdin = sys.stdin.buffer
    pending = b""
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.02)
        _reap(rc_files)
        if not ready:
            continue
        chunk = os.read(stdin.fileno(), 1 << 16)
        if not chunk:  # the test ended
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            req = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _child(req)
            rc_files[pid] = req["rc"]
            sys.stdout.write(f"{pid}\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
