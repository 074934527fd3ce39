"""The README's and docs' results tables are what experiments/render.py makes of the
committed results files: a figure cannot drift from its source."""

from __future__ import annotations

import json

import pytest

from experiments import _provenance as P
from experiments import render


def test_committed_tables_equal_their_render():
    changed = render.render_all(write=False)
    assert not changed, (
        f"{', '.join(str(f.relative_to(render.REPO)) for f in changed)} differ from the results files: "
        "run `make results-tables` and commit"
    )
    used = render.used_tables()
    assert {"low_precision", "bench_compress", "bench_step", "gpu_summary"} <= set(used)


def test_the_check_command_passes_on_the_committed_tree(capsys):
    assert render.main(["--check"]) == 0
    assert "tables up to date" in capsys.readouterr().out


def test_a_table_is_regenerated_between_its_markers():
    text = "before\n<!-- results:low_precision -->\n| hand-edited | 0.1 |\n<!-- /results:low_precision -->\nafter\n"
    new = render.render_file(text)
    assert "hand-edited" not in new
    assert new.startswith("before\n<!-- results:low_precision -->\n| bits | naive | DCD | ECD |")
    assert "Rendered from `experiments/results/low_precision.json`" in new
    assert new.endswith("<!-- /results:low_precision -->\nafter\n")
    assert render.render_file(new) == new


def test_bad_markers_are_refused():
    with pytest.raises(ValueError, match=r"x.md: unknown results table 'nope'; known: low_precision, "):
        render.render_file("<!-- results:nope -->\n<!-- /results:nope -->\n", "x.md")
    with pytest.raises(ValueError, match=r"x.md: results markers do not pair up: opened \['low_precision'\], closed \[\]"):
        render.render_file("<!-- results:low_precision -->\n", "x.md")


def test_the_line_under_a_table_never_depends_on_head():
    """Freshness is computed (experiments/freshness.py), never committed: a record whose
    sources changed since renders the same line as a fresh one."""
    prov = {**P.start(["experiments/render.py"], argv=["python", "cmd"], measure_memcpy=False).finish(),
            "dirty_sources": []}  # as if made at HEAD from a clean tree
    old = {**prov, "source_ids": {"experiments/render.py": "0" * 40}}
    assert render.provenance_line("r.json", old) == render.provenance_line("r.json", prov)
    assert "stale" not in render.provenance_line("r.json", old).lower()


def test_the_line_under_a_table_says_where_a_dirty_tree_was_dirty():
    """A run made with uncommitted changes says whether any lay in its sources (the
    figures are then not reproducible from the commit) or only elsewhere."""
    base = {"command": "python cmd", "commit": "a" * 40, "date": "2026-11-30"}
    assert "dirty" not in render.provenance_line("r.json", {**base, "dirty": False})
    assert "commit aaaaaaaaaa (uncommitted changes, none in its sources)" in render.provenance_line(
        "r.json", {**base, "dirty": True, "dirty_sources": []})
    assert "(uncommitted changes to gossip/robust.py)" in render.provenance_line(
        "r.json", {**base, "dirty": True, "dirty_sources": ["gossip/robust.py"]})
    assert "(dirty tree)" in render.provenance_line("r.json", {**base, "dirty": True})  # recorded before the list


def test_the_3_bit_row_is_not_called_met():
    rows = [{"compressor": "quant:bits=3", "roundtrip_ratio": 0.249}, {"compressor": "quant:bits=2", "roundtrip_ratio": 0.297},
            {"compressor": "sign", "roundtrip_ratio": 0.2}, {"compressor": "identity", "roundtrip_ratio": 0.2}]
    table = render._bench_compress(rows)
    assert "| quant:bits=3 | 0.249 | ≥ 1/4: **not met** |" in table
    assert "| quant:bits=2 | 0.297 | ≥ 1/4 |" in table
    assert "| sign | 0.200 | ≥ 1/6 |" in table and "| identity | 0.200 |  |" in table


