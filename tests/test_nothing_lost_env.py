"""Failures of the environment are one line naming the file and the cause, with a
non-zero exit and the checkpoints intact; and every message says what is true.

A full disk is a real one: a small tmpfs mounted where this runs as root (skipped,
with that reason, where mounting is not possible). Closed pipes and /dev/full are
real file descriptors given to the CLIs as their standard output.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from gossip import rundir
from gossip.tools import analysis, crossover
from gossip import train as gossip_train
from tests.conftest import run_process
from tests.test_nothing_lost import SIM, _digest, _main

RESUMABLE = [*SIM, "--checkpoint-every", "1"]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory) -> Path:
    """A run of 2 steps with a checkpoint at each, that a longer run resumes."""
    out = tmp_path_factory.mktemp("env") / "run"
    rc, _, err = _main(*RESUMABLE, "--max-steps", "2", "--out", str(out))
    assert rc == 0, err
    return out


def _ckpts(d: Path) -> dict[str, str]:
    return {k: v for k, v in _digest(d).items() if k.startswith("ckpt-")}


@contextlib.contextmanager
def _tmpfs(where: Path, size: str):
    where.mkdir()
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("a full disk needs a small tmpfs, which only root can mount here")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill ({r.stderr.strip()})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_a_full_disk_is_one_line_and_the_checkpoints_stay(two_steps, tmp_path):
    with _tmpfs(tmp_path / "fs", "512k") as fs:
        run = Path(shutil.copytree(two_steps, fs / "run"))
        st = os.statvfs(fs)
        (fs / "filler").write_bytes(b"x" * (st.f_bavail * st.f_frsize - 16 * 1024))  # room for the metrics only
        before = _ckpts(run)
        rc, _, err = _main(*RESUMABLE, "--max-steps", "4", "--resume", str(run))
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1, err
        assert f"{run}/ckpt-step3-rank0.pt: No space left on device (ENOSPC)" in lines[0], lines[0]
        assert "its checkpoints (newest: step 2) are intact: free some space, then --resume" in lines[0]
        assert _ckpts(run) == before
        assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]  # no half-written file left


def test_a_run_directory_that_became_unwritable_is_one_line(two_steps, tmp_path):
    """Root writes through permissions: there, a read-only remount of a tmpfs."""
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        with _tmpfs(tmp_path / "fs", "1m") as fs:
            run = Path(shutil.copytree(two_steps, fs / "run"))
            before = _digest(run)
            subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
            rc, _, err = _main(*RESUMABLE, "--max-steps", "4", "--resume", str(run))
            assert rc == 2 and err.count("\n") == 1, err
            assert f"{run}/metrics-rank0.jsonl" in err and "Read-only file system (EROFS)" in err, err
            assert _digest(run) == before
        return
    run = Path(shutil.copytree(two_steps, tmp_path / "run"))
    before = _digest(run)
    run.chmod(0o555)
    try:
        rc, _, err = _main(*RESUMABLE, "--max-steps", "4", "--resume", str(run))
    finally:
        run.chmod(0o755)
    assert rc == 2 and err.count("\n") == 1, err
    assert str(run) in err and "Permission denied (EACCES)" in err and "make the run directory writable" in err
    assert _digest(run) == before


@pytest.mark.parametrize("bad, needle", [
    ("dir", "cannot read the metrics file (Is a directory)"),
    ("bytes", "the metrics file is not UTF-8 text"),
])
def test_metrics_that_cannot_be_read_on_resume(two_steps, tmp_path, bad, needle):
    run = Path(shutil.copytree(two_steps, tmp_path / "run"))
    m = rundir.metrics_path(run, 1)
    m.unlink()
    if bad == "dir":
        m.mkdir()
    else:
        m.write_bytes(b'{"kind": "train", "step": 1}\n\xff\xfe\n')
    before = _digest(run)
    rc, _, err = _main(*RESUMABLE, "--max-steps", "4", "--resume", str(run))
    assert rc == 2 and err.count("\n") == 1 and str(m) in err and needle in err, err
    assert _digest(run) == before
    if bad == "bytes":  # (a directory is not a metrics file to the analysis: it is skipped)
        with pytest.raises(analysis.AnalysisError, match="not UTF-8"):
            analysis.load_run(run)


# --- standard output that cannot be written ----------------------------------------------
@contextlib.contextmanager
def _stdout(kind: str):
    """sys.stdout on /dev/full, or on a pipe whose reader has gone."""
    if kind == "full":
        f = open("/dev/full", "w")
    else:
        r, w = os.pipe()
        os.close(r)
        f = os.fdopen(w, "w")
    old, err = sys.stdout, io.StringIO()
    sys.stdout = f
    try:
        with contextlib.redirect_stderr(err):
            yield err
    finally:
        sys.stdout = old
        with contextlib.suppress(OSError):
            f.close()


CAUSE = {"full": "No space left on device", "pipe": "Broken pipe"}


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
@pytest.mark.parametrize("kind", ["full", "pipe"])
def test_topologies_json_into_a_closed_or_full_stdout(kind):
    from topologies.__main__ import main

    with _stdout(kind) as err:
        rc = main(["ring", "8", "--json"])
    assert rc == 1 and err.getvalue() == f"topologies: error: cannot write to standard output ({CAUSE[kind]})\n"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
@pytest.mark.parametrize("kind", ["full", "pipe"])
def test_crossover_json_into_a_closed_or_full_stdout(kind, monkeypatch):
    seen = {}

    def measured(args, say):  # the table, without minutes of measuring (tests/test_crossover.py measures)
        seen["params"] = args.params
        return {"rows": [], "params": args.params}

    monkeypatch.setattr(crossover, "run", measured)
    with _stdout(kind) as err:
        rc = crossover.main(["--params", "1e6", "--json"])
    assert seen["params"] == 1_000_000  # 1e6 names a count
    assert rc == 1
    assert err.getvalue() == (f"gossip.tools.crossover: error: cannot write the results to standard output "
                              f"({CAUSE[kind]})\n")


@pytest.mark.parametrize("args, needle", [
    (["--plot", "{tmp}/x.docx"], ".docx extension; matplotlib writes"),
    (["--plot", "{tmp}/missing/x.png"], "no such directory"),
    (["--params", "1e6x"], "argument --params: '1e6x' is not a number"),
    (["--params", "2500.5"], "'2500.5' is not a whole number"),
])
def test_crossover_refuses_before_measuring(args, needle, tmp_path, monkeypatch):
    if "--plot" in args:
        pytest.importorskip("matplotlib")
    monkeypatch.setattr(crossover, "run", lambda *a: pytest.fail("measured before refusing"))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = crossover.main([a.format(tmp=tmp_path) for a in args])
        except SystemExit as e:
            rc = e.code
    assert rc == 2 and err.getvalue().count("\n") == 1 and needle in err.getvalue(), err.getvalue()


# --- messages that must be true -----------------------------------------------------------
def test_a_huge_toml_value_is_printed_once_and_cut(tmp_path):
    (tmp_path / "huge.toml").write_text('compressor = "' + "z" * 5_000_000 + '"\n')
    rc, _, err = _main(*SIM, "--config", str(tmp_path / "huge.toml"), "--out", str(tmp_path / "o"))
    assert rc == 2 and err.count("\n") == 1 and len(err) < 500, len(err)
    assert err.count("'zzz") == 1 and "zzz...[5,000,000 characters]';" in err, err


def test_a_run_written_in_the_other_mode_says_so(two_steps, tmp_path):
    run = Path(shutil.copytree(two_steps, tmp_path / "run"))
    config = json.loads(rundir.config_path(run).read_text())
    config["mode"] = "torchrun"  # as torchrun writes it: the same run, one file per rank
    rundir.config_path(run).write_text(json.dumps(config))
    before = _digest(run)
    rc, _, err = _main(*RESUMABLE, "--max-steps", "4", "--resume", str(run))
    assert rc == 2 and err.count("\n") == 1, err
    assert "written in the other mode (torchrun, 4 nodes)" in err and "under torchrun with 4 ranks" in err, err
    assert _digest(run) == before


def test_sigterm_does_not_blame_a_failing_rank(tmp_path):
    out = tmp_path / "run"
    first = rundir.metrics_path(out, 0)

    def stop():  # once the run is under way (its handler installed), as torchrun would
        deadline = time.monotonic() + 60
        while not (first.exists() and first.stat().st_size) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop, daemon=True).start()
    # long enough (many epochs) that the signal always comes before the end, however
    # slowly the thread that sends it is scheduled
    rc, _, err = _main(*SIM, "--epochs", "1000", "--max-steps", "100000", "--log-every", "1", "--out", str(out))
    assert rc == 128 + signal.SIGTERM and err.strip() == f"gossip.train: {gossip_train.STOPPED}", err
    assert "failing rank's own line says why" not in err


class _SigtermInAFinalizer:
    """Dropped at once; its finalizer sends SIGTERM, so Python runs the run's handler inside
    the finalizer, and the exception the handler raises is reported and dropped there."""

    def __del__(self):
        signal.raise_signal(signal.SIGTERM)


def test_a_sigterm_whose_exception_is_dropped_still_stops_the_run(tmp_path, monkeypatch):
    from gossip.train import loop

    dropped, steps = [], []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u.exc_type))
    step = loop.Run.step

    def stepped(self):
        step(self)
        steps.append(self.progress.step)
        if self.progress.step == 3:
            _SigtermInAFinalizer()

    monkeypatch.setattr(loop.Run, "step", stepped)
    rc, _, err = _main(*SIM, "--max-steps", "50", "--out", str(tmp_path / "run"))
    assert dropped == [gossip_train.Terminated]  # the handler's exception was lost where it was raised
    assert rc == 128 + signal.SIGTERM and err.strip() == f"gossip.train: {gossip_train.STOPPED}", err
    assert steps == [1, 2, 3]  # stopped before the next step, not at the run's end


def test_a_sigterm_during_torchs_first_import_is_the_one_line(tmp_path):
    """A SIGTERM while the rank still imports torch (torchrun stops the others when one
    rank fails at once) leaves torch half imported; the rank still says its one line."""
    child = f"""
