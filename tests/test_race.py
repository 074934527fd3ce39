"""experiments/race.py at a tiny size: the table, the JSON and the modelled times."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import REPO

from experiments import race  # noqa: E402


def test_race_smoke(tmp_path, capsys):
    out = tmp_path / "race"
    assert race.main(["--methods", "allreduce,localsgd", "--nodes", "2", "--epochs", "1", "--data", "synthetic",
                      "--target", "0", "--bandwidth", "10mbit,100mbit", "--latency", "1ms", "--lr", "0.07",
                      "--out", str(out), "--results", str(tmp_path / "results" / "race.json")]) == 0
    res = json.loads((out / "race.json").read_text())
    # --results: the same file, from which docs/race.md renders the table race.md has
    from experiments import render

    assert json.loads((tmp_path / "results" / "race.json").read_text()) == res
    assert render.TABLES["race_modelled"].render(res) in (out / "race.md").read_text()
    # --lr replaces the recipe's for every method; the file says how it was made
    assert res["lr"] == 0.07 and json.loads((out / "allreduce" / "config.json").read_text())["lr"] == 0.07
    assert res["provenance"]["command"].endswith("--lr 0.07 --out OUT/race --results OUT/race.json")
    assert "experiments/race.py" in res["provenance"]["sources"]
    a, l = res["results"]["allreduce"], res["results"]["localsgd"]
    # target 0: reached at the first evaluation (epoch 1), where both have run the same steps
    assert a["to_target"]["step"] == l["to_target"]["step"] == a["steps"]
    # local SGD (H = 8) all-reduces once per 8 steps: an eighth of the bytes, give or take a partial round
    steps = a["steps"]
    assert l["to_target"]["bytes"] == pytest.approx(a["to_target"]["bytes"] * (steps // 8) / steps, abs=1)
    assert a["calls_per_step"] == {"all_reduce": 1.0}
    # the modelled time falls with the bandwidth, by exactly the bytes' share
    t10, t100 = a["to_target"]["time_s"]
    assert t10 - t100 == pytest.approx(1.05 * 8 * a["to_target"]["bytes"] * (1 / 1e7 - 1 / 1e8))
    md = (out / "race.md").read_text()
    assert "\n| allreduce | fp32 | 1 |" in md and "\n| localsgd | fp32 | 1 |" in md
    assert "time to target @ 10mbit" in md
    # the note names the command as the provenance record does: portable, no folder of this machine
    assert f"Made with `{res['provenance']['command']}`" in md and str(tmp_path) not in md
    assert (out / "localsgd" / "summary.json").is_file()


def test_race_refuses_an_unknown_method(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        race.main(["--methods", "allreduce,slowmo", "--out", str(tmp_path)])
    assert e.value.code == 2 and "unknown slowmo" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        race.main(["--methods", "allreduce", "--lr", "0", "--out", str(tmp_path)])
    assert e.value.code == 2 and "error: --lr must be > 0, got 0" in capsys.readouterr().err


def _vcluster():
    from experiments import vcluster
    return vcluster


def test_race_netns_refuses_without_root_and_a_latency(tmp_path, capsys, monkeypatch):
    vcluster = _vcluster()
    monkeypatch.setattr(vcluster, "_cap_eff", lambda: 0)  # as an unprivileged user
    assert race.main(["--mode", "netns", "--methods", "allreduce", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("race: error: --mode netns needs root (") and "re-run with sudo" in err
    assert len(err.splitlines()) == 1
    with pytest.raises(SystemExit) as e:
        race.main(["--mode", "netns", "--latency", "5ms", "--out", str(tmp_path)])
    assert e.value.code == 2 and "the netns mode shapes the rate only" in capsys.readouterr().err


def _netns_reason() -> str | None:
    vcluster = _vcluster()
    try:
        vcluster.check_rights()
    except vcluster.VClusterError as e:
        return str(e)
    return None


@pytest.mark.netns
@pytest.mark.skipif(_netns_reason() is not None, reason=f"needs network namespaces: {_netns_reason()}")
def test_race_netns_stops_at_the_target(tmp_path, capsys):
    """2 torchrun ranks behind a shaped link: the run stops at the first evaluation that
    reaches the target (0 here) instead of running its 100 epochs."""
    import secrets

    out = tmp_path / "race"
    assert race.main(["--mode", "netns", "--methods", "allreduce", "--nodes", "2", "--epochs", "100", "--data",
                      "synthetic", "--target", "0", "--bandwidth", "100mbit", "--prefix", "r" + secrets.token_hex(3),
                      "--out", str(out), "--results", str(tmp_path / "netns.json")]) == 0
    res = json.loads((out / "race.json").read_text())
    from experiments import render

    assert json.loads((tmp_path / "netns.json").read_text()) == res
    assert "\n| 100mbit | allreduce | fp32 | 1 |" in render.TABLES["race_netns"].render(res)
    run = res["results"]["allreduce"]["runs"]["100mbit"]
    assert res["mode"] == "netns" and run["ok"] and run["stopped_at_target"]
    assert run["to_target"]["epoch"] == 1 and run["last_epoch"] < 100 and run["final_test_acc"] is None
    t = run["to_target"]
    assert t["time_s"] > 0 and t["bytes"] > 0
    assert t["model_s"] == pytest.approx(run["points"][0]["compute_s"] + run["points"][0]["codec_s"]
                                         + 1.05 * 8 * t["bytes"] / 1e8)
    assert len(run["load_average"]) == 2
    assert "\n| 100mbit | allreduce | fp32 | 1 |" in (out / "race.md").read_text()
    assert (out / "allreduce@100mbit" / "metrics-rank0.jsonl").is_file()
    assert "race: allreduce @ 100mbit: 0% at epoch 1 after" in capsys.readouterr().out


def test_an_earlier_runs_files_are_not_read_as_the_new_runs(tmp_path):
    """Re-running into the same folder: the earlier run's evaluations (which reached the
    target) must neither stop the new run at once nor stand in for its curve. Here the
    new run fails before writing anything: it is recorded as failed, with no points."""
    import json as _json
    import types

    from gossip import rundir

    run_dir = tmp_path / "m@10mbit"
    run_dir.mkdir()
    rundir.metrics_path(run_dir, 0).write_text(_json.dumps({"kind": "eval", "epoch": 1, "step": 10,
                                                            "test_acc": 0.99, "bytes_sent": 1}) + "\n")
    calls = []

    class Cluster:
        hosts: list = []

        def run_torchrun(self, cmd, per_host, *, monitor, **kw):
            monitor()  # the new run has written nothing yet
            calls.append(cmd)
            bad = types.SimpleNamespace(rank=0, returncode=1, timed_out=False)
            return types.SimpleNamespace(ok=False, failed=[bad], tail=lambda rank, n: "boom")

    rec = race.run_netns_args(Cluster(), ["--model", "cnn1d"], run_dir, 10e6, 0.9, False, 60.0,
                              label="m @ 10mbit", run_id="t")
    assert calls and not rec["ok"] and not rec["stopped_at_target"] and rec["points"] == []
    assert rec["to_target"]["time_s"] is None