def test_stale_command_lists_results_with_their_reasons(capsys, monkeypatch):
    # what --stale found, kept as it found it (each status costs a pass over the
    # repository's history: not computed a second time here)
    found = []
    stale_results = render.stale_results
    monkeypatch.setattr(render, "stale_results", lambda: found.append(stale_results()) or found[-1])
    assert render.main(["--stale"]) == 0
    out = capsys.readouterr().out
    assert len(found) == 1
    for rel, _, why in found[0]:
        assert f"{rel}: {why[0]} ({'; '.join(why[1:])})" in out


def test_markers_inside_code_fences_are_examples_not_tables():
    text = "```\n<!-- results:NAME -->\n<!-- /results:NAME -->\n```\n"
    assert render.render_file(text) == text


def test_a_table_awaiting_its_results_file_keeps_its_hand_written_figures(monkeypatch, capsys):
    """A registered table whose command has not been run yet: the figures between its
    markers stay, under one line that names the command; --stale lists it; once the
    results file exists the render replaces them."""
    t = render.Table("experiments/results/not-yet.json", lambda res: "rendered", command="python make_it.py")
    monkeypatch.setitem(render.TABLES, "not_yet", t)
    text = "<!-- results:not_yet -->\n| a | b |\n|---|---|\n| 1 | 2 |\n<!-- /results:not_yet -->\n"
    new = render.render_file(text)
    assert new == ("<!-- results:not_yet -->\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
                   "<sub>Hand-written figures, not yet from a results file: `python make_it.py` writes "
                   "`experiments/results/not-yet.json`, then `make results-tables` renders this table.</sub>\n"
                   "<!-- /results:not_yet -->\n")
    assert render.render_file(new) == new  # the note is not repeated
    with pytest.raises(ValueError, match=r"table 'not_yet': no results file yet \(experiments/results/not-yet.json\) "
                                         r"and no hand-written table between its markers; run `python make_it.py`"):
        render.render_file("<!-- results:not_yet -->\n<!-- /results:not_yet -->\n")
    # a registered table without a command must have its file: a missing one is an error, not a pass
    monkeypatch.setitem(render.TABLES, "no_file", render.Table("experiments/results/not-yet.json", lambda r: ""))
    with pytest.raises(OSError):
        render.render_file("<!-- results:no_file -->\n| x |\n<!-- /results:no_file -->\n")
    monkeypatch.setattr(render, "used_tables", lambda: {"not_yet": ["docs/x.md"]})
    assert render.main(["--stale"]) == 0
    out = capsys.readouterr().out
    assert ("experiments/results/not-yet.json: not yet measured (the table not_yet in docs/x.md is hand-written); "
            "run: python make_it.py") in out
    assert "1 table(s) awaiting their results file" in out.splitlines()[-1]
    # the results file exists: its figures replace the hand-written ones
    monkeypatch.setitem(render.TABLES, "not_yet", render.Table("experiments/results/low_precision.json",
                                                               lambda res: "rendered", command="python make_it.py"))
    now = render.render_file(new)
    assert now.startswith("<!-- results:not_yet -->\nrendered\n\n") and "| 1 | 2 |" not in now
    assert "<sub>Rendered from `experiments/results/low_precision.json`" in now and render.PENDING not in now


