"""Modules that moved keep their old paths for one release: importing one warns once
with a DeprecationWarning naming the new path, and gives the same objects; the old
``python -m gossip.crossover`` still runs the tool. ``gossip.data``, now a package,
keeps its names without a warning."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import warnings

import pytest

from tests.conftest import REPO, child_env, run_process

#: old path -> where it moved
MOVED = {
    "gossip.analysis": "gossip.tools.analysis",
    "gossip.crossover": "gossip.tools.crossover",
    "gossip.leaderboard": "gossip.tools.leaderboard",
    "gossip.units": "gossip.tools.units",
    "gossip.textdata": "gossip.data.text",
    "gossip.config": "gossip.train.config",
    "gossip.loop": "gossip.train.loop",
    "gossip.assembly": "gossip.train.assembly",
    "gossip.agreement": "gossip.train.agreement",
    "gossip.metrics": "gossip.train.metrics",
    "gossip.evaluation": "gossip.train.evaluation",
    "gossip.fault_tolerance": "gossip.train.fault_tolerance",
}


@pytest.fixture(scope="module")
def first_imports() -> dict[str, list[str]]:
    """Old path -> the DeprecationWarnings its first imports gave (imported twice, then
    ``from old import *``), each old path in turn in one fresh interpreter: an old path
    that pulled in another would show that one's warning too."""
    olds = [old for old in sorted(MOVED) if old != "gossip.analysis" or importlib.util.find_spec("pandas")]
    code = ("import json, warnings\n"
            "seen_by = {}\n"
            f"for old in {olds!r}:\n"
            "    with warnings.catch_warnings(record=True) as seen:\n"
            "        warnings.simplefilter('always')\n"
            "        __import__(old)\n"
            "        __import__(old)\n"
            "        exec(f'from {old} import *', {})\n"
            "    seen_by[old] = [str(w.message) for w in seen if w.category is DeprecationWarning]\n"
            "print(json.dumps(seen_by))\n")
    r = run_process([sys.executable, "-c", code], timeout=120, cwd=REPO, env=child_env())
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_an_old_path_warns_once_and_re_exports_the_public_names(old, new, first_imports):
    if old == "gossip.analysis":
        pytest.importorskip("pandas")
    messages = first_imports[old]
    assert len(messages) == 1 and new in messages[0] and old in messages[0], messages
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old_mod, new_mod = importlib.import_module(old), importlib.import_module(new)
    public = [n for n in vars(new_mod) if not n.startswith("_")]
    assert public and all(getattr(old_mod, n) is getattr(new_mod, n) for n in public)
    assert old_mod.__all__ == new_mod.__all__


def test_the_old_crossover_command_still_runs_the_tool(tmp_path):
    r = run_process([sys.executable, "-m", "gossip.crossover", "--params", "1e6x"], timeout=120, cwd=tmp_path)
    assert r.returncode == 2
    assert "DeprecationWarning: gossip.crossover is deprecated: it moved to gossip.tools.crossover" in r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("gossip.tools.crossover: error:")]
    assert errors == ["gossip.tools.crossover: error: argument --params: '1e6x' is not a number (see --help)"]


def test_gossip_data_became_a_package_with_the_same_names_and_no_warning():
    code = ("import warnings; warnings.simplefilter('error')\n"
            "import gossip.data\n"
            "from gossip import data\n"
            "from gossip.data import DataError, Dataset, ShardLoader, build_dataset, partition, token_ids\n"
            "import gossip.errors\n"
            "assert DataError is gossip.errors.DataError\n"
            "print(sorted(data.__all__))\n")
    r = run_process([sys.executable, "-c", code], timeout=120, cwd=REPO, env=child_env())
    assert r.returncode == 0, r.stderr[-2000:]
    assert eval(r.stdout.strip().splitlines()[-1]) == sorted([  # noqa: S307 - our own child's list
        "CLASSIFICATION", "LANGUAGE_MODEL", "TASKS", "TOKEN_DTYPE", "CIFAR10_MEAN", "CIFAR10_STD",
        "PARTITION_SCHEMES", "DataError", "Dataset", "RandomCropFlip", "ShardLoader", "available_datasets",
        "register_dataset", "default_model", "FALLBACK_MODEL", "build_dataset", "build_loaders", "dataset_options",
        "default_cache_dir", "partition", "partition_dataset", "stack_next", "token_ids"])


def test_gossip_train_became_a_package_with_the_same_names_and_command(tmp_path):
    """gossip/train.py is the package gossip/train/ (the application): the same public
    names, and python -m gossip.train is the same command."""
    code = ("import warnings; warnings.simplefilter('error')\n"
            "import gossip.train as t\n"
            "from gossip.train import STOPPED, Terminated, main, run\n"
            "print(sorted(t.__all__))\n")
    r = run_process([sys.executable, "-c", code], timeout=120, cwd=REPO, env=child_env())
    assert r.returncode == 0, r.stderr[-2000:]
    assert eval(r.stdout.strip().splitlines()[-1]) == ["main", "run"]  # noqa: S307 - our own child's list
    r = run_process([sys.executable, "-m", "gossip.train", "--simulate", "2", "--epochs", "0"], timeout=120,
                    cwd=tmp_path, env=child_env())
    assert r.returncode == 2 and r.stderr.strip().startswith("gossip.train: error: "), r.stderr[-2000:]
