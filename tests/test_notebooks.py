"""The notebooks run top to bottom against the small runs of tests/conftest.py.

Each notebook is executed by nbclient in a fresh kernel. The kernel is the interpreter
running the tests: the test writes a ``python3`` kernelspec whose argv starts with
``sys.executable`` into a temporary directory and puts it first on ``JUPYTER_PATH``,
so neither a user's nor the system's kernelspecs can send the notebooks to another
Python.
"""

from __future__ import annotations

import argparse
import json
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from tests.conftest import REPO  # noqa: E402

NOTEBOOKS = REPO / "notebooks"


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    spec = tmp_path / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (tests)",
        "language": "python",
    }))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend shows the figures
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("GOSSIP_SWEEP", raising=False)
    return monkeypatch


def execute(name: str) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=120, shutdown_kernel="immediate",
        resources={"metadata": {"path": str(REPO)}},
    )
    client.execute()
    return nb


def text_of(nb) -> str:
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            out.append(o.get("text", ""))
            out.append(o.get("data", {}).get("text/plain", ""))
    return "\n".join(out)


def images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))


def test_convergence_notebook(small_runs, kernel_env):
    runs = small_runs
    kernel_env.setenv("GOSSIP_RUNS", str(runs))
    nb = execute("convergence.ipynb")
    text = text_of(nb)
    assert f"3 run(s) under {runs}" in text
    for label in ("dpsgd/fp32/ring", "ecd/quant:bits=8/ring", "allreduce/fp32/-"):
        assert label in text
    assert f"no race results under {runs}" in text
    assert images(nb) >= 4


def test_convergence_notebook_reads_a_race(kernel_env, tmp_path):
    from experiments import race
    runs = tmp_path / "runs"
    assert race.main(["--methods", "allreduce,localsgd", "--nodes", "2", "--epochs", "1", "--data", "synthetic",
                      "--target", "0", "--bandwidth", "10mbit,100mbit", "--out", str(runs / "race")]) == 0
    # a netns race's race.json (its runs need root: the record is made from the run above)
    a = argparse.Namespace(target=0.0, nodes=2, epochs=1, data="synthetic", to_end=False)
    rec = race.netns_record(runs / "race" / "allreduce", 1e7, 0.0, ok=True, stopped=True,
                            date="2026-01-01 00:00:00 UTC", load=[1.0, 2.0], wall=1.0)
    race.write_netns(runs / "race-netns", {"allreduce": {"runs": {"10mbit": rec}}}, a, ["10mbit"], "race",
                     ["allreduce"])
    # a language model's race, to held-out bits per byte (a tiny GPT on a few KB of text)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1  # Grüße\n" * 150, encoding="utf-8")
    flags = (f"--data-dir {corpus} --model-opt layers=1 --model-opt width=16 --model-opt heads=2 "
             "--data-opt context=16 --batch-size 8 --lr 0.5")
    assert race.main(["--methods", "allreduce", "--nodes", "2", "--epochs", "1", "--data", "text", "--model", "gpt",
                      "--train-flags", flags, "--target", "7.5", "--out", str(runs / "race-lm")]) == 0
    kernel_env.setenv("GOSSIP_RUNS", str(runs))
    nb = execute("convergence.ipynb")
    text = text_of(nb)
    # the race's run directories are ordinary runs, and its race.json gives the table and the panels
    assert f"3 run(s) under {runs}" in text
    assert f"race {runs / 'race-lm' / 'race.json'}: simulated-time, 2 nodes, 1 method(s), target 7.5 bpb" in text
    # the runs of both tasks in one table: accuracy for the classifiers, bits per byte for the GPT
    assert "final_test_acc" in text and "final_test_bpb" in text and "final_test_ppl" in text
    assert f"race {runs / 'race' / 'race.json'}: simulated-time, 2 nodes, 2 method(s), target 0%" in text
    assert "time_to_target_s@10mbit" in text and "localsgd" in text
    assert f"race {runs / 'race-netns' / 'race.json'}: netns, 2 nodes, 1 method(s), target 0%" in text
    assert "modelled_s" in text and "model_error" in text
    assert "no race results" not in text
    assert images(nb) >= 7


