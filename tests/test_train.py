"""End-to-end tests of ``gossip.train``: under torchrun, under --simulate, bad input."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gossip import checkpoint
from gossip import train as gossip_train
from tests.conftest import torchrun as _torchrun
from tests.conftest import torchrun_jobs
from tests.conftest import why

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
QUICK = ["--data", "synthetic", "--epochs", "2", "--batch-size", "64", "--no-progress"]


def train_process(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The CLI in a process of its own: exit code and streams as a user sees them."""
    return subprocess.run(
        [sys.executable, "-m", "gossip.train", *args],
        capture_output=True, text=True, timeout=timeout, env=ENV,
    )


def train(*args: str) -> subprocess.CompletedProcess:
    """The CLI's main() in this process (saves the start-up of a Python per run)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = gossip_train.main(list(args))
        except SystemExit as e:  # argparse's own exits (usage errors, --help)
            rc = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def torchrun(n: int, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """gossip.train under torchrun; each rank's own output is also kept (``result.logs``),
    so a failure shows the failing rank's own stderr tail (:func:`why`)."""
    return _torchrun(n, "-m", "gossip.train", *args, timeout=timeout, env=ENV)


def final_params(run_dir: Path) -> torch.Tensor:
    """The (n, d) parameters of the last checkpoint of a run, whatever the mode."""
    step = max(int(p.name.split("-step")[1].split("-")[0]) for p in run_dir.glob("ckpt-step*-rank*.pt"))
    files = sorted(run_dir.glob(f"ckpt-step{step}-rank*.pt"), key=lambda p: int(p.stem.split("rank")[1]))
    return torch.cat([checkpoint.load_checkpoint(f)["optimizer"]["params"] for f in files])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


SUMMARY_KEYS = {
    "algo", "topology", "world_size", "compressor", "bits", "epochs", "steps", "final_train_loss",
    "final_test_loss", "final_test_acc", "consensus_distance", "bytes_sent_per_node_per_step", "wall_time_s",
}


def test_simulate_writes_documented_files(tmp_path):
    out = tmp_path / "run"
    r = train("--simulate", "3", "--algo", "ecd", "--bits", "8", "--log-every", "5", "--out", str(out), *QUICK)
    assert r.returncode == 0, r.stderr
    assert "epoch   2/2" in r.stdout and "sent/node/step" in r.stdout
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["algo"] == "ecd" and cfg["compressor_spec"] == "quant:bits=8" and cfg["world_size"] == 3
    summary = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary)
    assert summary["world_size"] == 3 and summary["bits"] == 8 and summary["mode"] == "simulate"
    assert 0.0 <= summary["final_test_acc"] <= 1.0
    # 8-bit payloads of both ring neighbours: about a quarter of D-PSGD's bytes
    assert 0.2 < summary["bytes_ratio_to_dpsgd"] < 0.5
    for k in range(3):
        recs = read_jsonl(out / f"metrics-rank{k}.jsonl")
        train_recs = [r for r in recs if r["kind"] == "train"]
        evals = [r for r in recs if r["kind"] == "eval"]
        assert train_recs and len(evals) == 2
        for key in ("step", "epoch", "time", "loss", "lr", "bytes_sent", "bytes_recv", "compute_s", "compress_s", "comm_s"):
            assert key in train_recs[0], key
        steps = [r["step"] for r in train_recs]
        assert steps == sorted(steps) and steps[-1] == summary["steps"]
        sent = [r["bytes_sent"] for r in train_recs]
        assert sent == sorted(sent) and sent[0] > 0  # cumulative
        for key in ("test_loss", "test_acc", "consensus_distance", "node_acc_min", "node_acc_max", "train_loss"):
            assert key in evals[-1], key


