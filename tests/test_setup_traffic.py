"""Per-step figures mean per step: the one-off exchange of x_1 is setup traffic, and
compilation is warm-up time, both kept apart whatever the run's length."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from gossip import compress
from gossip.tools import analysis
from tests.conftest import REPO, child_env, run_process
from tests.test_train import train

SIZE_CHECK_BYTES = 16  # docs/comm.md: the size check, each way per neighbour, once per payload size
RING = ["--simulate", "8", "--algo", "ecd", "--bits", "8", "--topology", "ring", "--model", "mlp",
        "--data", "synthetic", "--no-progress"]


def _summary(tmp_path, name, *args, env=None):
    out = tmp_path / name
    r = run_process([sys.executable, "-m", "gossip.train", *args, "--out", str(out)], timeout=600,
                    cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "summary.json").read_text()), json.loads((out / "config.json").read_text()), r.stdout


def _summary_here(tmp_path, name, *args):
    """The CLI's main() in this process (no start-up of a Python and torch per run), on
    one thread as the child processes run."""
    out = tmp_path / name
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        r = train(*args, "--out", str(out))
    finally:
        torch.set_num_threads(threads)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "summary.json").read_text()), json.loads((out / "config.json").read_text()), r.stdout


def test_one_step_and_a_hundred_steps_report_the_same_bytes_per_step(tmp_path):
    one, cfg, _ = _summary_here(tmp_path, "one", *RING, "--max-steps", "1")
    many, _, stdout = _summary_here(tmp_path, "many", *RING, "--max-steps", "100")
    d = cfg["params"]
    # step 1 alone carries the one size check of the 8-bit payload (2 neighbours): headers
    assert one["bytes_sent_per_node_per_step"] == pytest.approx(many["bytes_sent_per_node_per_step"],
                                                                abs=2 * SIZE_CHECK_BYTES)
    for s in (one, many):
        assert s["bytes_ratio_to_dpsgd"] == pytest.approx(0.25, abs=0.01)
        # x_1 in fp32 to each of the 2 neighbours, plus its size check, by hand
        assert s["setup_bytes_per_node"] == 2 * (compress.build("identity").payload_nbytes(d) + SIZE_CHECK_BYTES)
        assert s["bytes_sent_per_node_total"] == pytest.approx(
            s["setup_bytes_per_node"] + s["steps"] * s["bytes_sent_per_node_per_step"])
        assert s["schema"] == 3
    assert "(0.25" in stdout  # the epoch line's D-PSGD ratio, 0.250x or so
    metrics = [json.loads(line) for line in (tmp_path / "many" / "metrics-rank0.jsonl").read_text().splitlines()]
    last = [m for m in metrics if m["kind"] == "train"][-1]
    assert last["setup_bytes_sent"] == many["setup_bytes_per_node"]
    assert last["bytes_sent"] == pytest.approx(100 * many["bytes_sent_per_node_per_step"], abs=1)
    runs = analysis.load_runs(tmp_path).runs
    assert list(runs["setup_traffic"]) == ["apart", "apart"]
    assert list(runs["setup_bytes_per_node"]) == [one["setup_bytes_per_node"]] * 2


def test_compilation_is_warm_up_not_compression(tmp_path):
    """With the compiled kernels forced and an empty compile cache, the first step
    compiles: that time is warm-up. The steady compress time is of the order of a warm
    run's (same cache, second run), never the seconds compilation takes."""
    env = child_env(extra={"GOSSIP_COMPRESS_BACKEND": "compile",
                           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    args = [RING[0], "4", *RING[2:], "--max-steps", "10"]  # a ring of 4
    cold, _, stdout = _summary(tmp_path, "cold", *args, env=env)
    warm, _, _ = _summary(tmp_path, "warm", *args, env=env)
    assert cold["warmup_s"] > 0 and "warm-up" in stdout
    assert cold["warmup_s"] > 10 * cold["time_split_s"]["compress"]  # compiling dwarfs 9 steady steps
    assert cold["time_split_s"]["compress"] < 3 * warm["time_split_s"]["compress"] + 0.5
    assert cold["warmup_s"] > warm["warmup_s"]  # the second run found its kernels compiled
