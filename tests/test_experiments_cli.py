"""The experiment scripts check ``--methods`` (and bench_ddp_overlap ``--modes``) the
same way, through experiments/_cli.py: one line naming the flag, what was wrong and
the known names, exit status 2, before any work."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import pytest

from experiments import _cli

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def _script(name: str):
    return importlib.import_module(f"experiments.{name}")


def test_methods_keeps_the_order_and_refuses_unknown_or_no_names(capsys):
    p = argparse.ArgumentParser(prog="x")
    _cli.add_methods(p, ["a", "b", "c"])
    assert p.parse_args([]).methods == "a,b,c"
    assert _cli.methods(p, " c, a,,", ["a", "b", "c"]) == ["c", "a"]
    for value, what in [("a,zz,yy", "unknown zz, yy"), (" , ", "unknown (none given)")]:
        with pytest.raises(SystemExit) as e:
            _cli.methods(p, value, ["a", "b", "c"])
        assert e.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == f"x: error: --methods: {what}; known: a, b, c"


@pytest.mark.parametrize("name,flag", [("race", "--methods"),
                                       ("bench_ddp_overlap", "--modes")])
def test_every_script_refuses_an_unknown_name_in_one_line(name, flag, tmp_path, capsys):
    mod = _script(name)
    known = mod.MODES if flag == "--modes" else mod.METHODS
    with pytest.raises(SystemExit) as e:
        mod.main([flag, f"{next(iter(known))},nosuch", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2
    assert err[-1].endswith(f"error: {flag}: unknown nosuch; known: {', '.join(known)}")
    assert not (tmp_path / "out").exists()  # refused before any work


def test_one_entry_point_runs_every_study_by_name(capsys):
    """``python -m experiments run NAME``: its options from the module's ``options(p)``,
    an unknown name refused in one line; no script builds its own parser or edits
    ``sys.path``."""
    from experiments.__main__ import main, runnable

    assert {"bench_compress", "race", "cold_start", "bench_topologies"} <= set(runnable())
    with pytest.raises(SystemExit) as e:
        main(["run", "bench_topologies", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m experiments run bench_topologies") and "--repeats" in out
    with pytest.raises(SystemExit) as e:
        main(["run", "nosuch"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "unknown study or benchmark 'nosuch'" in err[-1]
    with pytest.raises(SystemExit) as e:
        main(["run", "bench_topologies", "--n", "3"])
    assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: need --n >= 5 (a 4-regular expander) and --repeats >= 1, got --n 3 --repeats 3")
    texts = [f.read_text() for f in EXPERIMENTS.glob("*.py")]
    assert sum(t.count("ArgumentParser(") for t in texts) <= 8
    assert not any("sys.path.insert" in t or "sys.path.append" in t for t in texts)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_uses(path: Path, own: set[str]) -> list[str]:
    """Where ``path`` uses a private name of another of the project's modules: imports
    ``_name`` from it (a function, or a private module such as ``gossip._batched``) or
    reads ``module._name``. The package's own helper modules (``own``:
    experiments/_provenance.py and the like) are its to import; their private names are not."""
    import ast

    ours = ("gossip", "topologies", "experiments")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found, modules = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] in ours:
                    if any(_private(p) for p in parts) and not (parts[0] == "experiments" and parts[1:] in ([p] for p in own)):
                        found.append(f"{path.name}:{node.lineno}: import {a.name}")
                    modules[a.asname or parts[0]] = a.name
        elif isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".") if node.module else []
            package = bool(node.level) and not parts or parts == ["experiments"]
            helper = bool(node.level) and len(parts) == 1 or parts[:1] == ["experiments"] and len(parts) == 2
            if not node.level and parts[:1] and parts[0] not in ours:
                continue
            if any(_private(p) for p in parts) and not (helper and parts[-1] in own):
                found.append(f"{path.name}:{node.lineno}: from {node.module} import ...")
            for a in node.names:
                if _private(a.name) and not (package and a.name in own):
                    found.append(f"{path.name}:{node.lineno}: from {node.module or '.'} import {a.name}")
                modules[a.asname or a.name] = a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in modules):
            found.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_experiment_uses_another_modules_private_names(tmp_path):
    """The experiments use the library's public names (and their own helper modules),
    never a private function, class or module of another module."""
    own = {p.stem for p in EXPERIMENTS.glob("_*.py")} - {"__init__", "__main__"}
    assert {"_provenance", "_cli"} <= own
    found = [u for f in sorted(EXPERIMENTS.glob("*.py")) for u in _private_uses(f, own)]
    assert found == []
    # the check sees each way of reaching a private name
    probe = tmp_path / "probe.py"
    probe.write_text("from gossip.compress import _kernels\nfrom gossip import vectorized\nimport gossip._batched\n"
                     "from experiments.gpu_check import _portable\nfrom experiments import _provenance, render\n"
                     "import os\nvectorized._cross_entropy_rows\nrender._bench_sim_targets\nos._exit\n")
    assert [u.split(": ", 1)[1] for u in _private_uses(probe, own)] == [
        "from gossip.compress import _kernels", "import gossip._batched", "from experiments.gpu_check import _portable",
        "vectorized._cross_entropy_rows", "render._bench_sim_targets"]


def test_a_study_refuses_an_unknown_run_in_one_line(tmp_path, capsys):
    """A study spec's runs are checked the same way (``--methods`` is ``--runs``, as the
    scripts the specs replaced called it), before any work."""
    from experiments.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["run", "sharded_accuracy", "--methods", "allreduce,nosuch", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and err[-1].endswith("error: --runs: unknown nosuch; known: allreduce, efsgd:8-sharded, "
                                                  "efsgd:8-allgather, efsgd-sign-sharded, efsgd-sign-allgather, "
                                                  "signum-sharded, signum-allgather, efblocksgd-sharded, "
                                                  "efblocksgd-allgather, diloco:4-sharded, diloco:4-allgather")
    with pytest.raises(SystemExit) as e:  # an option of another kind of study
        main(["run", "sharded_accuracy", "--epochs-scale", "0.1", "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and "unrecognized arguments: --epochs-scale" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_list_describes_every_study_and_bench(capsys):
    """``python -m experiments list``: every entry has a one-line description."""
    from experiments.__main__ import main

    assert main(["list"]) == 0
    entries = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith(" ")]
    names = {ln.split(":", 1)[0] for ln in entries}
    assert {"race.py", "studies/ecd_recipes.toml", "studies/sharded_accuracy.toml", "benchmark.toml",
            "diloco_eager.py"} <= names
    empty = [ln for ln in entries if not ln.split(":", 1)[1].strip()]
    assert empty == []
