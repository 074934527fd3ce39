"""Run directories written before the run recorded its wire format (schema 1) still
load, and their checkpoints still resume.

``tests/data/schema1-efblocksgd`` was written by gossip 0.1.0 (the release before
``rundir.py``) with::

    python -m gossip.train --simulate 2 --algo efblocksgd --model logreg --data synthetic \\
        --epochs 1 --max-steps 4 --checkpoint-every 2 --log-every 1 --no-progress \\
        --out schema1-efblocksgd

(threads pinned to 1). Its config records ``compressor: null, bits: 32`` although
efblocksgd sends 1-bit signs: the bug that made the run record its algorithm's own
wire format.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from gossip import checkpoint, rundir
from gossip.tools import analysis
from tests.conftest import REPO, run_process
from tests.test_train import train

FIXTURE = REPO / "tests" / "data" / "schema1-efblocksgd"
FLAGS = ["--simulate", "2", "--algo", "efblocksgd", "--model", "logreg", "--data", "synthetic",
         "--epochs", "1", "--checkpoint-every", "2", "--log-every", "1", "--no-progress"]


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "old"
    shutil.copytree(FIXTURE, dst)
    return dst


def _train(*args: str, cwd: Path):
    """The CLI's main() in this process, from ``cwd`` and on one thread as a child
    process runs (each run is a short simulation: a Python and torch started per run
    cost more than the run)."""
    here, threads = os.getcwd(), torch.get_num_threads()
    os.chdir(cwd)
    torch.set_num_threads(1)
    try:
        return train(*args)
    finally:
        torch.set_num_threads(threads)
        os.chdir(here)


def test_schema1_run_loads_and_says_where_its_labels_come_from(tmp_path):
    run = analysis.load_run(_copy(tmp_path))
    assert run.complete
    row = analysis.load_runs(tmp_path).runs.iloc[0]
    assert row["label"] == "efblocksgd/fp32/-"  # centralized: no topology
    assert row["topology"] is None
    assert row["algo"] == "efblocksgd"
    assert row["wire_source"] == "config (schema 1)"
    assert row["compressor"] == "fp32" and row["bits"] == 32
    assert row["steps"] == 4
    assert row["setup_traffic"] == "folded in"  # 0.1.0 counted the x_1 exchange in step 1


def test_schema1_wire_of_and_schema2_wire_of():
    cfg = json.loads((FIXTURE / "config.json").read_text())
    assert cfg.get("schema") is None  # written before schema versions
    assert rundir.wire_of(cfg) == {"label": "fp32", "bits_per_coord": 32, "source": "config (schema 1)"}
    new = {"schema": 2, "wire": {"label": "blocksign", "bits_per_coord": 1.0}}
    assert rundir.wire_of(new)["source"] == "algorithm"
    assert rundir.wire_of(new)["label"] == "blocksign"


def test_schema1_checkpoint_resumes_and_continues_exactly(tmp_path):
    """The 0.1.0 checkpoint of step 4, resumed by this code to step 6, continues exactly.

    Its steps 1-4 were computed on another CPU, whose vector units may round the model's
    sums differently in the last bit (the loss of step 1 differs by 2e-7 between two
    x86 machines), so against this machine's fresh run the result is equal to rounding;
    the continuation itself is exact: resuming to 5 and then to 6 ends bit for bit where
    one resume to 6 ends, and the metrics hold each step once.
    """
    old = _copy(tmp_path)
    r = _train(*FLAGS, "--max-steps", "6", "--resume", str(old), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    # a checkpoint written before the sharded exchange resumes all-gathered, as it ran
    r = _train(*FLAGS, "--max-steps", "6", "--algo-opt", "exchange=allgather", "--out", str(tmp_path / "fresh"),
               cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    a = checkpoint.load_checkpoint(old / "ckpt-step6-rank0.pt")["optimizer"]["params"]
    b = checkpoint.load_checkpoint(tmp_path / "fresh" / "ckpt-step6-rank0.pt")["optimizer"]["params"]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    steps = [json.loads(line)["step"] for line in (old / "metrics-rank0.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps == sorted(set(steps)) == [1, 2, 3, 4, 5, 6]
    summary = json.loads((old / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["wire"]["label"] != "fp32"
    # in two resumes: 4 -> 5 -> 6, bit for bit the same as 4 -> 6
    twice = tmp_path / "twice"
    shutil.copytree(FIXTURE, twice)
    for stop in ("5", "6"):
        r = _train(*FLAGS, "--max-steps", stop, "--resume", str(twice), cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
    c = checkpoint.load_checkpoint(twice / "ckpt-step6-rank0.pt")["optimizer"]["params"]
    assert torch.equal(a, c)


@pytest.mark.parametrize("hard", [False, True])
def test_a_simulation_of_more_nodes_than_files_a_process_may_open_runs(tmp_path, hard):
    """A simulation of more nodes than the open-file limit allows (one metrics file per
    node; a thousand nodes stopped with "Too many open files" under the 1,024 that many
    systems set) raises its soft limit where the hard one allows, and otherwise opens a
    node's file for each record. Here the child's soft limit (and with ``hard`` its hard
    limit too) is 96 and it simulates 160 nodes; every node's records are written."""
    from gossip.train import metrics

    nodes, limit = 160, 96
    assert metrics.OPEN_WRITERS_MAX < limit < nodes
    new_hard = str(limit) if hard else "hard"
    code = ("import resource, runpy; soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE); "
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {new_hard})); "
            "runpy.run_module('gossip.train', run_name='__main__', alter_sys=True)")
    out = tmp_path / "run"
    r = run_process([sys.executable, "-c", code, "--simulate", str(nodes), "--model", "logreg", "--data", "synthetic",
                     "--batch-size", "4", "--epochs", "1", "--max-steps", "2", "--log-every", "1", "--no-progress",
                     "--out", str(out)], cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert ("each is opened for each record" in r.stdout) is hard
    for i in (0, nodes // 2, nodes - 1):
        recs = rundir.read_metrics(rundir.metrics_path(out, i))
        assert [x["step"] for x in recs if x["kind"] == "train"] == [1, 2]
        assert [x["kind"] for x in recs].count("eval") >= 1


def test_a_writer_that_reopens_per_record_writes_the_same_file(tmp_path):
    recs = [{"kind": "train", "step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    for keep_open in (True, False):
        w = rundir.MetricsWriter(tmp_path / f"m{keep_open}.jsonl", keep_open=keep_open)
        assert w.path.exists()
        for rec in recs[:2]:
            w.write(rec)
        w.close()
        w = rundir.MetricsWriter(w.path, keep_until=1, keep_open=keep_open)  # a resume at step 1
        w.write(recs[2])
        w.close()
        assert rundir.read_metrics(w.path) == [recs[0], recs[2]]
    assert (tmp_path / "mTrue.jsonl").read_bytes() == (tmp_path / "mFalse.jsonl").read_bytes()


def test_a_refused_run_leaves_no_default_run_directory(tmp_path, monkeypatch, capsys):
    """Without --out a run makes runs/<time>-<algo>-<topology>-<pid> before its checks;
    a run refused by one of them (here choco's gamma out of range, found when the
    algorithm is built) removes it again, and a run that goes ahead keeps its own."""
    from gossip.train import main

    monkeypatch.chdir(tmp_path)
    quick = ["--simulate", "4", "--data", "synthetic", "--model", "mlp", "--epochs", "1", "--max-steps", "1",
             "--no-progress"]
    assert main(["--algo", "choco", "--topology", "ring", "--algo-opt", "gamma=7", *quick]) != 0
    assert "gamma" in capsys.readouterr().err
    assert list((tmp_path / "runs").iterdir()) == []
    assert main(["--algo", "dpsgd", "--topology", "ring", *quick]) == 0
    [made] = (tmp_path / "runs").iterdir()
    assert made.name.endswith(f"-dpsgd-ring-{os.getpid()}") and (made / "summary.json").is_file()