def test_simulate_resume_is_bit_identical(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["--simulate", "3", "--algo", "dcd", "--bits", "4", "--momentum", "0.9", *QUICK]
    assert train(*common, "--out", str(full)).returncode == 0
    r = train(*common, "--out", str(part), "--max-steps", "17", "--checkpoint-every", "5")
    assert r.returncode == 0, r.stderr
    r = train(*common, "--resume", str(part))
    assert r.returncode == 0, r.stderr
    assert torch.equal(final_params(full), final_params(part))
    a = json.loads((full / "summary.json").read_text())
    b = json.loads((part / "summary.json").read_text())
    assert a["steps"] == b["steps"] and a["final_test_loss"] == b["final_test_loss"]
    assert a["final_train_loss"] == b["final_train_loss"]
    # the metrics of the resumed run continue where the checkpoint left off, no duplicates
    steps = [r["step"] for r in read_jsonl(part / "metrics-rank0.jsonl") if r["kind"] == "train"]
    assert steps == sorted(set(steps))


#: the bad input of test_torchrun_bad_input_fails_on_every_rank: a torus of 2 nodes
_BAD = ["--algo", "dcd", "--topology", "torus", *QUICK]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    """One torchrun launch of 2 ranks: each rank runs the whole run, then an interrupted
    one (9 steps) and its resume, then the bad input, each through the CLI's main() as
    python -m gossip.train does (the launch of the real command exiting non-zero on bad
    flags: tests/test_restarts.py)."""
    root = tmp_path_factory.mktemp("world2")
    args = ["--algo", "ecd", "--bits", "6", "--topology", "complete", *QUICK]
    r, codes = torchrun_jobs(2, [("dist", [*args, "--out", str(root / "dist")]),
                                 ("part", [*args, "--out", str(root / "part"), "--max-steps", "9"]),
                                 ("resume", [*args, "--resume", str(root / "part")]),
                                 ("bad", _BAD)],
                             timeout=240, cwd=root)
    return root, args, r, codes


@pytest.mark.multiprocess
def test_torchrun_world2_equals_simulation_and_resumes(world2, tmp_path):
    root, args, r, codes = world2
    assert r.returncode == 0 and {k: codes[k] for k in ("dist", "part", "resume")} == {
        "dist": [0, 0], "part": [0, 0], "resume": [0, 0]}, why(r)
    # the simulation in this process, with the ranks' thread count (one):
    # bit-identity holds whatever OMP_NUM_THREADS the caller has
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        r = train("--simulate", "2", "--simulate-mode", "loop", *args, "--out", str(tmp_path / "sim"))
    finally:
        torch.set_num_threads(threads)
    assert r.returncode == 0, r.stderr
    # simulation equals reality: the same parameters, bit for bit
    assert torch.equal(final_params(root / "dist"), final_params(tmp_path / "sim"))
    # and an interrupted torchrun run resumes to the same numbers
    assert torch.equal(final_params(root / "dist"), final_params(root / "part"))


@pytest.mark.multiprocess
def test_torchrun_world4_ring(tmp_path):
    out = tmp_path / "run"
    r = torchrun(4, "--algo", "dcd", "--bits", "8", "--topology", "ring", "--out", str(out), *QUICK)
    assert r.returncode == 0, why(r)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["mode"] == "torchrun"
    assert sorted(p.name for p in out.glob("metrics-rank*.jsonl")) == [f"metrics-rank{k}.jsonl" for k in range(4)]
    assert len(list(out.glob("ckpt-step*-rank*.pt"))) == 4
    # only rank 0 prints the epoch lines
    assert r.stdout.count("epoch   2/2") == 1


@pytest.mark.multiprocess
def test_torchrun_bad_input_fails_on_every_rank(world2):
    _, _, r, codes = world2
    assert codes["bad"] == [2, 2], why(r)
    errors = sorted(ln for ln in r.stderr.splitlines() if "gossip.train: error:" in ln)
    assert [ln.split(" gossip.train: error:")[0] for ln in errors] == ["[rank 0]", "[rank 1]"], r.stderr
    assert all("torus" in ln for ln in errors)


class _Writes(io.StringIO):
    """A stream that keeps each write apart, as an unbuffered stderr sends each one."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, s: str) -> int:
        self.calls.append(s)
        return super().write(s)


def test_each_ranks_line_reaches_stderr_in_one_write(monkeypatch):
    # under torchrun the ranks share one stream; unbuffered (python -u, PYTHONUNBUFFERED)
    # each write is a system call, so a line and its newline written apart let another
    # rank's line land between them and the two run together
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    err = _Writes()
    monkeypatch.setattr(sys, "stderr", err)
    assert gossip_train.main(["--simulate", "4", "--no-progress"]) == 2
    assert err.calls and all(c.endswith("\n") and c.count("\n") == 1 for c in err.calls), err.calls
    assert err.calls[0].startswith("[rank 3] gossip.train: error: ") and "torchrun" in err.calls[0]


def test_toml_config_and_flag_override(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('algo = "dcd"\nbits = 4\ndata = "synthetic"\nepochs = 1\nbatch-size = 128\nsimulate = 3\n')
    out = tmp_path / "run"
    r = train("--config", str(cfg), "--bits", "6", "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    c = json.loads((out / "config.json").read_text())
    assert c["algo"] == "dcd" and c["bits"] == 6 and c["batch_size"] == 128 and c["epochs"] == 1


def _one_error_line(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("gossip.train: error:"), lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert "Traceback" not in r.stderr
    return lines[0]


@pytest.mark.parametrize("args,needles", [
    (["--algo", "sgd"], ["--algo", "invalid choice", "ecd"]),
    (["--topology", "moebius"], ["--topology", "ring"]),
    (["--model", "vgg"], ["--model", "cnn1d"]),
    (["--data", "imagenet"], ["--data", "mnist1d"]),
    (["--simulate", "4", "--compressor", "zip:level=9"], ["--compressor", "quant"]),
    (["--simulate", "4", "--bits", "0"], ["--bits", "1 to 16"]),
    (["--simulate", "4", "--bits", "17"], ["--bits", "1 to 16"]),
    (["--simulate", "4", "--algo", "dpsgd", "--bits", "8"], ["dpsgd", "naive, dcd, ecd"]),
    (["--simulate", "7", "--topology", "torus"], ["torus", "7"]),
    (["--algo", "ecd"], ["at least 2 nodes", "torchrun"]),
    (["--simulate", "4", "--lr", "-1"], ["--lr", "> 0"]),
    (["--simulate", "4", "--epochs", "0"], ["--epochs", ">= 1"]),
    (["--config", "/nonexistent/run.toml"], ["--config", "no such file"]),
])
def test_bad_flags(args, needles):
    _one_error_line(train(*args, "--no-progress"), *needles)


@pytest.mark.parametrize("args,needles", [
    (["--algo", "sgd"], ["invalid choice"]),
    (["--simulate", "7", "--topology", "torus"], ["torus"]),
])
def test_bad_flags_exit_code_of_the_process(args, needles):
    _one_error_line(train_process(*args), *needles)


def test_bad_toml(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('algo = "dcd"\nspeed = 3\n')
    _one_error_line(train("--config", str(bad)), "unknown key 'speed'")
    bad.write_text("algo = \n")
    _one_error_line(train("--config", str(bad)), "not valid TOML")


def test_bad_data_dir(tmp_path):
    _one_error_line(train("--simulate", "2", "--topology", "complete", "--data", "cifar10", "--data-dir", str(tmp_path / "missing")), "does not exist")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "data_batch_1").write_bytes(b"not a pickle")
    _one_error_line(train("--simulate", "2", "--topology", "complete", "--data", "cifar10", "--data-dir", str(tmp_path / "junk")), "cifar10")


def _digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob("ckpt-*"))}


def test_resume_refuses_other_config_world_size_or_damage(tmp_path):
    out = tmp_path / "run"
    common = ["--algo", "dcd", "--bits", "8", *QUICK]
    assert train("--simulate", "3", *common, "--out", str(out), "--max-steps", "6").returncode == 0
    before = _digest(out)
    _one_error_line(train("--simulate", "3", *common, "--lr", "0.2", "--resume", str(out)), "different config", "lr")
    _one_error_line(train("--simulate", "4", *common, "--resume", str(out)), "world size")
    _one_error_line(train("--simulate", "3", *common, "--resume", str(tmp_path / "nowhere")), "--resume")
    assert _digest(out) == before  # refusals leave the checkpoints alone
    ck = next(out.glob("ckpt-*"))
    data = ck.read_bytes()
    ck.write_bytes(data[: len(data) // 2])
    _one_error_line(train("--simulate", "3", *common, "--resume", str(out)), "checkpoint")


def _write_cifar_batch(path: Path, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    batch = {
        b"batch_label": b"tiny batch",
        b"labels": [int(v) for v in rng.integers(0, 10, n)],
        b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        b"filenames": [f"img{i}.png".encode() for i in range(n)],
    }
    with open(path, "wb") as fh:
        pickle.dump(batch, fh)


def test_cifar10_from_a_local_directory(tmp_path):
    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    for i in range(1, 6):
        _write_cifar_batch(d / f"data_batch_{i}", 8, i)
    _write_cifar_batch(d / "test_batch", 8, 0)
    out = tmp_path / "run"
    r = train("--simulate", "2", "--algo", "dcd", "--bits", "8", "--topology", "complete", "--data", "cifar10",
              "--data-dir", str(d), "--epochs", "1", "--batch-size", "4", "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["model"] == "resnet20" and s["steps"] == 5  # 40 images / 2 nodes / batch 4


def test_emulated_latency_is_marked_and_waited(tmp_path):
    out = tmp_path / "run"
    r = train("--simulate", "3", "--algo", "dcd", *QUICK, "--max-steps", "10", "--emulate-latency", "20", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "latency: emulated 20 ms" in r.stdout
    s = json.loads((out / "summary.json").read_text())
    assert s["latency_mode"] == "emulated" and s["latency_ms"] == 20
    # one message round per gossip step: at least 10 x 20 ms in the communicate phase
    assert s["time_split_s"]["communicate"] >= 10 * 0.020


@pytest.mark.parametrize("algo,extra", [
    ("efsgd", []), ("efsgd", ["--compressor", "topk:k=20"]), ("efblocksgd", []), ("efblocksgdm", []),
    ("signsgd", ["--lr", "0.001"]), ("signum", ["--lr", "0.001"]), ("powersgd", ["--model", "mlp"]),
    ("sketched", ["--model", "mlp"]), ("localtopk", ["--model", "mlp"]),
])
def test_centralized_algorithms_run_from_the_cli(tmp_path, algo, extra):
    out = tmp_path / "run"
    r = train("--simulate", "2", "--algo", algo, *QUICK, "--max-steps", "6", "--out", str(out), *extra)
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["algo"] == algo and s["steps"] == 6
    # compressed: far fewer bytes than full-precision all-reduce would move
    assert 0 < s["bytes_sent_per_node_per_step"] < 0.5 * 4 * s["params"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["local_momentum"] == 0.0  # these algorithms own their momentum


def test_centralized_algorithm_bad_momentum_is_one_line():
    _one_error_line(train("--simulate", "2", "--algo", "signum", "--momentum", "0", *QUICK), "signum", "momentum")


def test_divergence_is_one_line_and_recorded(tmp_path):
    out = tmp_path / "run"
    r = train("--simulate", "3", "--algo", "dcd", "--model", "mlp", "--lr", "1e30", *QUICK, "--out", str(out))
    assert r.returncode == 1
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "training diverged at step" in lines[0] and "non-finite" in lines[0]
    s = json.loads((out / "summary.json").read_text())
    assert s["diverged"] is True and "non-finite" in s["reason"]


# --- --algo-opt: options of the algorithm's own Config ----------------------------------
ALGO_QUICK = ["--simulate", "2", "--model", "mlp", *QUICK, "--max-steps", "3"]


def _bytes_per_step(out: Path) -> float:
    return json.loads((out / "summary.json").read_text())["bytes_sent_per_node_per_step"]


def test_algo_options_reach_the_algorithm_and_config_json(tmp_path):
    one, two = tmp_path / "rank1", tmp_path / "rank2"
    r = train("--algo", "powersgd", *ALGO_QUICK, "--algo-opt", "rank=1", "--out", str(one))
    assert r.returncode == 0, r.stderr
    r = train("--algo", "powersgd", *ALGO_QUICK, "--algo-opt", "rank=2", "--algo-opt", "approximator=best",
              "--out", str(two))
    assert r.returncode == 0, r.stderr
    assert "algo=powersgd(approximator=best,rank=2)" in r.stdout
    cfg = json.loads((two / "config.json").read_text())
    assert cfg["algo_options"] == {"approximator": "best", "rank": 2}  # read as the fields' types
    # rank 2 sends two columns of P and Q per matrix where rank 1 sends one, best a P and Q per iteration
    assert _bytes_per_step(one) < _bytes_per_step(two)


def test_algo_options_of_sketched_and_efmomentum(tmp_path):
    r = train("--algo", "sketched", *ALGO_QUICK, "--out", str(tmp_path / "p01"))
    assert r.returncode == 0, r.stderr
    r = train("--algo", "sketched", *ALGO_QUICK, "--algo-opt", "p=0.05", "--out", str(tmp_path / "p05"))
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "p05" / "config.json").read_text())["algo_options"] == {"p": 0.05}
    assert _bytes_per_step(tmp_path / "p05") > 2 * _bytes_per_step(tmp_path / "p01")
    # efmomentum's nesterov changes the update, not the bytes
    for nesterov in ("true", "false"):
        r = train("--algo", "efmomentum", *ALGO_QUICK, "--algo-opt", f"nesterov={nesterov}",
                  "--out", str(tmp_path / nesterov))
        assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "false" / "config.json").read_text())["algo_options"] == {"nesterov": False}
    assert not torch.equal(final_params(tmp_path / "true"), final_params(tmp_path / "false"))


@pytest.mark.parametrize("opts,needles", [
    (["rank"], ["--algo-opt 'rank'", "KEY=VALUE"]),
    (["=4"], ["--algo-opt '=4'", "KEY=VALUE"]),
    (["ranks=4"], ["ranks", "--algo powersgd", "accepted: rank,", "approximator", "iterations"]),
    (["seed=3"], ["seed", "--seed"]),
    (["momentum=0.5"], ["momentum", "--momentum"]),
    (["shapes=4"], ["--algo-opt shapes: not an option of --algo powersgd", "accepted: rank"]),
    (["rank=two"], ["rank=two", "an integer"]),
    (["nesterov=maybe"], ["nesterov", "true or false"]),
    (["iterations=many"], ["iterations", "an integer or none"]),
    (["approximator=worst"], ["--algo powersgd", "approximator", "power, unbiased, best"]),  # the Config's own check
    (["rank=0"], ["--algo powersgd", "rank"]),
])
def test_bad_algo_options_are_one_line(opts, needles):
    args = [a for o in opts for a in ("--algo-opt", o)]
    _one_error_line(train("--algo", "powersgd", *ALGO_QUICK, *args), *needles)


def test_algo_options_compressor_and_none_to_set():
    _one_error_line(train("--algo", "efmomentum", *ALGO_QUICK, "--algo-opt", "compressor=topk"), "--compressor")
    _one_error_line(train("--algo", "allreduce", *ALGO_QUICK, "--algo-opt", "rank=2"), "allreduce",
                    "accepted: aggregator")


def test_algo_options_from_toml_merge_with_flags(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('algo = "powersgd"\n\n[algo_options]\nrank = 2\napproximator = "best"\n')
    out = tmp_path / "run"
    r = train("--config", str(cfg), *ALGO_QUICK, "--algo-opt", "approximator=unbiased", "--out", str(out))
    assert r.returncode == 0, r.stderr
    c = json.loads((out / "config.json").read_text())
    assert c["algo_options"] == {"approximator": "unbiased", "rank": 2}
    cfg.write_text('algo = "powersgd"\n\n[algo_options]\nrank = [2]\n')
    _one_error_line(train("--config", str(cfg), *ALGO_QUICK), "rank", "a number, true/false or text")


def test_resume_refuses_other_algo_options(tmp_path):
    out = tmp_path / "run"
    common = ["--algo", "powersgd", "--simulate", "2", "--model", "mlp", *QUICK]
    r = train(*common, "--algo-opt", "rank=2", "--max-steps", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    before = _digest(out)
    _one_error_line(train(*common, "--algo-opt", "rank=3", "--resume", str(out)), "different config", "algo_options")
    _one_error_line(train(*common, "--resume", str(out)), "different config", "algo_options")
    assert _digest(out) == before
    r = train(*common, "--algo-opt", "rank=2", "--max-steps", "5", "--resume", str(out))
    assert r.returncode == 0, r.stderr
