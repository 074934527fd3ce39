"""Nothing lost, nothing silently wrong: finished runs stay finished, ``--overwrite``
deletes only a run's own files, frozen parameters stay frozen, a moved model is
refused, and failures of the environment are one line with the checkpoints intact.

The CLI cases run ``gossip.train`` in this process through ``main`` (as
tests/test_bad_input.py does); each asserts the exit code, the one line and that
the files already saved are byte for byte unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from pathlib import Path

import pytest

from gossip import rundir
from gossip import train as gossip_train

SIM = ["--simulate", "4", "--data", "synthetic", "--model", "logreg", "--no-progress", "--algo", "ecd"]


def _main(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = gossip_train.main(list(args))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return rc, out.getvalue(), err.getvalue()


def _digest(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("nothing-lost") / "done"
    rc, _, err = _main(*SIM, "--max-steps", "4", "--checkpoint-every", "2", "--out", str(out))
    assert rc == 0, err
    return out


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


# --- a finished run is complete ------------------------------------------------------------
@pytest.mark.parametrize("how", ["dir", "auto"])
def test_resuming_a_finished_run_changes_nothing(finished, tmp_path, how):
    run = _copy(finished, tmp_path / "run")
    before = _digest(run)
    args = ["--resume", str(run)] if how == "dir" else ["--resume", "auto", "--out", str(run)]
    rc, _, err = _main(*SIM, "--max-steps", "4", *args)
    lines = err.strip().splitlines()
    assert rc == (0 if how == "auto" else 2), err
    assert len(lines) == 1 and "is finished (step 4 of 4)" in lines[0], err
    assert str(rundir.summary_path(run)) in lines[0] and "--max-steps" in lines[0]
    assert _digest(run) == before
    assert json.loads(rundir.summary_path(run).read_text())["final_test_loss"] is not None


def test_resume_auto_never_replaces_a_finished_runs_summary(finished, tmp_path):
    run = _copy(finished, tmp_path / "run")
    for p in run.glob("ckpt-*.pt"):
        p.unlink()
    before = _digest(run)
    rc, _, err = _main(*SIM, "--max-steps", "4", "--resume", "auto", "--out", str(run))  # same length: finished
    assert rc == 0 and "is finished" in err, err
    rc, _, err = _main(*SIM, "--max-steps", "6", "--resume", "auto", "--out", str(run))  # longer: nothing to go on from
    assert rc == 2 and err.count("\n") == 1 and "no checkpoint to continue it from" in err, err
    assert _digest(run) == before


def test_a_finished_run_resumed_longer_goes_on(finished, tmp_path):
    run = _copy(finished, tmp_path / "run")
    rc, _, err = _main(*SIM, "--max-steps", "6", "--resume", str(run))
    assert rc == 0, err
    assert json.loads(rundir.summary_path(run).read_text())["steps"] == 6


# --- --overwrite deletes only a run's files --------------------------------------------------
def test_overwrite_removes_only_the_runs_own_files(finished, tmp_path):
    run = _copy(finished, tmp_path / "run")
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"x")
    (run / "tensorboard" / "notes.txt").write_text("mine")
    (run / "notes.txt").write_text("mine")
    (run / "mine").mkdir()
    rc, _, err = _main(*SIM, "--max-steps", "2", "--out", str(run), "--overwrite")
    assert rc == 0, err
    assert (run / "notes.txt").read_text() == "mine" and (run / "mine").is_dir()
    assert (run / "tensorboard" / "notes.txt").read_text() == "mine"
    assert not (run / "tensorboard" / "events.out.tfevents.1.host").exists()
    assert not (run / "ckpt-step4-rank0.pt").exists()  # the old run's checkpoints went
    assert json.loads(rundir.summary_path(run).read_text())["steps"] == 2


def test_overwrite_leaves_a_foreign_config_json_and_says_so(tmp_path):
    d = tmp_path / "proj"
    d.mkdir()
    (d / "config.json").write_text('{"my": "settings"}')
    (d / "tensorboard").mkdir()
    (d / "tensorboard" / "old.txt").write_text("mine")
    before = _digest(d)
    rc, _, err = _main(*SIM, "--max-steps", "2", "--out", str(d), "--overwrite")
    assert rc == 2 and err.count("\n") == 1, err
    assert "config.json" in err and "not a gossip run's file" in err
    assert _digest(d) == before


def test_run_files_is_the_one_list(finished):
    ours, foreign = rundir.run_files(finished)
    names = sorted(p.name for p in ours)
    assert foreign == []
    assert names == sorted(["config.json", "summary.json", "ckpt-step2-rank0.pt", "ckpt-step4-rank0.pt"]
                           + [f"metrics-rank{k}.jsonl" for k in range(4)])


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_out_is_refused(tmp_path, value, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, _, err = _main(*SIM, "--max-steps", "2", "--out", value)
    assert rc == 2 and err.count("\n") == 1 and "--out must name a directory" in err, err
    assert list(tmp_path.iterdir()) == []
