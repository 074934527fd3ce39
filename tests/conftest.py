"""Fixtures and helpers shared by the test files.

Fixtures are found by name. The plain helpers (needed at import time, for
parametrisation, or inside ranks started by ``tests._dist.run_world``) are imported
with ``from tests.conftest import ...``.

- :data:`REPO`: the repository root, so no test depends on the current directory.
- :func:`child_env` and :func:`run_process`: child processes that import this
  checkout, run with pinned threads, and are killed with everything they started
  when they overrun; :func:`torchrun` and :func:`why`: a torchrun job with each rank's
  output kept, and the failing rank's own stderr tail for an assertion message;
  :func:`torchrun_jobs`: several ``gossip.train`` runs in one torchrun launch.
- :func:`small_runs`, :func:`sweep_rows`, :func:`mnist1d_cache`: small data made once.
- :func:`payloads`, :func:`decode_f32`, :func:`strict_decode`: communicator payloads.
- :data:`requires_cuda`: skip where there is no CUDA device.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
"""The repository root."""

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


# --------------------------------------------------------------------------- processes
def child_env(threads: int = 1, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child Python: this checkout first on ``PYTHONPATH``,
    ``OMP_NUM_THREADS`` pinned (whatever the parent has; threads only contend on a
    shared machine), unbuffered output, plus ``extra``."""
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + path if path else "")
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run_process(
    cmd: Sequence[str], *, timeout: float, cwd: Path | str | None = None, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``cmd`` to completion, capturing text output; ``env`` defaults to :func:`child_env`.

    The child gets a session of its own, so a launcher that overruns ``timeout`` is
    killed together with the processes it started (``torchrun``'s workers), and the
    test fails with what it printed so far instead of leaving them behind.
    """
    proc = subprocess.Popen(
        list(cmd), cwd=cwd, env=dict(env) if env is not None else child_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(
            f"{' '.join(map(str, cmd))} did not finish within {timeout:g} s\n"
            f"--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"
        )
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def default_sigint() -> None:
    """``preexec_fn`` for a child that a test interrupts with SIGINT: a shell starts a
    background job (``make test &``) with SIGINT ignored, and the child would inherit
    that; this gives it the default disposition a terminal's process has."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def torchrun(nproc: int, *args: str, timeout: float, cwd: Path | str | None = None,
             env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node nproc *args`` via :func:`run_process`, each
    rank's own stdout/stderr also kept in a log directory (``--log-dir``, ``--tee 3``;
    ``result.logs``), so that a failure can show the failing rank's own tail (:func:`why`).
    ``--tee`` prefixes each rank's lines in the streams with ``[default<k>]:``; that
    prefix is removed, so the streams read as a user's terminal shows them."""
    logs = Path(tempfile.mkdtemp(prefix="torchrun-logs-"))
    atexit.register(shutil.rmtree, logs, True)  # their tails are in any failure's message
    r = run_process([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                     "--log-dir", str(logs), "--tee", "3", *args], timeout=timeout, cwd=cwd, env=env)
    r.stdout, r.stderr = (re.sub(r"(?m)^\[default\d+\]:", "", t) for t in (r.stdout, r.stderr))
    r.logs = logs  # type: ignore[attr-defined]
    return r


#: run by every rank of :func:`torchrun_jobs`: each job's ``gossip.train`` main() in turn,
#: in one process (torch imported once per rank, not once per job)
_JOBS = """
import json, sys
from gossip.train import main
codes = {}
for name, argv in json.load(open(sys.argv[1])):
    codes[name] = main(argv)
print("exit codes " + json.dumps(codes), flush=True)
"""


def torchrun_jobs(nproc: int, jobs: Sequence[tuple[str, Sequence[str]]], *, timeout: float,
                  cwd: Path | str) -> tuple[subprocess.CompletedProcess, dict[str, list[int]]]:
    """Several ``gossip.train`` runs in ONE :func:`torchrun` launch of ``nproc`` processes:
    every rank calls :func:`gossip.train.main` with each job's argv in turn, as ``python
    -m gossip.train argv`` does (a process group of its own per run, torn down at its
    end), so the job pays torchrun's and torch's start-up once, not once per run.
    Returns the launch and ``{job name: [exit code of each rank that finished them all]}``;
    a rank that died on the way is missing from every list."""
    script = Path(cwd) / "torchrun_jobs.py"
    script.write_text(_JOBS)
    with tempfile.NamedTemporaryFile("w", prefix="jobs-", suffix=".json", dir=cwd, delete=False) as f:
        json.dump([[name, list(argv)] for name, argv in jobs], f)
    listing = f.name
    r = torchrun(nproc, str(script), listing, timeout=timeout, cwd=cwd)
    codes: dict[str, list[int]] = {name: [] for name, _ in jobs}
    for line in r.stdout.splitlines():
        if line.startswith("exit codes "):
            for name, rc in json.loads(line[len("exit codes "):]).items():
                codes[name].append(rc)
    return r, codes


def why(r: subprocess.CompletedProcess, chars: int = 3000) -> str:
    """What a failed :func:`torchrun` printed: its exit code and stderr tail, then each
    rank's own stderr tail (the aborting rank's last words are there, not cut off by the
    others' output)."""
    out = [f"exit {r.returncode}; torchrun's stderr:", r.stderr[-chars:]]
    for f in sorted(Path(getattr(r, "logs", "/nonexistent")).rglob("stderr.log")):
        text = f.read_text(errors="replace")
        if text.strip():
            out += [f"--- rank {f.parent.name} stderr ({f}):", text[-chars:]]
    return "\n".join(out)


# --------------------------------------------------------------------------- small data
#: the small runs: three trainings of the real CLI on 3 simulated nodes
SMALL_RUNS_FLAGS = ["--simulate", "3", "--data", "synthetic", "--epochs", "2", "--batch-size", "128",
                    "--no-progress", "--log-every", "2"]
#: run name under the runs directory -> extra flags
SMALL_RUNS = {
    "gossip/dpsgd": ["--algo", "dpsgd"],
    "gossip/ecd8": ["--algo", "ecd", "--bits", "8"],
    "allreduce": ["--algo", "allreduce"],
}

# One interpreter for the three runs: torch is imported once.
_MAKE_RUNS = """
import sys
from gossip.train import main
base, runs = sys.argv[1], sys.argv[2:]
quick = {quick!r}
extra = {runs!r}
for name in runs:
    rc = main(quick + extra[name] + ["--out", base + "/" + name])
    if rc:
        sys.exit(rc)
"""


@pytest.fixture(scope="session")
def small_runs(tmp_path_factory) -> Path:
    """A runs directory with :data:`SMALL_RUNS`, made once per session by ``gossip.train``."""
    root = tmp_path_factory.getbasetemp() / "analysis-runs"
    done = root / ".done"
    if not done.exists():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        code = _MAKE_RUNS.format(quick=SMALL_RUNS_FLAGS, runs=SMALL_RUNS)
        r = run_process([sys.executable, "-c", code, str(root), *SMALL_RUNS], timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
        done.write_text("ok\n")
    return root


@pytest.fixture
def sweep_rows() -> list[dict]:
    """27 rows of a made-up network sweep (3 algorithms x 3 bandwidths x 3 latencies),
    the ECD cell at 5 Mbit/s and 20 ms marked as failed."""
    rows = []
    for algo, bits, per_mb in (("allreduce", None, 1.75), ("dpsgd", None, 2.0), ("ecd", 8, 0.5)):
        for bw in (1400.0, 20.0, 5.0):
            for lat in (0.13, 5.0, 20.0):
                steps = 15
                step_s = 0.01 + per_mb * 0.3 * 8 / bw + (14 if algo == "allreduce" else 1) * lat / 1e3
                rows.append({"algo": algo, "bits": bits, "nodes": 8, "bandwidth_mbit": bw, "latency_ms": lat,
                             "latency_mode": "emulated", "step_s": step_s, "epoch_s": step_s * steps,
                             "bytes_per_step": per_mb * 0.3e6, "iface_bytes_per_step": per_mb * 0.31e6,
                             "ok": not (algo == "ecd" and bw == 5.0 and lat == 20.0)})
    return rows


@pytest.fixture(scope="session")
def mnist1d_cache(tmp_path_factory):
    """MNIST-1D generated once per session (about 3 s) into a private cache directory:
    ``(cache_dir, dataset, whether the generation left numpy's and random's global
    generators untouched)``."""
    from gossip.data import build_dataset

    cache = tmp_path_factory.mktemp("gossip-cache")
    np_before, py_before = np.random.get_state(), random.getstate()
    ds = build_dataset("mnist1d", cache_dir=cache)
    np_after, py_after = np.random.get_state(), random.getstate()
    rng_untouched = (all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
                         for a, b in zip(np_before, np_after)) and py_before == py_after)
    return cache, ds, rng_untouched


# --------------------------------------------------------------------------- payloads
def payloads(n: int, d: int, seed: int = 0) -> torch.Tensor:
    """``n`` float32 rows of ``d`` values as raw bytes, exact zeros and negative zeros
    mixed in; the same on every rank for the same seed."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g)
    X[:, ::5] = 0.0
    X[:, 1::7] = -0.0
    return X.view(torch.uint8)


def decode_f32(Q: torch.Tensor) -> torch.Tensor:
    """The decoder of :func:`payloads`."""
    return Q.view(torch.float32)


class CorruptPayload(ValueError):
    """Stand-in for gossip.compress.PayloadError."""


def strict_decode(Q: torch.Tensor) -> torch.Tensor:
    """:func:`decode_f32` that refuses a row whose first byte is 0xFF."""
    if (Q[:, 0] == 0xFF).any():
        raise CorruptPayload("checksum mismatch")
    return Q.view(torch.float32)
