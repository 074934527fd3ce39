"""``--no-node-eval``: the nodes' own models are not evaluated, and every other figure
of the run (eval records, training records, bytes, summary) is the same bit for bit,
on both simulation paths; the benchmark passes it and still counts trials run without it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from gossip import train

REPO = Path(__file__).resolve().parents[1]
from experiments import benchmark

#: wall-clock timings differ between any two runs; everything else must not
# wall-clock figures, and the modelled time, which uses the run's measured compute when
# --compute-time is not given
TIMINGS = {"time", "warmup_s", "compute_s", "compress_s", "comm_s", "wait_s", "time_split_s", "wall_time_s",
           "modelled_time_s"}


def _records(run: Path, k: int) -> list[dict]:
    out = []
    for line in (run / f"metrics-rank{k}.jsonl").read_text().splitlines():
        out.append({key: v for key, v in json.loads(line).items() if key not in TIMINGS})
    return out


@pytest.mark.parametrize("mode", ["vectorized", "loop"])
def test_skipping_the_nodes_evaluation_changes_no_other_figure(tmp_path, mode, capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # both runs on the same thread count: bit-identity is asserted
    try:
        common = ["--simulate", "3", "--simulate-mode", mode, "--algo", "ecd", "--bits", "4", "--model", "mlp",
                  "--data", "synthetic", "--data-opt", "num_train=768", "--data-opt", "num_test=256", "--epochs", "2",
                  "--batch-size", "64", "--log-every", "1", "--no-progress"]
        assert train.main([*common, "--out", str(tmp_path / "all")]) == 0
        assert train.main([*common, "--no-node-eval", "--out", str(tmp_path / "skip")]) == 0
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "[nodes " in printed  # the first run's epoch lines show the nodes' range, the second's cannot
    for k in range(3):
        full, skip = _records(tmp_path / "all", k), _records(tmp_path / "skip", k)
        evals = [r for r in full if r["kind"] == "eval"]
        assert len(evals) == 2 and all("node_acc_min" in r for r in evals)
        assert not any(key.startswith("node_") for r in skip for key in r)
        assert [{key: v for key, v in r.items() if not key.startswith("node_")} for r in full] == skip
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("all", "skip"))
    assert {k: v for k, v in a.items() if k not in TIMINGS | {"out"}} == {
        k: v for k, v in b.items() if k not in TIMINGS | {"out"}}
    assert json.loads((tmp_path / "skip" / "config.json").read_text())["node_eval"] is False


def test_the_benchmark_skips_it_and_counts_trials_run_without_the_flag(tmp_path):
    spec = benchmark.load_spec(REPO / "experiments" / "benchmark.toml")
    t = benchmark.plan(spec, workloads=["mnist1d"], nodes=[4], methods=["dpsgd"])[0]
    args = benchmark._train_args(t, 0.1, tmp_path)
    assert "--no-node-eval" in args
    older = [a for a in args if a != "--no-node-eval"]  # a trial recorded before the flag existed
    assert benchmark._protocol_args(older) == benchmark._protocol_args(args)
    other_seed = ["9" if i and older[i - 1] == "--seed" else a for i, a in enumerate(older)]
    assert other_seed != older and benchmark._protocol_args(other_seed) != benchmark._protocol_args(args)
