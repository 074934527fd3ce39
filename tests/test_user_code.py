"""The user's own model and data from the CLI: ``--model module:fn``, ``--data module:fn``.

The factories below are the user's code; the CLI imports them from this file.
"""

from __future__ import annotations

import json
import sys
import warnings

import pytest
import torch
from torch import nn

from tests.conftest import run_process


# ---------------------------------------------------------------------- the user's code
def blobs(seed: int):
    """Three Gaussian blobs in 6 dimensions: ((x_train, y_train), (x_test, y_test))."""
    g = torch.Generator().manual_seed(seed)
    centres = 3 * torch.randn(3, 6, generator=g)

    def draw(n):
        y = torch.randint(0, 3, (n,), generator=g)
        return centres[y] + torch.randn(n, 6, generator=g), y

    return draw(512), draw(256)


def blob_sets(seed: int):
    """The same blobs as two torch Datasets of (x, label) items."""
    (xtr, ytr), (xte, yte) = blobs(seed)
    return torch.utils.data.TensorDataset(xtr, ytr), torch.utils.data.TensorDataset(xte, yte)


class _Ragged(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        return torch.zeros(3 + i), i


def ragged_datasets(seed: int):
    return _Ragged(), _Ragged()


def small_net(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], 16), nn.Tanh(), nn.Linear(16, num_classes))


def wrong_width(input_shape, num_classes):
    return nn.Linear(input_shape[0] + 1, num_classes)


def not_a_model(input_shape, num_classes):
    return "a model"


def broken_data(seed):
    raise OSError("the disk is gone")


def three_tensors(seed):
    return torch.zeros(4, 2), torch.zeros(4), torch.zeros(4)


NOT_CALLABLE = 42


# ---------------------------------------------------------------------- the tests
def _train(tmp_path, *args):
    return run_process([sys.executable, "-m", "gossip.train", "--no-progress", *args], timeout=300, cwd=tmp_path)


def _main_in_process(tmp_path, capsys, monkeypatch, *args):
    """``python -m gossip.train --no-progress *args`` run in this process through the
    same entry point (:func:`gossip.train.main`): ``(exit code, what it wrote to stderr)``.
    Warnings the interpreter would show on stderr count as written there; torch's
    global generator is left as it was."""
    from gossip.train import main

    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as seen, torch.random.fork_rng(devices=[]):
        warnings.simplefilter("always")
        try:
            rc = main(["--no-progress", *args])
        except SystemExit as e:  # argparse's way out
            rc = e.code
    err = capsys.readouterr().err
    hidden = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)  # by default
    err += "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno)
                   for w in seen if not issubclass(w.category, hidden))
    return rc, err


HERE = "tests.test_user_code"

#: runs of the user's code by the real CLI, all in one child interpreter (torch imported once)
_OWN_RUNS = {
    "own": ["--simulate", "4", "--algo", "ecd", "--topology", "ring", "--data", f"{HERE}:blobs",
            "--model", f"{HERE}:small_net", "--epochs", "6", "--batch-size", "16", "--lr", "0.1"],
    "blobs": ["--simulate", "2", "--algo", "allreduce", "--data", f"{HERE}:blobs", "--model",
              f"{HERE}:small_net", "--max-steps", "5"],
    "blob_sets": ["--simulate", "2", "--algo", "allreduce", "--data", f"{HERE}:blob_sets", "--model",
                  f"{HERE}:small_net", "--max-steps", "5"],
    "built_in_model": ["--simulate", "2", "--algo", "allreduce", "--data", f"{HERE}:blobs", "--model", "mlp",
                       "--max-steps", "3"],
    # TensorBoard's scalars, read back below (the flag needs the optional package: the
    # runner skips this run where it is missing, and the test that reads it skips too)
    "tensorboard": ["--simulate", "4", "--algo", "ecd", "--data", "synthetic", "--epochs", "2", "--max-steps", "40",
                    "--log-every", "5", "--tensorboard"],
}

_MAKE_OWN_RUNS = """
import importlib.util, json, sys
from gossip.train import main
root = sys.argv[2]
for name, argv in json.loads(sys.argv[1]).items():
    if "--tensorboard" in argv and importlib.util.find_spec("tensorboard") is None:
        continue
    rc = main(["--no-progress", *argv, "--out", root + "/" + name])
    if rc:
        sys.exit(f"run {name}: exit {rc}")
"""


