"""The benchmark's methods measured on shaped links (experiments/benchmark_netns.py): each
method repeats its benchmark trial as torchrun ranks in network namespaces, and the
report gains the table."""

from __future__ import annotations

import json
import secrets
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
from experiments import bench_data
from experiments import benchmark
from experiments import benchmark_netns
from experiments import tables

from tests.test_benchmark import SPEC  # noqa: E402
from tests.test_race import _netns_reason  # noqa: E402


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """The tiny benchmark of tests/test_benchmark.py: 2 methods, 2 nodes, 1 seed."""
    tmp = tmp_path_factory.mktemp("bnet")
    (tmp / "spec.toml").write_text(SPEC)
    bench_data.SERVED.clear()
    assert benchmark.main(["run", "--spec", str(tmp / "spec.toml"), "--out", str(tmp / "out")]) == 0
    return tmp, tmp / "out" / "benchmark.json"


def test_a_rank_runs_the_trial_without_the_simulation():
    args = ["--simulate", "4", "--data", "bench_data:mnist1d_n4000_test", "--model", "cnn1d", "--lr", "0.2",
            "--seed", "0", "--log-every", "1", "--no-progress", "--overwrite", "--no-node-eval", "--out", "x"]
    assert benchmark_netns.rank_args(args) == ["--data", "bench_data:mnist1d_n4000_test", "--model", "cnn1d",
                                               "--lr", "0.2", "--seed", "0", "--no-node-eval"]


def test_the_runs_repeat_each_methods_final_trial(bench):
    _, path = bench
    results = json.loads(path.read_text())["results"]
    runs = benchmark_netns.plan_runs(results, "blobs", 2, 0, None)
    assert [r["method"] for r in runs] == ["allreduce", "localsgd"]  # the spec's order
    for r in runs:
        m = results["workloads"]["blobs"]["nodes"]["2"]["methods"][r["method"]]
        trial = next(t for t in results["trials"] if t["key"] == r["trial"])
        assert trial["stage"] == "final" and trial["seed"] == 0 and r["lr"] == m["lr"] == trial["lr"]
        assert "--simulate" not in r["args"] and f"{m['lr']:g}" in r["args"]
        assert r["simulated"]["10mbit@0"]["time_s"] == m["seeds"]["0"]["links"]["10mbit@0"]["time_s"]


