"""Three timings on the netns cluster (experiments/diloco_eager_netns.py: DiLoCo's eager
outer step against the synchronous one; experiments/adpsgd_netns.py: one slow rank
under AD-PSGD and D-PSGD; experiments/groups_netns.py: 2 hosts of 2 ranks, flat and in
groups): their options refused in one line before any namespace is built, their tables
rendered from a results file, and, behind the ``netns`` marker, a short run of each on
a real virtual cluster."""

from __future__ import annotations

import json

import pytest

from experiments import adpsgd_netns, diloco_eager_netns, groups_netns, render, tables


@pytest.mark.parametrize("module, argv, what", [
    (diloco_eager_netns, ["--steps", "16", "--local-steps", "8"], "--steps must exceed 2 x --local-steps"),
    (diloco_eager_netns, ["--nodes", "1"], "--nodes must be at least 2"),
    (diloco_eager_netns, ["--repeats", "0"], "--repeats must be at least 1"),
    (adpsgd_netns, ["--nodes", "2"], "--nodes must be even and at least 4"),
    (adpsgd_netns, ["--factor", "0.5"], "--factor must be a number >= 1"),
    (adpsgd_netns, ["--steps", "5", "--skip", "10"], "--skip must be at least 1 and --steps more than --skip + 1"),
    (groups_netns, ["--per-host", "1"], "--hosts and --per-host must each be at least 2"),
    (groups_netns, ["--steps", "6", "--local-steps", "5"], "--steps must exceed --local-steps + 1"),
    (groups_netns, ["--repeats", "0"], "--repeats must be at least 1"),
])
def test_bad_options_are_refused_in_one_line_before_any_namespace(module, argv, what, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        module.main([*argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and what in err[-1]
    assert not (tmp_path / "out").exists()


def test_a_failed_rank_is_named_by_its_error_line():
    tail = "Traceback\n[rank 0] gossip.train: error: --topology ring with world size 2: ring: n must be >= 3\nChildFailedError"
    assert diloco_eager_netns.said(tail) == "[rank 0] gossip.train: error: --topology ring with world size 2: ring: n must be >= 3"
    assert diloco_eager_netns.said("a\nlast words") == "last words"


def _eager(ratio_runs: dict[str, list[float]]) -> dict:
    best = {m: min(v) for m, v in ratio_runs.items()}
    return {"nodes": 4, "rate": "10mbit", "local_steps": 8, "steps": 40, "batch_size": 1024,
            "runs_s_per_step": ratio_runs, "wait_s_per_step": {m: [0.05] * len(v) for m, v in ratio_runs.items()},
            "min_s_per_step": best, "ratio": best["diloco-eager"] / best["diloco"], "target": "met"}


def test_the_eager_table_shows_each_methods_best_run_against_diloco():
    res = _eager({"diloco": [0.30, 0.25], "diloco-eager": [0.20, 0.21]})
    md = tables.diloco_eager_netns_table(res)
    rows = md.splitlines()
    assert rows[2].startswith("| `diloco` | 250.0 ms | 300.0, 250.0 | 1.000 |")
    assert rows[3].startswith("| `diloco-eager` | 200.0 ms | 200.0, 210.0 | 0.800 |")
    text = render.TABLES["diloco_eager_netns"].render({"provenance": {}, "results": res})
    assert md in text and "met (0.800x)" in text


def test_the_slow_rank_table_lists_every_rank_and_the_fast_ranks_against_dpsgd():
    def run(rates):
        return {"rates": rates, "fast": sum(rates[1:]) / 3, "load": 0.1}

    runs = {"dpsgd uniform": [run([20.0, 20.0, 20.0, 20.0])], "adpsgd uniform": [run([30.0, 90.0, 30.0, 90.0])],
            "dpsgd slow": [run([10.0, 10.0, 10.0, 10.0]), run([12.0, 12.0, 12.0, 12.0])],
            "adpsgd slow": [run([15.0, 90.0, 30.0, 90.0])]}
    best = {k: max(x["fast"] for x in v) for k, v in runs.items()}
    res = {"nodes": 4, "rate": "200mbit", "factor": 4.0, "steps": 120, "skip": 10, "batch_size": 256, "runs": runs,
           "best_fast_steps_per_s": best, "ratio": best["adpsgd slow"] / best["dpsgd slow"], "target": 2.0,
           "verdict": "met"}
    md = tables.adpsgd_netns_table(res)
    assert "| `adpsgd` | all at speed 1 | 30.0, 90.0, 30.0, 90.0 | 70.0 | 3.50x |" in md
    assert "| `dpsgd` | rank 0 4x slower | 12.0, 12.0, 12.0, 12.0 | 12.0 | 1.00x |" in md  # the best repeat
    assert "| `adpsgd` | rank 0 4x slower | 15.0, 90.0, 30.0, 90.0 | 70.0 | 5.83x |" in md
    assert "met (5.83x)" in render.TABLES["adpsgd_netns"].render({"provenance": {}, "results": res})


def test_the_groups_table_shows_the_link_the_loopback_and_the_levels():
    def run(st, link, lo, per_step, levels=None):
        return {"s_per_step": st, "wait_s_per_step": st / 2, "load": 0.1, "interface_sent": [link, link],
                "loopback": [lo, lo], "bytes_per_rank_per_step": per_step, "bytes_by_level": levels}

    res = {"hosts": 2, "per_host": 2, "rate": "20mbit", "algo": "diloco", "args": ["--algo", "diloco"],
           "local_steps": 5, "steps": 60, "batch_size": 256,
           "runs": {"flat": [run(0.07, 7e6, 6e6, 92_000), run(0.06, 7e6, 6e6, 92_000)],
                    "groups": [run(0.05, 5e6, 4e7, 360_000, {"inter": 30_000, "intra": 330_000})]},
           "step_ratio": 0.05 / 0.06, "link_bytes_ratio": 5 / 7}
    md = tables.groups_netns_table(res)
    assert "| flat (`--group-size 1`) | 60.0 ms | 30.0 ms |" in md  # the fastest run
    assert "| groups (`--group-size 2`) | 50.0 ms |" in md and "between groups" in md and "inside |" in md
    text = render.TABLES["groups_netns"].render({"provenance": {}, "results": res})
    assert md in text and "step time 0.83x, bytes over the link 0.71x" in text


@pytest.mark.netns
def test_both_timings_run_on_a_virtual_cluster(tmp_path):
    """A short run of each on shaped links: every run exits 0, the JSON holds a time
    per method (or a rate per rank) and a verdict, never judged met on a loaded machine."""
    assert diloco_eager_netns.main(["--nodes", "2", "--local-steps", "2", "--steps", "6", "--batch-size", "64",
                                    "--repeats", "1", "--prefix", "tden", "--out", str(tmp_path / "e")]) == 0
    res = json.loads((tmp_path / "e" / "eager_netns.json").read_text())["results"]
    assert set(res["runs_s_per_step"]) == {"diloco", "diloco-eager"}
    assert all(len(v) == 1 and v[0] > 0 for v in res["runs_s_per_step"].values())
    assert res["target"] in ("met", "not met", "not judged (loaded machine)")
    assert adpsgd_netns.main(["--steps", "14", "--skip", "4", "--batch-size", "32", "--repeats", "1",
                              "--prefix", "tadn", "--out", str(tmp_path / "a")]) == 0
    res = json.loads((tmp_path / "a" / "adpsgd_netns.json").read_text())["results"]
    assert set(res["runs"]) == {"dpsgd uniform", "adpsgd uniform", "dpsgd slow", "adpsgd slow"}
    assert all(len(v) == 1 and len(v[0]["rates"]) == 4 and min(v[0]["rates"]) > 0 for v in res["runs"].values())
    assert res["verdict"] in ("met", "not met", "not judged (loaded machine)")
    assert groups_netns.main(["--local-steps", "2", "--steps", "8", "--batch-size", "32", "--repeats", "1",
                              "--prefix", "tgrp", "--out", str(tmp_path / "g")]) == 0
    res = json.loads((tmp_path / "g" / "groups_netns.json").read_text())["results"]
    flat, grouped = res["runs"]["flat"][0], res["runs"]["groups"][0]
    assert flat["bytes_by_level"] is None and set(grouped["bytes_by_level"]) == {"inter", "intra"}
    assert min(flat["interface_sent"] + grouped["interface_sent"]) > 0
    assert sum(grouped["loopback"]) > sum(flat["loopback"])  # the gradient all-reduce stays inside each host
