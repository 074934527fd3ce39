"""experiments/netns_gap.py: a measured time to target split into training and the
evaluations, from the run directories' logs alone."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
from experiments import netns_gap


def _run_dir(root: Path, name: str, records: list[dict], params: int = 1000, world: int = 4) -> None:
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"params": params, "world_size": world}))
    (d / "metrics-rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _netns(runs: dict) -> dict:
    return {"workload": "w", "nodes": 4, "seed": 0, "target": 0.9, "sessions": [], "runs": runs}


@pytest.fixture
def logs(tmp_path):
    """Two runs: one reaching the target at its second evaluation, one never reaching it."""
    t = lambda step, time: {"kind": "train", "step": step, "time": time}  # noqa: E731
    e = lambda step, time: {"kind": "eval", "step": step, "time": time}  # noqa: E731
    _run_dir(tmp_path / "a", "m@10mbit", [t(1, 0.1), t(2, 0.2), e(2, 1.2), t(3, 1.3), t(4, 1.4), e(4, 2.0),
                                          t(5, 2.1), t(6, 2.2), e(6, 2.5)])
    _run_dir(tmp_path / "b", "slow@100mbit", [t(1, 0.1), e(1, 0.3)])
    reached = {"run_dir": "m@10mbit", "to_target": {"step": 4, "epoch": 2.0, "bytes": 500, "time_s": 2.0,
                                                    "model_s": 0.2, "compute_s": 0.15},
               "simulated_time_s": 0.1, "simulated_bytes": 1000}
    never = {"run_dir": "slow@100mbit", "to_target": {"step": None, "time_s": None}}
    (tmp_path / "netns.json").write_text(json.dumps({"provenance": {}, "results": _netns(
        {"m": {"10mbit": reached}, "slow": {"100mbit": never}})}))
    return tmp_path


def test_the_evaluations_up_to_the_target_are_taken_out(logs, capsys):
    out = logs / "gap.json"
    assert netns_gap.main(["--netns-results", str(logs / "netns.json"), "--runs", str(logs / "b"), str(logs / "a"),
                           "--json", str(out)]) == 0
    whole = json.loads(out.read_text())
    assert whole["provenance"]["sources"] == netns_gap.SOURCES
    (r,) = whole["results"]["runs"]  # the run that never reached the target is left out
    assert (r["method"], r["bandwidth"], r["evaluations"]) == ("m", "10mbit", 2)  # not the one after the target
    assert r["eval_s"] == pytest.approx(1.0 + 0.6)
    assert r["measured_less_eval_s"] == pytest.approx(0.4)
    assert r["model_error"] == pytest.approx(0.2 / 2.0 - 1) and r["model_error_less_eval"] == pytest.approx(-0.5)
    assert r["simulated_error_less_eval"] == pytest.approx(0.1 / 0.4 - 1)
    # the simulated trial's compute: its modelled time less its bytes at the link rate
    assert r["simulated_compute_s"] == pytest.approx(0.1 - netns_gap.LINK_OVERHEAD * 8 * 1000 / 1e7)
    # two ring all-reduces of 1,000 float32 at 4 ranks and 10 Mbit/s
    assert r["eval_wire_s"] == pytest.approx(2 * 2 * 3 / 4 * 4000 * 8 / 1e7)
    table = capsys.readouterr().out
    assert "| 10mbit | m | 2.0 s | 2 | 1.6 s (80%) |" in table and "**-50%**" in table

    from experiments import render

    assert render.TABLES["netns_gap"].render is render._netns_gap
    assert render._netns_gap(whole["results"]) in table  # the table the script printed, drawn by the renderer


def test_bad_input_is_one_line_and_writes_nothing(logs, capsys):
    out = logs / "gap.json"
    cases = [
        (["--netns-results", str(logs / "none.json"), "--runs", str(logs / "a")], "cannot read it"),
        (["--netns-results", str(logs / "netns.json"), "--runs", str(logs / "b")],
         "run directory 'm@10mbit' (with metrics-rank0.jsonl) is in none of --runs"),
    ]
    (logs / "other.json").write_text(json.dumps({"results": {"rows": []}}))
    cases.append((["--netns-results", str(logs / "other.json"), "--runs", str(logs / "a")],
                  "not a results file of benchmark_netns.py"))
    for argv, what in cases:
        assert netns_gap.main([*argv, "--json", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("netns_gap: ") and what in err and "\n" not in err
        assert not out.exists()
