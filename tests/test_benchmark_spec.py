"""The benchmark's spec is checked whole before the first trial: every bad field is
refused in one line naming the file and the field, exit 2, nothing run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
from experiments import benchmark

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
[methods.signum]
flags = ["--algo", "signum"]
lr = 0.05
max_nodes = 16
[links]
bandwidth = ["10mbit", "1gbit"]
latency = ["0", "10ms"]
"""


def _refused(tmp_path: Path, capsys, old: str, new: str) -> str:
    """``run`` on SPEC with ``old`` replaced by ``new``: exit 2, one line naming the file,
    no run directory made; the line less ``benchmark: FILE: ``."""
    assert SPEC.count(old) == 1
    spec, out = tmp_path / "spec.toml", tmp_path / "out"
    spec.write_text(SPEC.replace(old, new))
    capsys.readouterr()
    assert benchmark.main(["run", "--spec", str(spec), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"benchmark: {spec}: "), err
    assert not out.exists()  # nothing ran
    return err.removeprefix(f"benchmark: {spec}: ")


def test_an_unknown_method_is_refused(tmp_path, capsys):
    err = _refused(tmp_path, capsys, '"--algo", "signum"', '"--algo", "nope"')
    assert err.startswith("methods.signum.flags: --algo 'nope' is not an algorithm of gossip.train; accepted: ")


def test_a_method_without_an_algorithm_is_refused(tmp_path, capsys):
    err = _refused(tmp_path, capsys, '["--algo", "signum"]', '["--bits", "8"]')
    assert err.startswith("methods.signum.flags: no --algo")


def test_an_unknown_model_is_refused(tmp_path, capsys):
    err = _refused(tmp_path, capsys, 'model = "mlp"', 'model = "nope"')
    assert err.startswith("workloads.blobs.model: 'nope' is not a model of gossip.train; accepted: cnn1d")


def test_a_negative_seed_is_refused(tmp_path, capsys):
    assert _refused(tmp_path, capsys, "seeds = [0]", "seeds = [1, -1]").startswith("seeds[1]: -1 is out of range")


def test_a_text_seed_is_refused(tmp_path, capsys):
    assert _refused(tmp_path, capsys, "seeds = [0]", 'seeds = ["a"]').startswith("seeds[0]: 'a' is not an integer")


def test_a_scalar_seeds_is_refused(tmp_path, capsys):
    assert _refused(tmp_path, capsys, "seeds = [0]", "seeds = 0").startswith("seeds: 0 is not a list")


def test_a_batch_larger_than_a_nodes_samples_is_refused(tmp_path, capsys):
    # 48 per node at 2 nodes: 96, less the 10 % validation carve (10): 43 a node in a tuning trial
    err = _refused(tmp_path, capsys, "batch_size = 16", "batch_size = 44")
    assert err.startswith("workloads.blobs.batch_size: 44 is more than the 43 training samples of each node in a "
                          "tuning trial at 2 nodes")


def test_an_empty_bandwidth_list_is_refused(tmp_path, capsys):
    err = _refused(tmp_path, capsys, 'bandwidth = ["10mbit", "1gbit"]', "bandwidth = []")
    assert err.startswith("links.bandwidth: is empty")


def test_a_method_may_not_set_the_epochs(tmp_path, capsys):
    err = _refused(tmp_path, capsys, '"--algo", "signum"', '"--algo", "signum", "--epochs", "100"')
    assert err.startswith("methods.signum.flags: --epochs sets the workload's budget")


def test_a_method_may_not_set_the_epochs_abbreviated(tmp_path, capsys):
    err = _refused(tmp_path, capsys, '"--algo", "signum"', '"--algo", "signum", "--epoch=100"')
    assert err.startswith("methods.signum.flags: --epoch (read as --epochs) sets the workload's budget")


def test_a_method_may_not_set_the_batch_size(tmp_path, capsys):
    err = _refused(tmp_path, capsys, '"--algo", "signum"', '"--batch-size", "64", "--algo", "signum"')
    assert err.startswith("methods.signum.flags: --batch-size sets the workload's budget")


def test_a_method_may_not_set_the_max_steps(tmp_path, capsys):
    err = _refused(tmp_path, capsys, '"--algo", "signum"', '"--algo", "signum", "--max-steps", "5"')
    assert err.startswith("methods.signum.flags: --max-steps sets the workload's budget")


@pytest.mark.parametrize("flags, needle", [
    (["--simulate", "8"], "--simulate sets the workload's budget (workloads.NAME.nodes)"),
    (["--lr", "1"], "--lr is the tuning's"),
    (["--seed", "3"], "--seed is the protocol's"),
    (["--config", "x.toml"], "--config reads a file that may set any flag"),
])
def test_a_method_may_not_set_what_the_protocol_sets(tmp_path, capsys, flags, needle):
    err = _refused(tmp_path, capsys, '"--algo", "signum"', ", ".join(json.dumps(f) for f in ["--algo", "signum", *flags]))
    assert err.startswith(f"methods.signum.flags: {needle}")


def test_a_text_lr_factor_is_refused(tmp_path, capsys):
    err = _refused(tmp_path, capsys, "lr_factors = [0.5, 1.0]", 'lr_factors = [0.5, "a"]')
    assert err.startswith("lr_factors[1]: 'a' is not a finite number")


def test_a_text_max_nodes_is_refused(tmp_path, capsys):
    err = _refused(tmp_path, capsys, "max_nodes = 16", 'max_nodes = "16"')
    assert err.startswith("methods.signum.max_nodes: '16' is not an integer")


@pytest.mark.parametrize("rate", ["100MB", "100M", "100mb"])
def test_a_rate_that_does_not_say_bits_or_bytes_is_refused(tmp_path, capsys, rate):
    err = _refused(tmp_path, capsys, '"10mbit", "1gbit"', f'"10mbit", "{rate}"')
    assert err.startswith(f"links.bandwidth[1]: '{rate}': ") and "does not say bits or bytes: write 100mbit" in err


def test_a_rate_in_bytes_is_read_as_tc_reads_it():
    """tc reads mbps as megabytes per second: 100mbps is 800 Mbit/s, modelled as such."""
    spec = benchmark.Spec(workloads=(), methods=(), bandwidths=("100mbps",), latencies=("0",))
    res = benchmark.analyse(spec, [])
    assert res["links"] == ["100mbps@0"]
    from gossip.tools import crossover

    assert crossover.parse_rate("100mbps") == 8e8 and crossover.parse_rate("100mbit") == 1e8


def test_an_unknown_key_is_refused(tmp_path, capsys):
    err = _refused(tmp_path, capsys, "batch_size = 16", "batch_size = 16\nbatchsize = 64")
    assert err.startswith("workloads.blobs: unknown key 'batchsize'; accepted: data, model")


def test_a_flag_gossip_train_refuses_is_refused_before_any_trial(tmp_path, capsys):
    """What only gossip.train's own parser knows (a compressor's name) is caught before
    the first trial, naming the method."""
    err = _refused(tmp_path, capsys, '"--algo", "signum"', '"--algo", "ecd", "--compressor", "nope"')
    assert err.startswith("methods.signum.flags (workloads.blobs at 2 nodes): ") and "nope" in err


def test_the_report_of_results_without_links_is_a_page(tmp_path, capsys):
    """A results file written from a spec with no link (as an empty bandwidth list made
    before it was refused) is reported without a traceback."""
    wl = benchmark.Workload(name="blobs", data="synthetic", model="mlp", samples_per_node=48, epochs=2,
                            tune_epochs=1, batch_size=16, target=0.4, nodes=(2,))
    spec = benchmark.Spec(workloads=(wl,), methods=(benchmark.Method("allreduce", ("--algo", "allreduce"), 0.05),),
                          bandwidths=(), latencies=("0",))
    res = benchmark.analyse(spec, [])
    path = tmp_path / "benchmark.json"
    path.write_text(json.dumps({"results": res, "provenance": {}}))
    md = tmp_path / "docs" / "b.md"
    assert benchmark.main(["report", "--results", str(path), "--md", str(md)]) == 0
    assert "No link to model" in md.read_text()


# ----------------------------------------------------------------------------- guards
def test_the_committed_specs_pass(capsys):
    for name in ("benchmark.toml", "benchmark-pilot.toml", "benchmark-cost.toml"):
        assert benchmark.main(["plan", "--spec", str(REPO / "experiments" / name)]) == 0
    capsys.readouterr()


def test_the_names_match_gossips_registries():
    """bench_spec keeps torch-free copies of gossip.train's algorithms and models."""
    from experiments import bench_spec

    from gossip import algorithms, models

    assert bench_spec.ALGORITHMS == tuple(algorithms.available())
    assert bench_spec.MODELS == {m: models.model_task(m) for m in models.available_models()}


def test_a_spec_is_checked_without_torch(tmp_path):
    """The check that refuses a bad spec imports neither torch nor the training code."""
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.replace('"--algo", "signum"', '"--algo", "signum", "--epochs", "100"'))
    code = ("import runpy, sys\n"
            "sys.argv = sys.argv[1:]\n"
            "try:\n"
            "    runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"
            "except SystemExit as e:\n"
            "    print(e.code, 'torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code, "experiments.benchmark", "run", "--spec",
                        str(spec), "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.stdout.split() == ["2", "False"], r.stdout + r.stderr
    assert "--epochs sets the workload's budget" in r.stderr and len(r.stderr.strip().splitlines()) == 1
