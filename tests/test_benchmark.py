"""The benchmark driver end to end on a tiny spec: structure of the report, tuning that
never reads the test split, and a re-run that redoes nothing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
from experiments import bench_data
from experiments import benchmark

from gossip.data import text as textdata  # noqa: E402

SPEC = """
seeds = [0]
lr_factors = [0.5, 1.0]
grid_extensions = 0
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
    assert "python -m experiments.benchmark run --spec" in prov["command"]
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
    assert err == f"benchmark: {tmp_path / 's.toml'}: workloads.blobs.tune_epochs: 5 must lie in [1, epochs = 2]"
    (tmp_path / "s.toml").write_text(SPEC.replace('"10mbit", "1gbit"', '"fast"'))
    assert benchmark.main(["run", "--spec", str(tmp_path / "s.toml"), "--out", str(tmp_path / "o")]) == 2
    assert "links.bandwidth[0]: 'fast': expected a positive rate" in capsys.readouterr().err


def test_crossover_answers_from_the_benchmark(bench, capsys):
    """``gossip.tools.crossover --benchmark``: the fastest methods at the nearest benchmarked point,
    in the benchmark's own order, and how far the user's model is from the benchmarked one."""
    from gossip.tools import crossover, leaderboard

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


# ----------------------------------------------------------------------------- the language-model workload
LM_SPEC = """
seeds = [0]
lr_factors = [0.5, 1.0]
grid_extensions = 0
[workloads.tinygpt]
data = "synthtext"
context = 16
model = "gpt"
samples_per_node = 48
epochs = 2
tune_epochs = 1
batch_size = 8
target = 6.0
recipe = ["--model-opt", "layers=1", "--model-opt", "width=16", "--model-opt", "heads=2"]
nodes = [2]
[methods.allreduce]
flags = ["--algo", "allreduce"]
lr = 0.01
[links]
bandwidth = ["10mbit"]
latency = ["0"]
"""


