"""Results re-certified by behaviour: witnesses, verify, stale, and pages rendered like tables."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from experiments import _provenance as P
from experiments import certify, freshness, render, witness

TINY = ["--simulate", "4", "--algo", "dpsgd", "--model", "logreg", "--epochs", "1", "--batch-size", "64"]


def test_a_witness_is_deterministic_and_names_the_first_step_that_differs(tmp_path):
    a = witness.run(TINY, workdir=tmp_path / "a")
    assert a["steps"] == 4 and a["resume_at"] == 2 and len(a["rows"]) == 4
    assert witness.compare(a, witness.run(TINY, workdir=tmp_path / "b")) is None
    other = witness.run([*TINY, "--lr", "0.01"], workdir=tmp_path / "c")
    where = witness.compare(a, other)
    assert where == "step 1: learning rate 0.05 != 0.01"


def test_a_periodic_method_is_witnessed_past_its_first_outer_step():
    assert witness.plan(["--simulate", "4", "--algo", "diloco", "--algo-opt", "local_steps=6"]) == (8, 4)
    assert witness.plan(["--simulate", "4", "--algo", "ecd", "--bits", "8"]) == (4, 2)


def test_the_flags_a_witness_sets_itself_are_dropped_from_a_config():
    argv = ["--algo", "ecd", "--out", "runs/x", "--overwrite", "--max-steps=9", "--no-progress", "--bits", "8"]
    assert witness.normalise(argv) == ["--algo", "ecd", "--bits", "8"]
    assert witness.key(argv) == witness.key(["--algo", "ecd", "--bits", "8"])


def test_a_comment_or_docstring_is_not_a_change_of_code():
    blob = lambda text: subprocess.run(["git", "hash-object", "--stdin"], input=text, text=True,  # noqa: E731
                                       capture_output=True, cwd=P.REPO, check=True).stdout.strip()
    code = 'def f(x):\n    """Doc."""\n    y = x + 1\n    return y\n'
    assert freshness._code_key(code) == freshness._code_key(code.replace("Doc.", "Other doc.") + "# a comment\n")
    assert freshness._code_key(code) != freshness._code_key(code.replace("y", "z"))
    assert blob(code)  # the ids compared are git's


def test_a_timing_result_is_stale_only_when_code_it_imported_changed():
    head = P.source_ids(["experiments/witness.py"])
    prov = {"command": "python x", "commit": "0" * 40, "imported": head}
    assert freshness.status("r.json", prov).state == "certified"
    st = freshness.status("r.json", {**prov, "imported": {"experiments/witness.py": "1" * 40}})
    assert st.state == "stale" and "experiments/witness.py" in st.reasons[0]


def test_a_table_edit_never_stales_a_timing_result_but_a_timed_module_still_does():
    """The presentation modules (experiments/tables.py, experiments/render.py) a timing
    script imported to print its table do not certify it; every other module it
    imported does, and a module a file lists in its sources always counts."""
    assert set(freshness.PRESENTATION) == {"experiments/tables.py", "experiments/render.py"}
    old = "1" * 40
    head = P.source_ids(["experiments/witness.py"])
    prov = {"command": "python x", "commit": "0" * 40,
            "imported": {**head, **{p: old for p in freshness.PRESENTATION}}}
    assert freshness.timed_modules(prov["imported"]) == ["experiments/witness.py"]
    st = freshness.status("r.json", prov)
    assert st.state == "certified" and st.reasons == []
    # the timed module changed too: stale, and the reason names it alone
    st = freshness.status("r.json", {**prov, "imported": {**prov["imported"], "experiments/witness.py": old}})
    assert st.state == "stale" and st.reasons == ["code it ran changed: experiments/witness.py"]
    # nothing left but presentation: no state of the code it ran, never certified
    st = freshness.status("r.json", {**prov, "imported": {p: old for p in freshness.PRESENTATION}})
    assert st.state == "missing"
    # a listed source (a file made before `imported` was recorded) is what its author said it measures
    listed = {"command": "python x", "commit": "0" * 40, "sources": ["experiments/tables.py"],
              "source_ids": {"experiments/tables.py": old}}
    assert freshness.status("r.json", listed).state == "stale"
    # beside what the launcher imported, the sources it lists count: its ranks' code
    launcher = {**prov, "sources": ["experiments/freshness.py"],
                "source_ids": {"experiments/freshness.py": old}}
    st = freshness.status("r.json", launcher)
    assert st.state == "stale" and st.reasons == ["code it ran changed: experiments/freshness.py"]
    now = {**launcher, "source_ids": P.source_ids(["experiments/freshness.py"])}
    assert freshness.status("r.json", now).state == "certified"


def _results(tmp_path, configs):
    prov = P.start(["gossip", "topologies"], argv=["python", "cmd"], measure_memcpy=False).finish()
    prov.update(configs=configs, dirty_sources=[])
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"provenance": prov, "results": {"x": 1}}, indent=1) + "\n")
    return path


def test_verify_records_certifies_and_names_the_step_where_behaviour_changed(tmp_path, monkeypatch):
    path = _results(tmp_path, [TINY])
    rel = str(path)
    monkeypatch.setattr(freshness, "result_paths", lambda: [path])
    monkeypatch.setattr(certify, "store_path", lambda r: tmp_path / "store.json")
    monkeypatch.setattr(certify, "_dirty_code", lambda: [])
    lines: list[str] = []
    # first verify: certified by its sources, so its witnesses are recorded
    assert certify.verify(jobs=1, say=lines.append) == 0
    assert any("witnesses recorded" in ln for ln in lines), lines
    prov = json.loads(path.read_text())["provenance"]
    assert prov["verified"]["witnesses"] == 1 and "witness_failed" not in prov
    # a behaviour change: the recorded trace no longer matches at step 3
    store = json.loads((tmp_path / "store.json").read_text())
    (trace,) = store["machines"][witness.machine_kind()]["traces"].values()
    trace["rows"][2] = "0" * 16
    (tmp_path / "store.json").write_text(json.dumps(store))
    lines.clear()
    assert certify.verify(jobs=1, say=lines.append) == 1
    assert any("stale" in ln and "step 3: another node's record" in ln for ln in lines), lines
    prov = json.loads(path.read_text())["provenance"]
    assert prov["witness_failed"]["where"].startswith("step 3")
    st = freshness.status(rel, prov)
    assert st.state == "stale" and "step 3" in st.reasons[0]


def test_the_benchmark_pages_are_rendered_and_checked_like_the_tables():
    for md, page in render.PAGES.items():
        assert (render.REPO / md).read_text() == page.text(md), f"{md} differs from its render"


def test_stale_lists_every_result_with_its_state_as_json():
    out = subprocess.run([sys.executable, "-m", "experiments", "stale", "--json", "--all"], cwd=P.REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert {r["results"] for r in rows} >= {"experiments/results/low_precision.json"}
    assert all(r["state"] in ("certified", "unverified", "stale", "missing") for r in rows)


@pytest.mark.parametrize("argv, message", [
    (["verify", "--jobs", "0"], "--jobs must be a positive integer, got 0"),
    (["results", "--budget", "-1"], "--budget must be a positive number of minutes, got -1.0"),
])
def test_bad_arguments_are_one_line(argv, message):
    out = subprocess.run([sys.executable, "-m", "experiments", *argv], cwd=P.REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr


def _blob(text: str) -> str:
    """Write ``text`` into the repository's object store (as git would hold an older
    version of a file); its blob id."""
    return subprocess.run(["git", "hash-object", "-w", "--stdin"], input=text, text=True, capture_output=True,
                          cwd=P.REPO, check=True).stdout.strip()


def test_a_comment_never_unverifies_a_training_result_but_a_rename_does():
    path = "experiments/witness.py"
    # the file as committed (what freshness compares with), whatever is being edited
    now = subprocess.run(["git", "show", f"HEAD:{path}"], cwd=P.REPO, capture_output=True, text=True,
                         check=True).stdout
    commit, _ = P.git_commit()
    prov = {"command": "python x", "commit": commit, "configs": [TINY], "sources": [path], "dirty_sources": []}
    commented = _blob(now + "\n# a comment appended later\n")
    assert freshness.status("r.json", {**prov, "source_ids": {path: commented}}).state == "certified"
    renamed = _blob(now.replace("def _clean(rec", "def _tidy(rec").replace("_clean(rec)", "_tidy(rec)"))
    st = freshness.status("r.json", {**prov, "source_ids": {path: renamed}})
    assert st.state == "unverified" and path in st.reasons[0] and "experiments verify" in st.reasons[0]


def test_a_rerun_gets_a_fresh_folder_for_a_recorded_path_and_this_interpreter():
    """A recorded ``X=PATH`` (an absolute folder on the recording machine) becomes a new
    empty folder, never a folder named PATH in the checkout; ``python`` becomes the
    interpreter that runs ``make results``; the old ``python experiments/X.py`` form
    starts the module."""
    from experiments import rerun

    cmd = rerun.command_of({"command": "OMP_NUM_THREADS=1 TORCHINDUCTOR_CACHE_DIR=PATH python "
                                       "experiments/cold_start.py identity --results OUT/c.json"})
    assert cmd == (f'OMP_NUM_THREADS=1 TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" {shlex.quote(sys.executable)} '
                   "-m experiments.cold_start identity --results runs/c.json")
    out = subprocess.run(rerun.command_of({"command": "TORCHINDUCTOR_CACHE_DIR=PATH python -c "
                                                      "'import os, sys; print(os.environ[\"TORCHINDUCTOR_CACHE_DIR\"], sys.executable)'"}),
                         shell=True, capture_output=True, text=True, timeout=60)
    folder, exe = out.stdout.split()
    assert os.path.isabs(folder) and os.path.isdir(folder) and not os.listdir(folder) and exe == sys.executable
    assert rerun.command_of({"command": "python x.py --name PATH"}).endswith("x.py --name PATH")


def test_a_witness_finds_an_experiments_factory_by_the_bare_name_its_run_recorded(monkeypatch):
    """Runs recorded ``--data sgp_overlap:make`` (their scripts put experiments/ on the
    children's path); the witness resolves that name to the package's module, and
    leaves a name no experiment has alone."""
    import importlib

    monkeypatch.delitem(sys.modules, "sgp_overlap", raising=False)
    witness._alias_experiment("sgp_overlap")
    assert importlib.import_module("sgp_overlap") is importlib.import_module("experiments.sgp_overlap")
    monkeypatch.delitem(sys.modules, "sgp_overlap")
    witness._alias_experiment("no_such_experiment")
    assert "no_such_experiment" not in sys.modules


def test_make_results_waits_for_a_quiet_machine_before_a_timing_run_within_its_limit():
    from experiments import rerun

    t = [0.0]
    loads = iter([1.5, 0.9, 0.4, 0.2, 0.1])

    def sleep(s):
        t[0] += s

    quiet, la = rerun.wait_for_quiet(600, load=lambda: next(loads), sleep=sleep, clock=lambda: t[0], every_s=15)
    assert (quiet, la, t[0]) == (True, 0.2, 45)  # three waits, then below 0.3
    t[0] = 0.0
    quiet, la = rerun.wait_for_quiet(100, load=lambda: 2.0, sleep=sleep, clock=lambda: t[0], every_s=15)
    assert (quiet, la) == (False, 2.0) and t[0] == 100  # gives up at the limit, not before, not after


def test_make_results_waits_before_timing_runs_only_and_says_when_it_runs_under_load(monkeypatch, capsys):
    from experiments import certify, freshness, render, rerun

    todo = [freshness.Status("experiments/results/low_precision.json", "training", "stale", command="true"),
            freshness.Status("experiments/results/bench_topologies.json", "timing", "stale", command="true")]
    waited = []
    monkeypatch.setattr(freshness, "all_statuses", lambda: [])
    monkeypatch.setattr(rerun, "plan", lambda: todo)
    monkeypatch.setattr(rerun, "wait_for_quiet", lambda limit_s: waited.append(limit_s) or (False, 1.7))
    monkeypatch.setattr(rerun.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1))
    monkeypatch.setattr(render, "main", lambda argv: 0)
    monkeypatch.setattr(certify, "verify", lambda files: 0)
    assert rerun.main(load_wait_min=2) == 0
    out = capsys.readouterr().out
    assert waited == [120]
    assert "still 1.70 after 2 min" in out and "bench_topologies.json anyway" in out and "taken under load" in out
