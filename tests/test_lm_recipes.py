"""The language-model experiments (experiments/studies/lm_recipes.toml, experiments/powersgd_lstm.py)
run end to end on a small text, write their figures with provenance, and render."""

from __future__ import annotations

import importlib
import json
import sys

import pytest

from experiments import _provenance as P
from experiments import render, study
from tests.conftest import REPO

TEXT = "def mean(xs):\n    return sum(xs) / len(xs)  # Grüße\n" * 600  # 31 KB: windows for 4 nodes x 8


def _script(name: str):
    return importlib.import_module(f"experiments.{name}")


@pytest.fixture
def corpus(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text(TEXT, encoding="utf-8")
    return f


def test_recipes_run_and_render(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "lm.json"
    assert study.main(["--runs", "lstm", "--steps", "2", "--data-dir", str(corpus),
                       "--out", str(tmp_path / "runs"), "--results", str(out)], name="lm_recipes") == 0
    res, prov = P.read(out)
    r = res["lstm"]
    assert r["exit"] == 0 and r["steps"] == 2 and r["reduced"] and 0.9e6 < r["params"] < 1e6
    assert 0 < r["final_test_bpb"] < 9 and r["command"].startswith("python -m gossip.train --simulate 4")
    # the thread count is in the command; torch's inductor may have put its cache folder in the
    # environment earlier in the process, which the command then names as PATH
    cmd = prov["command"]
    assert cmd.startswith("OMP_NUM_THREADS=1 ") and " python -m experiments run lm_recipes --runs lstm " in cmd
    assert "gossip/data" in prov["sources"]  # the text data sets (gossip/data/text.py)
    # the run directory named as the command names --out: no path of the machine it ran on
    assert " --out OUT/runs " in cmd and r["out"] == "OUT/runs/lstm"
    md = render.TABLES["lm_recipes"].render(res)
    assert md.startswith("| recipe | parameters | steps | held-out bits per byte |")
    assert f"| lstm | 0.94M | 2 | {r['final_test_bpb']:.3f} |" in md
    with pytest.raises(SystemExit):
        study.main(["--runs", "rnn", "--results", str(tmp_path / "x.json")], name="lm_recipes")
    assert not (tmp_path / "x.json").exists()


def test_table3_runs_sgd_and_powersgd_ranks_and_renders(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "t3.json"
    assert _script("powersgd_lstm").main(["--steps", "2", "--data-dir", str(corpus), "--jobs", "2",
                                          "--out", str(tmp_path / "runs"), "--json", str(out)]) == 0
    res, _ = P.read(out)
    runs = res["runs"]
    assert list(runs) == ["sgd", "powersgd:1", "powersgd:2", "powersgd:4"]
    assert [r["out"] for r in runs.values()] == [f"OUT/runs/{k}" for k in ("sgd", "powersgd-1", "powersgd-2", "powersgd-4")]
    sent = [runs[k]["bytes_sent_per_node_per_step"] for k in runs]
    # full precision sends far more than rank 4 > rank 2 > rank 1 (payloads grow with the rank)
    assert sent[0] > 20 * sent[3] and sent[3] > sent[2] > sent[1] > 0
    for r in runs.values():  # bytes per epoch = bytes per step x steps per epoch
        assert r["mb_per_epoch_per_node"] == pytest.approx(r["bytes_sent_per_node_per_step"] * r["steps_per_epoch"] / 1e6)
    c = res["checks"]
    assert c["rank1_minus_sgd_bpb"] == pytest.approx(runs["powersgd:1"]["final_test_bpb"] - runs["sgd"]["final_test_bpb"])
    md = render.TABLES["powersgd_lstm"].render(res)
    assert "| PowerSGD rank 4 |" in md and "| 91 | 64 MB |" in md and "Rank 1 − SGD: " in md
    assert "the paper: 309, 203, 121" in md
    with pytest.raises(SystemExit):
        _script("powersgd_lstm").main(["--jobs", "0", "--json", str(tmp_path / "x.json")])