def _git_repo(root):
    """A repository of two commits: dir/a.py and dir/b.py, then dir/a.py changed."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                              capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (root / "dir").mkdir()
    (root / "dir" / "a.py").write_text("a = 1\n")
    (root / "dir" / "b.py").write_text("b = 1\n")
    git("add", "-A")
    git("commit", "-q", "-m", "first")
    first = git("rev-parse", "HEAD")
    (root / "dir" / "a.py").write_text("a = 2\n")
    git("commit", "-q", "-am", "second")
    return first, git


def test_narrow_looks_up_the_sub_paths_at_the_recorded_commit(tmp_path, monkeypatch, capsys):
    """A results file made at an older commit, listing a folder: narrowed to one file in
    it, the file's id is the one at that commit, so the freshness check judges it by the
    file alone (fresh where only a sibling changed since, stale where it changed)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    first, git = _git_repo(repo)
    monkeypatch.setattr(P, "REPO", repo)
    prov = {"command": "python x.py", "commit": first, "dirty": False, "date": "2026-01-02T03:04:05+00:00",
            "sources": ["dir"], "source_ids": {"dir": git("rev-parse", f"{first}:dir")},
            "dirty_sources": ["dir/a.py", "dir/b.py"]}
    assert P.stale({**prov, "dirty_sources": []}) == ["changed since: dir"]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"provenance": prov, "results": [1]}, indent=2) + "\n")
    assert render.main(["--narrow", str(path), "dir/b.py"]) == 0
    assert "sources narrowed from dir to dir/b.py" in capsys.readouterr().out
    res, new = P.read(path)
    assert res == [1] and new["sources"] == ["dir/b.py"] and new["dirty_sources"] == ["dir/b.py"]
    assert new["source_ids"] == {"dir/b.py": git("rev-parse", f"{first}:dir/b.py")}
    assert new["narrowed"][0]["sources"] == ["dir"] and new["narrowed"][0]["source_ids"] == prov["source_ids"]
    assert path.read_text().startswith('{\n  "provenance": {\n    "command"')  # the file's layout is kept
    assert P.stale({**new, "dirty_sources": []}) == []  # only dir/a.py changed since
    a = P.narrow(prov, ["dir/a.py"])
    assert a["source_ids"]["dir/a.py"] == git("rev-parse", f"{first}:dir/a.py") != git("rev-parse", "HEAD:dir/a.py")
    assert P.stale({**a, "dirty_sources": []}) == ["changed since: dir/a.py"]
    # what cannot be narrowed says why, in one line
    with pytest.raises(ValueError, match=r"^dir/a.py is not inside the recorded sources \(dir/b.py\): narrowing can "
                                         r"only name paths within them$"):
        P.narrow(new, ["dir/a.py"])
    with pytest.raises(ValueError, match=r"^dir/c.py did not exist at the recorded commit " + first[:10] + "$"):
        P.narrow(prov, ["dir/c.py"])
    with pytest.raises(ValueError, match=r"^the recorded commit 0000000000 is not in this repository's history"):
        P.narrow({**prov, "commit": "0" * 40}, ["dir/a.py"])
    with pytest.raises(ValueError, match=r"^the recorded ids of dir are not those at the recorded commit"):
        P.narrow({**prov, "source_ids": {"dir": "1" * 40}}, ["dir/a.py"])
    with pytest.raises(ValueError, match=r"^paths must be relative to the repository, without '\.\.', got 'dir/\.\./x'"):
        P.narrow(prov, ["dir/../x"])
    with pytest.raises(ValueError, match=r"^nothing to narrow: the paths are the recorded sources \(dir\)$"):
        P.narrow(prov, ["dir/"])
    before = path.read_text()
    assert render.main(["--narrow", str(path), "dir"]) == 2
    assert "render: error: dir is not inside the recorded sources (dir/b.py)" in capsys.readouterr().err
    assert render.main(["--narrow", str(path)]) == 2
    assert "--narrow takes a results file and at least one path" in capsys.readouterr().err
    assert path.read_text() == before  # a refused narrowing leaves the file as it was


