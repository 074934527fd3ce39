"""The benchmark driver end to end on a tiny spec: structure of the report, tuning that
never reads the test split, and a re-run that redoes nothing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))

import bench_data  # noqa: E402
import benchmark  # noqa: E402

SPEC = """
seeds = [0]
lr_factors = [0.5, 1.0]
[workloads.blobs]
data = "synthetic"
model = "mlp"
samples_per_node = 48
epochs = 2
tune_epochs = 1
batch_size = 16
target = 0.4
nodes = [2]
[methods.allreduce]
flags = ["--algo", "allreduce"]
lr = 0.05
[methods.localsgd]
flags = ["--algo", "localsgd"]
lr = 0.05
[links]
bandwidth = ["10mbit", "1gbit"]
latency = ["0", "10ms"]
"""


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    (tmp / "spec.toml").write_text(SPEC)
    out = tmp / "out"
    bench_data.SERVED.clear()
    rc = benchmark.main(["run", "--spec", str(tmp / "spec.toml"), "--out", str(out)])
    assert rc == 0
    served = list(bench_data.SERVED)
    rc = benchmark.main(["report", "--out", str(out), "--md", str(tmp / "docs" / "benchmark.md")])
    assert rc == 0
    return tmp, out, served


def test_the_report_has_the_verdict_and_method_tables(bench):
    tmp, out, _ = bench
    whole = json.loads((out / "benchmark.json").read_text())
    res, prov = whole["results"], whole["provenance"]
    nd = res["workloads"]["blobs"]["nodes"]["2"]
    assert set(nd["methods"]) == {"allreduce", "localsgd"}
    assert set(nd["verdicts"]) == {"10mbit@0", "10mbit@10ms", "1gbit@0", "1gbit@10ms"}
    for name, m in nd["methods"].items():
        assert m["lr"] in (0.025, 0.05)
        assert [s["lr"] for s in m["tuning"]] == [0.025, 0.05]
        assert m["budget"]["tune"]["runs"] == 2 and m["budget"]["final"]["runs"] == 1
        assert m["budget"]["tune"]["steps"] > 0 and m["budget"]["final"]["cpu_s"] >= 0
    for key, v in nd["verdicts"].items():  # the winner is the fastest of those that reached the target
        times = {k: m["links"][key]["time_s"]["mean"] for k, m in nd["methods"].items() if m["links"][key]["all_reached"]}
        assert v["winner"] == min(times, key=times.get)
        assert v["separated"] is None  # one seed: no interval, no claim
    for k in ("command", "commit", "dirty", "date", "machine", "load_before", "load_after", "torch", "source_ids"):
        assert k in prov
    assert "python experiments/benchmark.py run --spec" in prov["command"]
    md = (tmp / "docs" / "benchmark.md").read_text()
    assert "## Verdict" in md and "## Per method" in md and "| blobs | 2 | 10mbit@0 |" in md
    assert "![benchmark-blobs-n2](./benchmark-blobs-n2.png)" in md
    assert (tmp / "docs" / "benchmark-blobs-n2.png").stat().st_size > 0


def test_tuning_never_reads_the_test_split(bench):
    _, out, served = bench
    full = bench_data.build("synthetic", 96, "test")
    test_digest = bench_data.digest(full.x_test, full.y_test)
    keep, val = bench_data.carve(96)
    val_digest = bench_data.digest(full.x_train[val], full.y_train[val])
    assert set(keep.tolist()).isdisjoint(val.tolist())
    tune = [s for s in served if s["role"] == "val"]
    final = [s for s in served if s["role"] == "test"]
    assert len(tune) == 4 and len(final) == 2
    assert {s["eval_digest"] for s in tune} == {val_digest} != {test_digest}
    assert {s["eval_digest"] for s in final} == {test_digest}
    for rec in (json.loads(p.read_text()) for p in out.rglob("trial.json")):  # and each trial recorded it
        want = val_digest if rec["stage"] == "tune" else test_digest
        assert rec["data"]["eval_digest"] == want and rec["data"]["num_train"] == (86 if rec["stage"] == "tune" else 96)


def test_a_rerun_redoes_nothing(bench, capsys):
    tmp, out, _ = bench
    before = {p: p.stat().st_mtime_ns for p in out.rglob("summary.json")}
    assert benchmark.main(["run", "--spec", str(tmp / "spec.toml"), "--out", str(out)]) == 0
    assert "0 ran (0 failed), 6 already finished" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in out.rglob("summary.json")} == before


def test_a_bad_spec_is_one_line(tmp_path, capsys):
    (tmp_path / "s.toml").write_text(SPEC.replace("tune_epochs = 1", "tune_epochs = 5"))
    assert benchmark.main(["run", "--spec", str(tmp_path / "s.toml"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "benchmark: workloads.blobs: tune_epochs = 5 must lie in [1, epochs = 2]"
    (tmp_path / "s.toml").write_text(SPEC.replace('"10mbit", "1gbit"', '"fast"'))
    assert benchmark.main(["run", "--spec", str(tmp_path / "s.toml"), "--out", str(tmp_path / "o")]) == 2
    assert "bandwidth 'fast'" in capsys.readouterr().err


def test_crossover_answers_from_the_benchmark(bench, capsys):
    """``gossip.crossover --benchmark``: the fastest methods at the nearest benchmarked point,
    in the benchmark's own order, and how far the user's model is from the benchmarked one."""
    from gossip import crossover, leaderboard

    _, out, _ = bench
    res = leaderboard.load(out / "benchmark.json")
    ans = leaderboard.answer(res, 12e6, 0.008, 3, params=10 * res["workloads"]["blobs"]["params"] + 1)
    assert len(ans) == 1 and ans[0]["link"] == "10mbit@10ms" and ans[0]["nodes"] == 2
    stats = res["workloads"]["blobs"]["nodes"]["2"]["methods"]
    want = sorted((m for m in stats if stats[m]["links"]["10mbit@10ms"]["all_reached"]),
                  key=lambda m: stats[m]["links"]["10mbit@10ms"]["time_s"]["mean"])
    assert [m["method"] for m in ans[0]["methods"]] == want
    assert ans[0]["size_ratio"] > 10
    rc = crossover.main(["--benchmark", str(out / "benchmark.json"), "--benchmark-only", "--bandwidth", "1gbit",
                         "--latency", "0", "--world-size", "2", "--params", "5000"])
    text = capsys.readouterr().out
    assert rc == 0 and "nearest benchmarked point (1gbit@0, 2 nodes)" in text and "1. " in text
    assert crossover.main(["--benchmark", str(out / "missing.json"), "--benchmark-only"]) == 2
    assert capsys.readouterr().err.strip().endswith("cannot read it (No such file or directory)")
