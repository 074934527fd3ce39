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


@pytest.mark.parametrize("name,flag", [("race", "--methods"), ("gossip_compare", "--methods"),
                                       ("modern_compare", "--methods"), ("sharded_accuracy", "--methods"),
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
