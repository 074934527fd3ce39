"""experiments/race.py at a tiny size: the table, the JSON and the modelled times."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "experiments"))
import race  # noqa: E402

sys.path.remove(str(REPO / "experiments"))


def test_race_smoke(tmp_path, capsys):
    out = tmp_path / "race"
    assert race.main(["--methods", "allreduce,localsgd", "--nodes", "2", "--epochs", "1", "--data", "synthetic",
                      "--target", "0", "--bandwidth", "10mbit,100mbit", "--latency", "1ms", "--out", str(out)]) == 0
    res = json.loads((out / "race.json").read_text())
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
    assert "time to target @ 10mbit" in md and "Made with `python experiments/race.py" in md
    assert (out / "localsgd" / "summary.json").is_file()


def test_race_refuses_an_unknown_method(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        race.main(["--methods", "allreduce,sgp", "--out", str(tmp_path)])
    assert e.value.code == 2 and "unknown sgp" in capsys.readouterr().err
