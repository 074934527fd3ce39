"""Results files carry provenance: what made them, where, when, and from which code."""

from __future__ import annotations

import json
import subprocess

import pytest

from experiments import _provenance as P
from tests.conftest import REPO


def _head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_a_record_says_what_made_the_results_where_and_from_which_code(tmp_path):
    prov = P.start(["experiments/_provenance.py", "gossip/compress"],
                   argv=["experiments/x.py", "--steps", "3"])
    path = P.write(tmp_path / "r.json", [{"a": 1.5}], prov)
    results, rec = P.read(path)
    assert results == [{"a": 1.5}]
    assert rec["command"].endswith("python -m experiments.x --steps 3")
    assert rec["commit"] == _head() and isinstance(rec["dirty"], bool)
    assert rec["date"].endswith("+00:00") and rec["seconds"] >= 0
    assert rec["machine"]["cores"] >= 1 and rec["machine"]["memcpy_gbps"] > 0 and rec["machine"]["cpu"]
    assert len(rec["load_before"]) == 3 and len(rec["load_after"]) == 3
    assert rec["torch"] and rec["python"]
    assert rec["sources"] == ["experiments/_provenance.py", "gossip/compress"]
    assert all(len(v) == 40 for v in rec["source_ids"].values())
    assert not (tmp_path / "r.json.tmp").exists()


def test_paths_in_the_command_are_portable(tmp_path):
    cmd = P.start(["gossip"], argv=["experiments/x.py", "--out", str(tmp_path / "run"),
                                    f"--json={REPO / 'experiments' / 'results' / 'x.json'}", "plain"],
                  measure_memcpy=False).command
    assert cmd.endswith("python -m experiments.x --out OUT/run --json=experiments/results/x.json plain")


def test_bad_sources_and_files_without_provenance_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"sources must be paths in the repository, these do not exist: gossip/nope"):
        P.start(["gossip/nope"], measure_memcpy=False)
    with pytest.raises(ValueError, match=r"sources must name at least one repository path"):
        P.start([], measure_memcpy=False)
    (tmp_path / "old.json").write_text(json.dumps([{"bits": 8}]))
    with pytest.raises(ValueError, match=r"old.json: no provenance record \(re-run the command that makes it\)"):
        P.read(tmp_path / "old.json")


def test_stale_when_the_sources_changed_since_the_run():
    src = ["experiments/_provenance.py"]
    prov = {"sources": src, "source_ids": P.source_ids(src), "dirty_sources": []}  # made at HEAD
    assert P.stale(prov) == []
    changed = {**prov, "source_ids": {"experiments/_provenance.py": "0" * 40}}
    assert P.stale(changed) == ["changed since: experiments/_provenance.py"]
    dirty = {**prov, "dirty_sources": ["experiments/_provenance.py"]}
    assert P.stale(dirty) == ["made with uncommitted changes to experiments/_provenance.py"]
    assert P.stale({**prov, "source_ids": {}}) == ["it records no state of its sources"]


def test_every_committed_results_file_carries_provenance():
    files = sorted((REPO / "experiments" / "results").glob("*.json"))
    assert files
    for f in files:
        _, rec = P.read(f)
        for key in ("command", "commit", "date", "sources", "source_ids"):
            assert rec.get(key), (f.name, key)
        if not rec.get("legacy"):
            assert rec["machine"]["memcpy_gbps"] and rec["load_before"] and rec["load_after"], f.name


def test_an_experiment_script_writes_its_provenance(tmp_path):
    from experiments import low_precision

    out = tmp_path / "lp.json"
    assert low_precision.main(["--nodes", "4", "--steps", "3", "--json", str(out)]) == 0
    rows, rec = P.read(out)
    assert {r["algo"] for r in rows} == {"dpsgd", "naive", "dcd", "ecd"}
    # a path outside the repository is written OUT/<name>: the record names no folder of this machine
    assert rec["command"].endswith("python -m experiments.low_precision --nodes 4 --steps 3 --json OUT/lp.json")
    assert "experiments/low_precision.py" in rec["sources"]
