"""``gossip.tools.analysis``: loading run directories and sweeps, curves, plots, errors.

The runs come from the real CLI (``gossip.train --simulate 3 --data synthetic``), made
once per test session by the ``small_runs`` fixture of tests/conftest.py (the notebook
tests use them too).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

import topologies  # noqa: E402
from gossip.tools import analysis as ga  # noqa: E402

from tests.conftest import SMALL_RUNS as RUNS  # noqa: E402

LABELS = {"gossip/dpsgd": "dpsgd/fp32/ring", "gossip/ecd8": "ecd/quant:bits=8/ring", "allreduce": "allreduce/fp32/-"}


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def copy_run(src: Path, dst: Path, **config) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.pt"))
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# --------------------------------------------------------------------------- loading
def test_load_run_reads_config_summary_and_every_rank(small_runs):
    run = ga.load_run(small_runs / "gossip" / "ecd8")
    assert run.name == "ecd8" and run.label == "ecd/quant:bits=8/ring" and run.complete
    assert run.config["algo"] == "ecd" and run.summary["bits"] == 8
    m = run.metrics
    train = m[m["kind"] == "train"]
    assert sorted(train["rank"].unique()) == [0, 1, 2]
    # evaluation records repeat in every rank's file: one per epoch is kept
    ev = m[m["kind"] == "eval"]
    assert list(ev["epoch"]) == [1.0, 2.0] and set(ev["rank"]) == {0}
    raw = [r for r in read_jsonl(small_runs / "gossip" / "ecd8" / "metrics-rank1.jsonl") if r["kind"] == "train"]
    mine = train[train["rank"] == 1].sort_values("step")
    assert list(mine["step"]) == [r["step"] for r in raw]
    assert np.allclose(mine["loss"], [r["loss"] for r in raw])


def test_load_runs_tables_and_labels(small_runs):
    runs, metrics = ga.load_runs(small_runs)
    assert list(runs["run"]) == ["allreduce", "gossip/dpsgd", "gossip/ecd8"]
    assert dict(zip(runs["run"], runs["label"])) == LABELS
    assert set(metrics["run"]) == set(RUNS) and set(metrics["label"]) == set(LABELS.values())
    for name in RUNS:
        summ = json.loads((small_runs / name / "summary.json").read_text())
        row = runs[runs["run"] == name].iloc[0]
        assert row["complete"] and row["epochs_done"] == 2.0
        for key in ("final_train_loss", "final_test_acc", "bytes_sent_per_node_per_step", "steps"):
            assert row[key] == pytest.approx(summ[key])
    assert pd.isna(runs.set_index("run").loc["allreduce", "topology"])
    table = ga.final_table(runs)
    assert list(table.index) == list(runs["label"]) and "final_test_acc" in table.columns
    # a run directory given directly is a table of one
    one, _ = ga.load_runs(small_runs / "allreduce")
    assert list(one["label"]) == ["allreduce/fp32/-"]


def test_train_curves_average_the_ranks(small_runs):
    _, metrics = ga.load_runs(small_runs)
    tc = ga.train_curves(metrics)
    d = tc[tc["run"] == "gossip/dpsgd"].set_index("step")
    ranks = [read_jsonl(small_runs / "gossip" / "dpsgd" / f"metrics-rank{k}.jsonl") for k in range(3)]
    for step in d.index:
        recs = [next(r for r in rk if r["kind"] == "train" and r["step"] == step) for rk in ranks]
        assert d.loc[step, "loss"] == pytest.approx(np.mean([r["loss"] for r in recs]))
        assert d.loc[step, "bytes_sent"] == pytest.approx(np.mean([r["bytes_sent"] for r in recs]))
    assert not tc.duplicated(["run", "step"]).any()
    ev = ga.eval_curves(metrics)
    assert len(ev) == 6 and ev["bytes_sent"].notna().all()


def test_shared_labels_get_the_config_keys_that_differ(small_runs, tmp_path):
    src = small_runs / "gossip" / "dpsgd"
    copy_run(src, tmp_path / "a")
    copy_run(src, tmp_path / "b", world_size=16, lr=0.1)
    copy_run(src, tmp_path / "c", partition="sorted")
    copy_run(src, tmp_path / "d", partition="sorted")  # an exact repeat of c
    runs, metrics = ga.load_runs(tmp_path)
    labels = dict(zip(runs["run"], runs["label"]))
    assert labels["a"] == "dpsgd/fp32/ring n=3 partition=iid"
    assert labels["b"] == "dpsgd/fp32/ring n=16 partition=iid"
    assert labels["c"] == "dpsgd/fp32/ring n=3 partition=sorted [c]"
    assert labels["d"] == "dpsgd/fp32/ring n=3 partition=sorted [d]"
    assert set(metrics["label"]) == set(labels.values())


def test_runs_that_differ_in_algorithm_options_are_labelled_by_them(small_runs, tmp_path):
    src = small_runs / "gossip" / "dpsgd"
    copy_run(src, tmp_path / "a", algo_options={"gamma": 0.5})
    copy_run(src, tmp_path / "b", algo_options={"gamma": 0.1, "start": "zero"})
    copy_run(src, tmp_path / "c")
    runs, _ = ga.load_runs(tmp_path)
    labels = dict(zip(runs["run"], runs["label"]))
    assert labels == {"a": "dpsgd/fp32/ring gamma=0.5", "b": "dpsgd/fp32/ring gamma=0.1,start=zero",
                      "c": "dpsgd/fp32/ring defaults"}


def test_an_unfinished_run_loads_from_its_records(small_runs, tmp_path):
    run = copy_run(small_runs / "gossip" / "ecd8", tmp_path / "live")
    (run / "summary.json").unlink()
    for k in range(3):  # drop epoch 2 and leave a torn line, as a run being written does
        f = run / f"metrics-rank{k}.jsonl"
        keep = [line for line in f.read_text().splitlines() if json.loads(line)["step"] <= 10]
        f.write_text("\n".join(keep) + '\n{"kind": "train", "st')
    runs, metrics = ga.load_runs(tmp_path)
    row = runs.iloc[0]
    assert not row["complete"] and row["steps"] == 10 and row["epochs_done"] == 1.0
    first_eval = next(r for r in read_jsonl(small_runs / "gossip" / "ecd8" / "metrics-rank0.jsonl") if r["kind"] == "eval")
    assert row["final_test_acc"] == pytest.approx(first_eval["test_acc"])
    assert row["final_train_loss"] == pytest.approx(first_eval["train_loss"])


def test_a_run_stopped_before_its_first_evaluation(small_runs, tmp_path):
    run = copy_run(small_runs / "gossip" / "ecd8", tmp_path / "blewup")
    (run / "summary.json").unlink()
    for k in range(3):  # a run that died in its first epoch (e.g. parameters became non-finite)
        f = run / f"metrics-rank{k}.jsonl"
        f.write_text("".join(line + "\n" for line in f.read_text().splitlines() if json.loads(line)["step"] <= 4
                             and json.loads(line)["kind"] == "train"))
    loaded = ga.load_run(run)
    ev = ga.eval_curves(loaded)
    assert ev.empty and {"run", "label", "step", "epoch"} <= set(ev.columns)
    runs, metrics = ga.load_runs(tmp_path)
    assert runs.iloc[0]["steps"] == 4 and pd.isna(runs.iloc[0]["final_test_acc"])
    assert len(ga.plot_train_loss(metrics).get_lines()) == 1
    assert ga.plot_test_accuracy(metrics).get_lines() == [] and ga.plot_consensus(metrics).get_lines() == []


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p: p / "missing", r"missing: no such directory"),
        (lambda p: (p / "f.txt").write_text("x") and p / "f.txt", r"not a run directory \(it is a file\)"),
        (lambda p: p, r"not a run directory \(no config\.json\)"),
        (lambda p: (p / "config.json").write_text("{}") and p, r"config\.json but no metrics-rank<k>\.jsonl"),
    ],
)
def test_load_run_refuses_what_is_not_a_run(tmp_path, make, match):
    with pytest.raises(ga.AnalysisError, match=match) as e:
        ga.load_run(make(tmp_path))
    assert "\n" not in str(e.value)


def test_damaged_config_and_empty_directories(small_runs, tmp_path):
    run = copy_run(small_runs / "allreduce", tmp_path / "bad")
    (run / "config.json").write_text("{not json")
    with pytest.raises(ga.AnalysisError, match=r"config\.json is not valid JSON"):
        ga.load_run(run)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ga.AnalysisError, match=r"empty: no run directories found"):
        ga.load_runs(tmp_path / "empty")
    with pytest.raises(ga.AnalysisError, match=r"no such directory"):
        ga.load_runs(tmp_path / "nowhere")


# --------------------------------------------------------------------------- plots
def _lines(ax) -> list[str]:
    return [line.get_label() for line in ax.get_lines()]


@pytest.mark.parametrize("x", ["epoch", "step", "time", "bytes"])
def test_plot_train_loss_draws_one_line_per_run(small_runs, x):
    _, metrics = ga.load_runs(small_runs)
    ax = ga.plot_train_loss(metrics, x=x)
    assert sorted(_lines(ax)) == sorted(LABELS.values())
    assert ax.get_yscale() == "log" and ax.get_xscale() == ("log" if x == "bytes" else "linear")


def test_plot_accuracy_consensus_and_convergence(small_runs):
    runs = ga.load_runs(small_runs)
    assert sorted(_lines(ga.plot_test_accuracy(runs))) == sorted(LABELS.values())
    ax = ga.plot_consensus(runs.metrics)  # all-reduce's distance is 0: not on a log scale
    assert sorted(_lines(ax)) == ["dpsgd/fp32/ring", "ecd/quant:bits=8/ring"] and "all-reduce" in ax.get_title()
    relabelled = runs.metrics.assign(label=runs.metrics["run"])  # found by its distance: rounding error only
    assert sorted(_lines(ga.plot_consensus(relabelled))) == ["gossip/dpsgd", "gossip/ecd8"]
    fig = ga.plot_convergence(runs.metrics)
    assert len(fig.axes) == 6 and all(ax.get_lines() for ax in fig.axes)
    with pytest.raises(ga.AnalysisError, match=r"x must be one of epoch, step, time, bytes, got 'wall'"):
        ga.plot_train_loss(runs.metrics, x="wall")


# --------------------------------------------------------------------------- topologies
def test_spectral_gaps_match_the_closed_forms():
    gaps = ga.spectral_gaps([9, 14, 16], ("ring", "torus", "expander"), expander={"degree": 4, "seed": 0})
    ring = gaps[gaps["topology"] == "ring"].set_index("n")
    for n in (9, 14, 16):
        assert ring.loc[n, "lambda2"] == pytest.approx((1 + 2 * math.cos(2 * math.pi / n)) / 3)
    torus = gaps[gaps["topology"] == "torus"].set_index("n")
    assert list(torus.index) == [9, 16]  # 14 has no torus: left out
    assert torus.loc[16, "lambda2"] == pytest.approx((3 + 2 * math.cos(2 * math.pi / 4)) / 5)
    assert (gaps["spectral_gap"] == 1 - gaps["rho"]).all()
    ax = ga.plot_spectral_gaps(gaps)
    assert _lines(ax) == ["ring", "torus", "expander"]


@pytest.mark.parametrize("name", ["ring", "torus", "expander"])
def test_consensus_contraction_stays_under_rho_t(name):
    topo = topologies.build(name, 36)
    c = ga.consensus_contraction(topo, steps=120, seed=1)
    assert c["measured"].iloc[0] == 1.0
    assert (c["measured"] <= c["rho_t"] * (1 + 1e-9) + 1e-13).all()
    late = c[(c["measured"] > 1e-9)].iloc[-20:]["measured"].to_numpy()  # the slowest mode's rate
    assert np.exp(np.mean(np.diff(np.log(late)))) == pytest.approx(topo.rho, rel=0.02)
    with pytest.raises(ga.AnalysisError, match="steps must be a positive integer, got 0"):
        ga.consensus_contraction(topo, steps=0)


# --------------------------------------------------------------------------- sweeps
def test_load_and_plot_a_sweep(tmp_path, sweep_rows):
    rows = sweep_rows
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "results.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    (tmp_path / "c").mkdir()
    pd.DataFrame(rows).to_csv(tmp_path / "c" / "results.csv", index=False)
    assert ga.find_sweeps(tmp_path) == [tmp_path / "c", tmp_path / "j"]
    js, cs = ga.load_sweep(tmp_path / "j"), ga.load_sweep(tmp_path / "c" / "results.csv")
    assert len(js) == len(cs) == 27 and js["ok"].sum() == cs["ok"].sum() == 26
    assert cs["ok"].dtype == bool
    fig = ga.plot_sweep(cs)
    assert len(fig.axes) == 4
    assert sorted(_lines(fig.axes[0])) == ["D-PSGD (32 bits)", "ECD (8 bits)", "all-reduce (32 bits)"]
    # panel (d): latency at 5 Mbit/s, where the ECD cell at 20 ms failed and is left out
    ecd = next(line for line in fig.axes[3].get_lines() if line.get_label() == "ECD (8 bits)")
    assert list(ecd.get_xdata()) == [0.13, 5.0]


def test_sweep_errors(tmp_path):
    with pytest.raises(ga.AnalysisError, match=r"no sweep results \(results\.json or results\.csv"):
        ga.load_sweep(tmp_path)
    (tmp_path / "results.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ga.AnalysisError, match=r"not sweep results \(missing column\(s\) algo, bandwidth_mbit"):
        ga.load_sweep(tmp_path)
    assert ga.find_sweeps(tmp_path / "nowhere") == []