import importlib.abc, signal, sys

class SigtermInTorchsImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch.jit":  # deep inside torch's own first import
            sys.meta_path.remove(self)
            signal.raise_signal(signal.SIGTERM)
        return None

from gossip import train
assert "torch" not in sys.modules
sys.meta_path.insert(0, SigtermInTorchsImport())
sys.exit(train.main({[*SIM, "--out", str(tmp_path / "run")]!r}))
"""
    r = run_process([sys.executable, "-c", child], timeout=120)
    assert r.returncode == 128 + signal.SIGTERM and r.stderr.strip() == f"gossip.train: {gossip_train.STOPPED}", \
        r.stderr


def test_ddp_names_localsgd_as_an_algorithm_without_a_hook():
    from gossip import ddp

    with pytest.raises(ValueError, match=r"'localsgd' acts on the models, not on the gradients \(use "
                                         r"gossip.GossipOptimizer\); DDP hooks exist for"):
        ddp.hook_state(torch.nn.Linear(2, 2), "localsgd")


def test_analysis_warns_on_a_run_of_a_future_schema(two_steps, tmp_path):
    run = Path(shutil.copytree(two_steps, tmp_path / "run"))
    config = json.loads(rundir.config_path(run).read_text())
    config["schema"] = rundir.SCHEMA_VERSION + 1
    rundir.config_path(run).write_text(json.dumps(config))
    with pytest.warns(UserWarning, match=f"schema {rundir.SCHEMA_VERSION + 1}, this version of gossip reads schemas "
                                         f"1 to {rundir.SCHEMA_VERSION}"):
        analysis.load_runs(tmp_path)