def test_the_simulation_and_mergecomp_verdicts_follow_their_figures():
    rows = [{"model": "logreg", "nodes": 1024, "ratio": 10.3},
            {"model": "mlp", "nodes": 1024, "ratio": 1.96, "roofline_fraction": 0.664},
            {"model": "cnn1d", "nodes": 256, "ratio": 1.5}]
    epoch = [{"model": "cnn1d", "nodes": 1024, "outside_share": 0.17}, {"model": "mlp", "nodes": 1024, "outside_share": 0.2}]
    res = {"device": "cpu", "threads": 1, "rows": rows, "epoch": epoch}
    # two decimals: a ratio of 1.46 must not read "1.5x against >= 1.5x not met"
    assert "1.46x against ≥ 1.5x **not met**" in render._bench_sim_targets(
        {**res, "rows": [{"model": "cnn1d", "nodes": 256, "ratio": 1.4618}]})
    # and where two decimals would round a miss up to the target, four
    assert "1.4967x against ≥ 1.5x **not met**" in render._bench_sim_targets(
        {**res, "rows": [{"model": "cnn1d", "nodes": 256, "ratio": 1.49666}]})
    assert render._bench_sim_targets(res) == (
        "logreg at 1,024 nodes 10.30x against ≥ 10x met; mlp at 1,024 nodes 1.96x against ≥ 2x **not met** "
        "(66% of its roofline); "
        "cnn1d at 256 nodes 1.50x against ≥ 1.5x met; cnn1d one epoch 17% outside the steps against < 20% met; "
        "mlp one epoch 20% outside the steps against < 20% **not met**")
    assert render._bench_sim_targets({**res, "device": "cuda"}) == ""  # the targets are one CPU thread's
    assert render._bench_sim_targets({**res, "threads": 2}) == ""

    def row(mode, compress, it):
        return {"model": "m", "compressor": "c", "mode": mode, "compress_s": compress, "iter_s": it}

    line = render._mergecomp_verdicts([row("auto", 0.010, 0.20), row("layer", 0.029, 0.50), row("whole", 0.012, 0.19)])
    assert line == ("\n\nCompression time, layer-wise / searched (target ≥ 3x): m c 2.9x (**not met**). "
                    "Iteration time, searched / the better of layer-wise and whole (target ≤ 1): m c 1.05 (slower).")
    assert render._mergecomp_verdicts([row("auto", 0.01, 0.2)]) == ""  # no layer-wise and whole runs to compare


def test_a_training_run_imports_none_of_the_modules_its_sources_leave_out(tmp_path):
    """training_sources lists the gossip package less NOT_TRAINED: a training run (the
    command line's, simulated) must import none of those, or its figures could change
    with code its results file does not list."""
    import os
    import subprocess
    import sys

    srcs = P.training_sources("experiments/race.py")
    assert {"gossip/runtime.py", "gossip/algorithms", "gossip/compress", "topologies", "experiments/race.py"} <= set(srcs)
    assert not {"gossip/ddp.py", "gossip/leaderboard.py", "gossip/fault_tolerance.py", "gossip/schedule",
                "gossip/tools", "gossip/train", "gossip/train/fault_tolerance.py", "gossip/train/_ftcomm.py",
                "gossip/loop.py", "gossip/config.py"} & set(srcs)
    assert {"gossip/train/__init__.py", "gossip/train/loop.py", "gossip/train/config.py"} <= set(srcs)
    assert all((P.REPO / s).exists() for s in srcs)
    code = ("import runpy, sys\n"
            "sys.argv = ['gossip.train', '--simulate', '4', '--algo', 'dcd', '--bits', '8', '--data', 'synthetic',\n"
            "            '--max-steps', '2', '--no-progress', '--out', sys.argv[1]]\n"
            "try:\n"
            "    runpy.run_module('gossip.train', run_name='__main__', alter_sys=True)\n"
            "except SystemExit as e:\n"
            "    assert not e.code, e.code\n"
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] == 'gossip')))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(P.REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = out.stdout.strip().splitlines()[-1].split()
    assert "gossip.runtime" in loaded and "gossip.train.loop" in loaded
    left_out = {m.removesuffix(".py") for m in P.NOT_TRAINED}
    parts = [m.split(".")[1:] for m in loaded]
    assert [p for p in parts if any("/".join(p[:k]) in left_out for k in range(1, len(p) + 1))] == []