@pytest.fixture(scope="module")
def lm_bench(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lmbench")
    (tmp / "spec.toml").write_text(LM_SPEC)
    bench_data.SERVED.clear()
    assert benchmark.main(["run", "--spec", str(tmp / "spec.toml"), "--out", str(tmp / "out"),
                           "--results", str(tmp / "results.json")]) == 0
    return tmp, list(bench_data.SERVED)


def test_the_lm_workload_is_tuned_on_held_out_text_and_judged_lower_is_better(lm_bench):
    tmp, served = lm_bench
    whole = json.loads((tmp / "results.json").read_text())
    res = whole["results"]
    w = res["workloads"]["tinygpt"]
    assert w["metric"] == "test_bpb" and w["higher_is_better"] is False and w["task"] == "lm"
    m = w["nodes"]["2"]["methods"]["allreduce"]
    scores = {s["lr"]: s["validation"] for s in m["tuning"]}
    assert set(scores) == {0.005, 0.01} and m["lr"] == min(scores, key=scores.get)  # the lower bpb wins
    assert m["final"]["mean"] == res["trials"][-1]["result"]["final"]["final_test_bpb"]
    # the validation block is the training text's tail, before the test tail; tuning never sees the test split
    text, _ = bench_data._corpus("synthtext")
    n = bench_data.TEXT_EVAL_BYTES
    val = bench_data.build("synthtext", 96, "val", 16)
    test = bench_data.build("synthtext", 96, "test", 16)
    assert bytes(test.x_test[0].tolist()) == text[-n:][:16] and bytes(val.x_test[0].tolist()) == text[-2 * n:-n][:16]
    head = textdata.windows(text[:-2 * n], 16)[0]  # every tuning window starts before the held-out blocks
    rows = {bytes(r.tolist()) for r in head}
    assert all(bytes(x.tolist()) in rows for x in val.x_train) and len(val.x_train) == 96
    tune = {s["eval_digest"] for s in served if s["role"] == "val"}
    final = {s["eval_digest"] for s in served if s["role"] == "test"}
    assert tune == {bench_data.digest(val.x_test, val.y_test)} and final == {bench_data.digest(test.x_test, test.y_test)}
    assert all(s["num_train"] == 96 for s in served)  # the same windows per node whatever the role
    md = benchmark.report({**res, "provenance": whole["provenance"]}, tmp / "b.md", tmp)
    assert "target 6.000 bpb test_bpb, lower is better" in md and "| tinygpt | 2 | 10mbit@0 |" in md


def test_the_results_file_stands_alone_and_resumes_a_session(lm_bench, capsys):
    """The report needs no run directory; a run given the results file of an earlier
    session (as the device machine's files come back) redoes nothing."""
    tmp, _ = lm_bench
    capsys.readouterr()
    other = tmp / "elsewhere"
    assert benchmark.main(["run", "--spec", str(tmp / "spec.toml"), "--out", str(other), "--resume",
                           str(tmp / "results.json"), "--results", str(tmp / "again.json")]) == 0
    out = capsys.readouterr().out
    assert "3 finished trials taken from" in out and "0 ran (0 failed), 3 already finished" in out
    assert not list(other.rglob("summary.json"))  # nothing was trained
    first, again = (json.loads((tmp / f).read_text()) for f in ("results.json", "again.json"))
    assert again["results"]["workloads"] == first["results"]["workloads"]
    assert again["results"]["sessions"] == [first["provenance"]]
    assert benchmark.main(["report", "--results", str(tmp / "again.json"), "--md", str(tmp / "r" / "x.md")]) == 0
    assert "resumed 1 earlier session(s)" in (tmp / "r" / "x.md").read_text()
    assert (tmp / "r" / "x-tinygpt-n2.png").stat().st_size > 0
    # a budget: --stop-after 0 starts nothing, and the file still says what is done
    assert benchmark.main(["run", "--spec", str(tmp / "spec.toml"), "--out", str(tmp / "fresh"),
                           "--stop-after", "0", "--results", str(tmp / "none.json")]) == 0
    assert "0 ran (0 failed), 0 already finished; 0 of 3 planned trials done" in capsys.readouterr().out
    assert benchmark.main(["plan", "--spec", str(tmp / "spec.toml"), "--estimate", str(tmp / "results.json"),
                           "--jobs", "2"]) == 0
    assert "tinygpt n=2: 3 trials" in capsys.readouterr().out


def test_bad_lm_specs_and_resume_files_are_one_line(tmp_path, capsys):
    cases = [(LM_SPEC.replace("context = 16\n", ""), "workloads.tinygpt.context: missing: a text workload "
                                                      "needs a positive integer context"),
             (LM_SPEC.replace('target = 6.0', 'target = 6.0\nmetric = "test_acc"'),
              "workloads.tinygpt.metric: 'test_acc': a lm workload is judged on one of test_bpb, test_loss"),
             (SPEC.replace("nodes = [2]", "nodes = [2]\ncontext = 8"),
              "workloads.blobs.context: 8: only the text data text, synthtext take a context")]
    for text, want in cases:
        (tmp_path / "s.toml").write_text(text)
        assert benchmark.main(["plan", "--spec", str(tmp_path / "s.toml")]) == 2
        assert capsys.readouterr().err.strip() == f"benchmark: {tmp_path / 's.toml'}: {want}"
    (tmp_path / "s.toml").write_text(LM_SPEC)
    (tmp_path / "r.json").write_text('{"provenance": {}, "results": {"workloads": {}}}')
    assert benchmark.main(["run", "--spec", str(tmp_path / "s.toml"), "--out", str(tmp_path / "o"),
                           "--resume", str(tmp_path / "r.json")]) == 2
    assert "not a benchmark results file with its trials (no 'trials' list)" in capsys.readouterr().err
    assert benchmark.main(["run", "--spec", str(tmp_path / "s.toml"), "--out", str(tmp_path / "o"),
                           "--nodes", "3"]) == 2
    assert capsys.readouterr().err.strip() == "benchmark: --nodes 3: not in the spec; it has 2"
    # a missing cost file for --estimate: one line, no traceback
    assert benchmark.main(["plan", "--spec", str(tmp_path / "s.toml"), "--estimate", str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("benchmark: ") and "none.json: cannot read it" in err and "\n" not in err


def test_the_readme_verdict_table_is_rendered_from_the_results(bench):
    """experiments/render.py's benchmark_verdict (the README's headline: the MNIST-1D part
    at 4 and 16 nodes), then the GPT part and the 64-node part, each its own results file:
    one row per workload, node count and bandwidth. The retired full run has no table."""
    from experiments import render
    from gossip.tools import leaderboard

    _, out, _ = bench
    assert "benchmark_verdict_full" not in render.TABLES
    for key in ("benchmark_verdict", "benchmark_verdict_gpt", "benchmark_verdict_n64"):
        t = render.TABLES[key]
        assert t.path == t.results and (render.REPO / t.results).exists()
        assert t.render is render._benchmark_verdict
    assert "README.md" in render.used_tables()["benchmark_verdict"]  # the front page's one headline table
    for key in ("benchmark_verdict", "benchmark_verdict_gpt", "benchmark_verdict_n64"):
        assert "docs/findings.md" in render.used_tables()[key]
    res = json.loads((out / "benchmark.json").read_text())["results"]
    table = render._benchmark_verdict(res)
    assert table.startswith("Each method tuned on the same budget (2 learning rates, selection on a validation "
                            "carve), then 1 seeds; 2 methods; blobs: mlp on synthetic, nodes 2")
    rows = [r for r in table.splitlines() if r.startswith("| blobs")]
    assert [r.split(" | ")[2] for r in rows] == ["10mbit", "1gbit"]
    v = res["workloads"]["blobs"]["nodes"]["2"]["verdicts"]["10mbit@0"]
    cell = rows[0].split(" | ")[3]
    assert cell.startswith(f"**{v['winner']}**") if v["winner"] else cell == "none reached it"
    assert leaderboard.fmt_metric("test_bpb", 2.5) == "2.500 bpb" and leaderboard.fmt_metric("test_acc", 0.9) == "90.00%"


def test_a_run_made_without_git_is_stamped_with_its_commit(bench, tmp_path, capsys):
    """Run on a copy of the tree (no git checkout there), the results record no commit;
    ``stamp`` fills it and the sources' ids in from this checkout, once."""
    from experiments import _provenance as P

    _, out, _ = bench
    whole = json.loads((out / "benchmark.json").read_text())
    whole["provenance"].update(commit=None, dirty=None, source_ids={s: None for s in benchmark.SOURCES})
    (tmp_path / "r.json").write_text(json.dumps(whole))
    head = P.git_commit()[0]
    assert benchmark.main(["stamp", "--results", str(tmp_path / "r.json"), "--commit", "HEAD"]) == 0
    prov = json.loads((tmp_path / "r.json").read_text())["provenance"]
    assert prov["commit"] == head and prov["source_ids"] == P.source_ids(benchmark.SOURCES) and "stamped" in prov
    assert benchmark.main(["stamp", "--results", str(tmp_path / "r.json"), "--commit", "HEAD"]) == 2
    assert "stamp: the results already record commit" in capsys.readouterr().err


def test_trials_on_different_data_are_flagged(lm_bench):
    """Resumed sessions whose machines served different data (another Python's standard
    library as the text corpus) do not compare: the results say so."""
    tmp, _ = lm_bench
    whole = json.loads((tmp / "results.json").read_text())
    trials = whole["results"]["trials"]
    assert benchmark.analyse(benchmark.load_spec(tmp / "spec.toml"), trials)["warnings"] == []
    odd = [dict(trials[0], data=dict(trials[0]["data"], eval_digest="0" * 16)), *trials[1:]]  # one tuning trial
    warn = benchmark.analyse(benchmark.load_spec(tmp / "spec.toml"), odd)["warnings"]
    assert warn == ["the trials of synthtext_n96_c16_val evaluated on 2 different data sets (sessions on machines "
                    "with different data, e.g. another Python's standard library as the text corpus): their figures "
                    "do not compare"]


def test_verdicts_over_part_of_the_field_say_how_much_of_it(bench):
    """While some methods' final runs are still to run, the verdict tables (the report's
    and the README's) give the node count with the part of the field they rank."""
    from experiments import render
    from gossip.tools import leaderboard

    tmp, out, _ = bench
    spec = benchmark.load_spec(tmp / "spec.toml")
    trials = json.loads((out / "benchmark.json").read_text())["results"]["trials"]
    whole = benchmark.analyse(spec, trials)["workloads"]["blobs"]["nodes"]["2"]
    assert whole["field"] == {"planned": ["allreduce", "localsgd"], "complete": ["allreduce", "localsgd"]}
    assert leaderboard.field_label("2", whole) == "2"
    part = benchmark.analyse(spec, [t for t in trials if not (t["stage"] == "final" and "localsgd" in t["key"])])
    nd = part["workloads"]["blobs"]["nodes"]["2"]
    assert nd["field"]["complete"] == ["allreduce"] and "localsgd" in nd["methods"]  # tuned, not yet final
    assert leaderboard.field_label("2", nd) == "2 (1 of 2 methods)"
    assert "| blobs | 2 (1 of 2 methods) | 10mbit@0 |" in benchmark.verdict_table(part)
    part.update(protocol={"lr_factors": [0.5, 1.0], "seeds": [0]}, spec=spec.raw)
    readme = render._benchmark_verdict(part)
    assert "blobs at 2 nodes: 1 of 2 methods have all their final runs (allreduce)" in readme
    assert "| blobs (40.00%) | 2 (1 of 2 methods) | 10mbit |" in readme
    # every run finished, one method's final seed diverged: not "still to run", named as failed
    full = benchmark.analyse(spec, trials)
    full["workloads"]["blobs"]["nodes"]["2"]["methods"]["localsgd"]["seeds_failed"] = [0]
    full.update(protocol={"lr_factors": [0.5, 1.0], "seeds": [0]}, spec=spec.raw)
    readme = render._benchmark_verdict(full)
    assert "Incomplete" not in readme and "still to run" not in readme
    assert "a final run that failed, so without a full set of seeds: localsgd at 2 nodes (1 of 1 final seeds failed)" \
        in readme


def test_a_results_file_of_part_of_the_spec_does_not_count_the_rest_as_missing(bench):
    """A results file run with --workloads/--nodes holds part of the spec: the README's
    header names the parts it holds and gives its trials without counting them against
    the whole spec's plan as if the rest were missing."""
    from experiments import render

    _, out, _ = bench
    res = json.loads((out / "benchmark.json").read_text())["results"]
    cov = res["coverage"]
    whole = render._benchmark_verdict(res)
    assert f"; {cov['finished']} of {cov['planned']} planned trials finished, " in whole
    res["spec"]["workloads"]["blobs"]["nodes"].append(64)  # the spec plans a node count this file lacks
    part = render._benchmark_verdict(res)
    assert "planned trials finished" not in part
    assert (f"blobs: mlp on synthetic, nodes 2; {cov['finished']} trials finished, " in part
            and f"(this file holds part of the spec, whose whole run plans {cov['planned']} trials)." in part)


def test_straggler_settings_have_their_own_verdicts(bench):
    """A spec's stragglers: each setting's verdicts come from the same trials, every point's
    compute time times the setting's slowest multiplier; the report has a table for each."""
    import dataclasses

    from gossip.tools import crossover

    tmp, out, _ = bench
    spec = benchmark.load_spec(tmp / "spec.toml")
    slow = dataclasses.replace(spec, stragglers=("slow:nodes=1,factor=4",))
    trials = json.loads((out / "benchmark.json").read_text())["results"]["trials"]
    plain, res = benchmark.analyse(spec, trials), benchmark.analyse(slow, trials)
    nd, pd = res["workloads"]["blobs"]["nodes"]["2"], plain["workloads"]["blobs"]["nodes"]["2"]
    assert "stragglers" not in pd and pd["verdicts"] == nd["verdicts"]
    st = nd["stragglers"]["slow:nodes=1,factor=4"]
    assert st["slowest"] == 4.0
    by_key = {t["key"]: t for t in trials}
    for name, m in nd["methods"].items():
        for key, link in m["links"].items():
            if not link["all_reached"]:
                continue
            bw, lat = (crossover.parse_rate(key.split("@")[0]), crossover.parse_time(key.split("@")[1]))
            res_ = by_key[next(iter(m["seeds"].values()))["trial"]]["result"]
            point = next(p for p in benchmark._points(res_) if p["metric"] >= plain["workloads"]["blobs"]["target"])
            slower = st["methods"][name]["links"][key]["time_s"]["mean"]
            assert slower == pytest.approx(link["time_s"]["mean"] + 3 * point["compute_s"])
    res.update(protocol=plain["protocol"])
    table = benchmark.straggler_tables(res)
    assert table.startswith("### Node speeds slow:nodes=1,factor=4") and "| blobs | 2 | 4x |" in table
    # a results file of before the stragglers, scored again with them: the same verdicts
    # as a run of the spec that had them, and the report's table for each setting
    rescored = benchmark.rescore({**plain, "trials": trials}, stragglers=slow.stragglers)
    assert rescored["workloads"]["blobs"]["nodes"]["2"]["stragglers"] == nd["stragglers"]
    assert "stragglers" not in benchmark.rescore({**plain, "trials": trials})["workloads"]["blobs"]["nodes"]["2"]
    page = tmp / "page.md"
    assert benchmark.main(["report", "--results", str(out / "benchmark.json"), "--md", str(page),
                 "--stragglers-from", str(tmp / "slow.toml")]) == 2  # no such spec: one line, nothing written
    assert not page.exists()
    (tmp / "slow.toml").write_text((tmp / "spec.toml").read_text().replace(
        "seeds =", 'stragglers = ["slow:nodes=1,factor=4"]\nseeds =', 1))
    assert benchmark.main(["report", "--results", str(out / "benchmark.json"), "--md", str(page),
                 "--stragglers-from", str(tmp / "slow.toml")]) == 0
    assert "### Node speeds slow:nodes=1,factor=4" in page.read_text()
    bad = tmp / "bad.toml"
    bad.write_text((tmp / "spec.toml").read_text().replace("seeds =", 'stragglers = ["slow:nodes=0,factor=2"]\nseeds =', 1))
    with pytest.raises(benchmark.SpecError, match="stragglers\\[0\\]: --node-speed slow: nodes=0"):
        benchmark.load_spec(bad)