def test_decentralized_notebook_reads_a_comparison(kernel_env, tmp_path):
    """The study experiments/studies/gossip_compare.toml at a tiny size (synthetic data, one
    epoch of 8 nodes), then the notebook on its run directories and compare.json."""
    from experiments import study
    runs = tmp_path / "runs"
    out = runs / "cmp"
    assert study.main(["--epochs", "1", "--data", "synthetic", "--out", str(out),
                       "--results", str(tmp_path / "gossip_compare.json")], name="gossip_compare") == 0
    # --results: compare.json again, from which docs/decentralized.md renders compare.md's table
    from experiments import _provenance, render

    whole, prov = _provenance.read(tmp_path / "gossip_compare.json")
    assert whole == {k: v for k, v in json.loads((out / "compare.json").read_text()).items() if k != "provenance"}
    assert "experiments/studies/gossip_compare.toml" in prov["sources"]
    assert " -m experiments run gossip_compare --epochs 1 " in prov["command"]
    assert prov["command"].endswith("--results OUT/gossip_compare.json")
    assert render.TABLES["gossip_compare"].render(whole) in (out / "compare.md").read_text()
    res = json.loads((out / "compare.json").read_text())["results"]
    assert list(res) == ["dpsgd", "dcd:8", "ecd:8", "choco-sign", "choco-top1", "sgp"]
    per_step = {m: r["bytes_per_step"] for m, r in res.items()}
    assert per_step["choco-top1"] < per_step["choco-sign"] < per_step["dcd:8"] == per_step["ecd:8"] < per_step["dpsgd"]
    assert 0.45 < per_step["sgp"] / per_step["dpsgd"] < 0.55  # one message per step on onepeer-exp, two on the ring
    assert res["dpsgd"]["setup_bytes"] == 0 < res["choco-top1"]["setup_bytes"] == res["dcd:8"]["setup_bytes"]
    p = res["choco-top1"]["points"][-1]  # latency 0: compute + codec + 1.05 * 8 * bytes / 10 Mbit/s
    assert p["time_s"][0] == pytest.approx(p["compute_s"] + p["codec_s"] + 1.05 * 8 * p["bytes"] / 1e7)
    assert "| choco-top1 | ring | topk:p=0.01 |" in (out / "compare.md").read_text()
    kernel_env.setenv("GOSSIP_RUNS", str(runs))
    nb = execute("decentralized.ipynb")
    text = text_of(nb)
    assert f"comparison {out / 'compare.json'}: simulated-time, 8 nodes, sorted shards, 1 epoch(s), 6 method(s)" in text
    assert f"6 run(s) under {out}" in text
    for label in ("choco/topk:p=0.01/ring", "dcd/quant:bits=8/ring", "sgp/fp32/onepeer-exp", "time_s@10mbit"):
        assert label in text, label
    assert "no comparison" not in text and images(nb) == 1


def test_decentralized_notebook_without_a_comparison_says_so(kernel_env, tmp_path):
    kernel_env.setenv("GOSSIP_RUNS", str(tmp_path))
    nb = execute("decentralized.ipynb")
    assert f"no comparison under {tmp_path}" in text_of(nb) and images(nb) == 0


def test_topologies_notebook(kernel_env, tmp_path):
    kernel_env.setenv("GOSSIP_RUNS", str(tmp_path))
    nb = execute("topologies.ipynb")
    text = text_of(nb)
    assert text.count("measured <= rho^t at every step: True") == 3
    assert images(nb) == 2


def test_network_notebook_without_results_says_so(kernel_env, small_runs):
    runs = small_runs
    kernel_env.setenv("GOSSIP_RUNS", str(runs))
    nb = execute("network.ipynb")
    assert f"no sweep results under {runs}" in text_of(nb)
    assert images(nb) == 0


def test_network_notebook_with_results(kernel_env, tmp_path, sweep_rows):
    sweep = tmp_path / "runs" / "netsweep"
    sweep.mkdir(parents=True)
    (sweep / "results.json").write_text(json.dumps({"meta": {}, "rows": sweep_rows}))
    kernel_env.setenv("GOSSIP_RUNS", str(tmp_path / "runs"))
    nb = execute("network.ipynb")
    text = text_of(nb)
    assert f"sweep results: {sweep} (27 rows, 26 measured)" in text
    assert "time_vs_allreduce" in text and images(nb) == 1


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebooks_are_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: clear the outputs"
    assert nb.metadata.kernelspec.name == "python3"