@pytest.fixture(scope="module")
def own_runs(tmp_path_factory):
    """The runs of :data:`_OWN_RUNS`, each ``gossip.train.main`` as ``python -m
    gossip.train`` calls it, one after the other in one child interpreter."""
    root = tmp_path_factory.mktemp("own-runs")
    r = run_process([sys.executable, "-c", _MAKE_OWN_RUNS, json.dumps(_OWN_RUNS), str(root)], timeout=300,
                    cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    return root


def test_own_model_and_data_train_and_are_recorded(own_runs):
    summary = json.loads((own_runs / "own" / "summary.json").read_text())
    assert summary["model"] == f"{HERE}:small_net" and summary["data"] == f"{HERE}:blobs"
    assert summary["params"] == 6 * 16 + 16 + 16 * 3 + 3
    assert summary["final_test_acc"] > 0.9  # well separated blobs


def test_own_torch_datasets(own_runs):
    """A pair of torch Datasets of (x, label) is read into memory: the same data, the
    same run as the tensor pair."""
    runs = [json.loads((own_runs / fn / "summary.json").read_text()) for fn in ("blobs", "blob_sets")]
    assert runs[1]["data"] == f"{HERE}:blob_sets"
    assert runs[0]["final_test_acc"] is not None and runs[0]["final_test_acc"] == runs[1]["final_test_acc"]
    assert runs[0]["final_test_loss"] == runs[1]["final_test_loss"]


def test_own_data_with_a_built_in_model(own_runs):
    summary = json.loads((own_runs / "built_in_model" / "summary.json").read_text())
    assert summary["model"] == "mlp" and summary["data"] == f"{HERE}:blobs"


# the first case runs the real CLI (its exit code and its whole stderr, as a user sees
# them); the others run its entry point in this process (seconds of torch import less each)
@pytest.mark.parametrize("args, needles", [
    (["--data", "no_such_module_xyz:make"], ["--data 'no_such_module_xyz:make'", "cannot import", "PYTHONPATH"]),
    (["--data", f"{HERE}:nothing_here"], ["has no 'nothing_here'", "fn(seed)"]),
    (["--data", f"{HERE}:NOT_CALLABLE"], ["not callable"]),
    (["--data", f"{HERE}:broken_data"], ["raised OSError: the disk is gone"]),
    (["--data", f"{HERE}:three_tensors"], ["returned a tuple of 3", "((x_train, y_train), (x_test, y_test))"]),
    (["--data", f"{HERE}:ragged_datasets"], ["the train set's items are not (x, label) pairs of one shape"]),
    (["--data", f"{HERE}:blobs", "--model", f"{HERE}:not_a_model"], ["returned a str", "torch.nn.Module"]),
    (["--data", f"{HERE}:blobs", "--model", f"{HERE}:wrong_width"], ["fails on inputs shaped (B, 6)"]),
    (["--data", "not a spec"], ["unknown --data 'not a spec'", "module.path:function"]),
    (["--model", "nope"], ["unknown --model 'nope'", "module.path:function"]),
])
def test_a_factory_that_cannot_be_used_is_one_line(tmp_path, capsys, monkeypatch, args, needles):
    argv = ["--simulate", "2", "--algo", "allreduce", "--max-steps", "1", *args, "--out", str(tmp_path / "run")]
    if args[1] == "no_such_module_xyz:make":
        r = _train(tmp_path, *argv)
        rc, err = r.returncode, r.stderr
    else:
        rc, err = _main_in_process(tmp_path, capsys, monkeypatch, *argv)
    assert rc == 2, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]
    assert not (tmp_path / "run").exists()  # nothing written


# ---------------------------------------------------------------------- TensorBoard
def test_tensorboard_scalars_read_back(own_runs):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = own_runs / "tensorboard"
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "traffic/bytes_sent_per_node", "time/compress_s", "eval/test_acc",
            "eval/consensus_distance"} <= tags
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(5, 41, 5))
    metrics = [json.loads(line) for r_ in range(4)
               for line in (out / f"metrics-rank{r_}.jsonl").read_text().splitlines()]
    at40 = [m["loss"] for m in metrics if m["kind"] == "train" and m["step"] == 40]
    assert loss[-1].value == pytest.approx(sum(at40) / 4, rel=1e-5)  # the mean over the nodes
    evals = [json.loads(line) for line in (out / "metrics-rank0.jsonl").read_text().splitlines()]
    evals = [m for m in evals if m["kind"] == "eval"]
    assert evals and [e.step for e in acc.Scalars("eval/test_acc")] == [m["step"] for m in evals]
    assert [e.value for e in acc.Scalars("eval/test_acc")] == pytest.approx([m["test_acc"] for m in evals], rel=1e-6)


def test_tensorboard_missing_says_how_to_install(tmp_path, capsys, monkeypatch):
    """Where tensorboard is not installed the flag fails in one line naming the extra
    (run in this process, with torch's TensorBoard module made unimportable)."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError
    rc, err = _main_in_process(tmp_path, capsys, monkeypatch, "--simulate", "2", "--algo", "allreduce", "--data",
                               "synthetic", "--max-steps", "2", "--tensorboard", "--out", str(tmp_path / "run"))
    assert rc == 2, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "gossip[tensorboard]" in lines[0] and "Traceback" not in err, err


def test_the_cli_guide_example_runs_as_written(tmp_path):
    from tests.conftest import REPO

    text = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    section = text[text.index("## Your own model and data"):text.index("## TensorBoard")]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    command = section.split("```\npython -m gossip.train", 1)[1].split("```", 1)[0].split()
    (tmp_path / "my_code.py").write_text(code)
    command = [a for a in command if a]
    command[command.index("--epochs") + 1] = "1"  # a tiny size
    r = run_process([sys.executable, "-m", "gossip.train", *command, "--no-progress", "--out",
                     str(tmp_path / "run")], timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["model"] == "my_code:net"