@pytest.mark.parametrize("argv, msg", [
    (["--workload", "gpt"], "--workload gpt: not in the results file (it has blobs)"),
    (["--workload", "blobs", "--nodes", "4"], "--nodes 4: the results file has no blobs trials at 4 nodes (it has 2)"),
    (["--workload", "blobs", "--nodes", "2", "--seed", "3"], "--seed 3: not one of the protocol's final seeds [0]"),
    (["--workload", "blobs", "--nodes", "2", "--methods", "allreduce,dpsgd"],
     "--methods: no finished tuning of dpsgd at 2 nodes on blobs; accepted: allreduce, localsgd"),
    (["--workload", "blobs", "--nodes", "2", "--bandwidth", "fast"], "--bandwidth fast:"),
])
def test_bad_arguments_are_one_line(bench, tmp_path, capsys, argv, msg):
    _, path = bench
    assert benchmark_netns.main(["--results", str(path), "--out", str(tmp_path / "n"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("benchmark_netns: error: " + msg) and len(err.splitlines()) == 1
    assert not (tmp_path / "n").exists()


def test_a_resumed_file_of_another_run_is_one_line(bench, tmp_path, capsys):
    """--resume takes only a file of this script for the same workload, nodes, seed and
    stopping rule; anything else is one line, before any cluster is made."""
    _, path = bench
    other = {"workload": "blobs", "nodes": 4, "seed": 0, "stop_at_target": True, "runs": {}}
    (tmp_path / "other.json").write_text(json.dumps({"provenance": {"command": "x"}, "results": other}))
    (tmp_path / "bench.json").write_text(path.read_text())
    for f, msg in [("other.json", "its nodes is 4, this run's 2"), ("bench.json", "not a results file of"),
                   ("missing.json", "No such file")]:
        assert benchmark_netns.main(["--results", str(path), "--out", str(tmp_path / "n"), "--workload", "blobs",
                                     "--nodes", "2", "--resume", str(tmp_path / f)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"benchmark_netns: error: --resume {tmp_path / f}: ") and msg in err, err
        assert len(err.splitlines()) == 1 and not (tmp_path / "n").exists()


def test_a_file_that_is_not_a_benchmark_results_file_is_one_line(tmp_path, capsys):
    (tmp_path / "x.json").write_text(json.dumps({"provenance": {}, "results": {"rows": []}}))
    assert benchmark_netns.main(["--results", str(tmp_path / "x.json"), "--out", str(tmp_path / "n")]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a benchmark results file" in err and len(err.splitlines()) == 1


@pytest.mark.netns
@pytest.mark.skipif(_netns_reason() is not None, reason=f"needs network namespaces: {_netns_reason()}")
def test_the_methods_run_on_shaped_links_and_the_report_shows_them(bench, capsys):
    """In two parts: allreduce, then localsgd resuming the first part's file."""
    tmp, path = bench
    out = tmp / "netns"
    common = ["--results", str(path), "--workload", "blobs", "--nodes", "2", "--bandwidth", "10mbit",
              "--prefix", "b" + secrets.token_hex(3), "--timeout", "300"]
    assert benchmark_netns.main([*common, "--out", str(out), "--methods", "allreduce",
                                 "--netns-results", str(tmp / "bn1.json")]) == 0
    first = json.loads((tmp / "bn1.json").read_text())["results"]
    assert set(first["runs"]) == {"allreduce"} and first["not_run"] == ["localsgd"] and first["sessions"] == []
    assert benchmark_netns.main([*common, "--out", str(out), "--methods", "localsgd", "--resume",
                                 str(tmp / "bn1.json"), "--netns-results", str(tmp / "bn.json")]) == 0
    saved = json.loads((tmp / "bn.json").read_text())
    res = saved["results"]
    assert "python -m experiments.benchmark_netns --results" in saved["provenance"]["command"]
    assert list(res["runs"]) == ["allreduce", "localsgd"] and res["bandwidths"] == ["10mbit"]  # the spec's order
    assert res["runs"]["allreduce"] == first["runs"]["allreduce"] and res["not_run"] == []
    assert [x["command"] for x in res["sessions"]] == [json.loads((tmp / "bn1.json").read_text())["provenance"]["command"]]
    for name, per in res["runs"].items():
        run = per["10mbit"]
        assert run["ok"] and run["points"], name
        assert (out / f"{name}@10mbit" / "metrics-rank1.jsonl").is_file()  # two ranks, each its own file
        assert run["simulated_time_s"] > 0  # the simulated trial's model at 10mbit@0
        t = run["to_target"]
        if t["time_s"] is not None:  # reached: stopped there, and the errors are the ratios
            assert run["stopped_at_target"] and t["time_s"] > 0
            if run["simulated_time_s"] is not None:
                assert run["simulated_error"] == pytest.approx(run["simulated_time_s"] / t["time_s"] - 1)
    text = capsys.readouterr().out
    assert "## Measured in the netns cluster (2 nodes)" in text and "\n| 10mbit | allreduce |" in text
    resumed = text[text.index("it resumed 1 earlier session(s) (`"):]
    assert "python -m experiments.benchmark_netns --results" in resumed and "--methods allreduce" in resumed.split(";")[0]
    md = tmp / "docs" / "b.md"
    assert benchmark.main(["report", "--results", str(path), "--netns", str(tmp / "bn.json"), "--md", str(md)]) == 0
    page = md.read_text()
    assert "## Measured in the netns cluster (2 nodes)" in page and "\n| 10mbit | localsgd |" in page
    assert page.index("## Measured in the netns cluster") > page.index("## Per method")


def test_a_method_its_simulation_never_brought_to_the_target_is_not_measured_there(capsys):
    """Stopped at the target, such a run would go to its last epoch and give no time to
    target: it is listed as unreached, and no cluster is made for a link with nothing
    to measure."""
    import argparse

    runs = [{"method": "slow", "simulated": {"10mbit@0": {"time_s": None}}}]
    res = {"runs": {"slow": {}}, "unreached": {}}
    a = argparse.Namespace(also_unreached=False, to_end=False)
    benchmark_netns._measure(a, res, runs, ["10mbit"], [10e6], {"target": 0.9})
    assert res["unreached"] == {"slow": ["10mbit"]} and res["runs"] == {"slow": {}}
    assert "slow @ 10mbit: not measured (its simulated trial did not reach the target" in capsys.readouterr().out
    text = tables.benchmark_netns_section({"workload": "w", "nodes": 4, "seed": 0, "target": 0.9, "metric": "test_acc",
                                    "bandwidths": ["10mbit"], "runs": {}, "unreached": res["unreached"]}, {})
    assert "did not reach the target at that link (the run would give no time to target): slow at 10mbit." in text


def test_an_interrupted_run_keeps_what_finished_and_resumes_from_it(bench, tmp_path, monkeypatch, capsys):
    """Ctrl-C in the middle: the results file holds the runs that finished, says it was
    interrupted, and a --resume of it measures only the rest."""
    _, path = bench
    seen = []

    def measure(a, res, runs, bws, rates, wl):
        seen.append([r["method"] for r in runs])
        res["runs"][runs[0]["method"]]["10mbit"] = {
            "marker": len(seen), "lr": 0.05, "wire": {"label": "fp32"}, "ok": True, "stopped_at_target": True,
            "points": [], "load_average": [0.1, 0.2], "date": "2026-01-01T00:00", "simulated_time_s": 0.5,
            "simulated_error": -0.5, "to_target": {"time_s": 1.0, "epoch": 1, "bytes": 10, "model_s": 0.9,
                                                   "model_error": -0.1, "warmup_s": 0.1}}
        if len(seen) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(benchmark_netns, "_measure", measure)
    monkeypatch.setattr(benchmark_netns.vcluster, "check_rights", lambda: None)
    common = ["--results", str(path), "--out", str(tmp_path / "n"), "--workload", "blobs", "--nodes", "2",
              "--bandwidth", "10mbit"]
    assert benchmark_netns.main([*common, "--netns-results", str(tmp_path / "a.json")]) == 130
    assert "interrupted (SIGINT); the 1 finished run(s) are in" in capsys.readouterr().err
    first = json.loads((tmp_path / "a.json").read_text())["results"]
    assert first["interrupted"] == "SIGINT" and list(first["runs"]) == ["allreduce"]
    assert first["not_run"] == ["localsgd"]
    assert benchmark_netns.main([*common, "--methods", "localsgd", "--resume", str(tmp_path / "a.json"),
                                 "--netns-results", str(tmp_path / "b.json")]) == 0
    res = json.loads((tmp_path / "b.json").read_text())["results"]
    assert seen == [["allreduce", "localsgd"], ["localsgd"]]
    assert {m: per["10mbit"]["marker"] for m, per in res["runs"].items()} == {"allreduce": 1, "localsgd": 2}
    assert res["not_run"] == [] and "interrupted" not in res and len(res["sessions"]) == 1
