"""The benchmark's protocol kept: overrides only with a reason, targets held, tuning grids
closed, performance profiles, links scored again without training, the GPU spec's dry run.
Cheap: the tuner and the runner's scheduling are driven by a fake trial function (no
training), the rest reads the committed results files."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
from experiments import benchmark
from experiments.bench_spec import SpecError

SPEC = """
seeds = [0, 1]
lr_factors = [0.5, 1.0]
[workloads.blobs]
data = "synthetic"
model = "mlp"
samples_per_node = 48
epochs = 2
tune_epochs = 1
batch_size = 16
target = 0.8
nodes = [2]
[methods.allreduce]
flags = ["--algo", "allreduce"]
lr = 0.05
[methods.localsgd]
flags = ["--algo", "localsgd"]
lr = 0.05
[links]
bandwidth = ["10mbit"]
latency = ["0"]
"""


# ----------------------------------------------------------------------------- closed grids
def _scores(rates, f):
    return [{"lr": r, "validation": f(r)} for r in rates]


def _close(base, f, higher=True, extensions=3):
    """Drive :func:`benchmark.next_rate` with a fake trial function ``f`` (lr -> metric or
    None for a diverged run): the rates it adds and why it stopped."""
    scores = _scores(base, f)
    added = []
    while True:
        lr, why = benchmark.next_rate(scores, higher, len(base), extensions)
        if lr is None:
            return added, why, benchmark._pick(scores, higher)["lr"]
        added.append(lr)
        scores.append({"lr": lr, "validation": f(lr), "extension": True})


def peak(at):
    return lambda lr: -abs(math.log2(lr / at))  # best at ``at``, worse a factor 2 away


def test_an_interior_pick_is_not_extended():
    assert _close([0.25, 0.5, 1.0, 2.0, 4.0], peak(1.0)) == ([], "interior", 1.0)


def test_a_pick_at_the_top_extends_upwards_until_interior():
    assert _close([0.25, 0.5, 1.0, 2.0, 4.0], peak(8.0)) == ([8.0, 16.0], "interior", 8.0)


def test_a_pick_at_the_bottom_extends_downwards_until_interior():
    assert _close([0.25, 0.5, 1.0, 2.0, 4.0], peak(0.0625)) == ([0.125, 0.0625, 0.03125], "interior", 0.0625)


def test_the_extensions_stop_at_the_limit():
    added, why, pick = _close([0.25, 0.5, 1.0, 2.0, 4.0], peak(1000.0))
    assert added == [8.0, 16.0, 32.0] and pick == 32.0 and why == "at the edge after 3 extension(s): the limit"
    assert _close([1.0, 2.0], peak(1000.0), extensions=0) == ([], "at the edge: the spec allows no extension", 2.0)


def test_the_extensions_stop_where_the_next_rate_diverges():
    f = lambda lr: None if lr > 8 else peak(1000.0)(lr)  # noqa: E731 - diverges above 8
    assert _close([0.25, 0.5, 1.0, 2.0, 4.0], f) == ([8.0, 16.0], "the next rate diverged", 8.0)


def test_lower_is_better_extends_towards_the_lower_metric():
    f = lambda lr: abs(math.log2(lr / 8.0))  # noqa: E731 - a loss, lowest at 8
    assert _close([1.0, 2.0, 4.0], f, higher=False) == ([8.0, 16.0], "interior", 8.0)


def _fake_result(metric_curve, final):
    k = len(metric_curve)
    return {"final": {"final_test_acc": final}, "params": 10, "wire": "fp32", "world_size": 2, "calls_per_step": {},
            "bytes_per_node": 1000 * k,
            "curve": {"step": [10 * (i + 1) for i in range(k)], "metric": list(metric_curve),
                      "bytes": [1000 * (i + 1) for i in range(k)], "compute_s": [0.5 * (i + 1) for i in range(k)],
                      "codec_s": [0.0] * k}}


@pytest.fixture()
def fake_trials(monkeypatch):
    """``benchmark._run_trial`` replaced by a fake trial function: tuning scores peak at
    lr 0.2 for every method, finals cross 0.8 then end where the fake says; the scheduler,
    the records on disk, collect and analyse are the real ones."""
    ran = []

    def fake(t, lr, out, device="cpu"):
        run_dir = t.run_dir(out)
        args = benchmark._train_args(t, lr, run_dir, device)
        score = 0.9 - 0.1 * abs(math.log2(lr / 0.2))
        if t.stage == "tune":
            res = _fake_result([score], score)
        elif t.method.name == "localsgd" and t.seed == 1:
            res = _fake_result([0.5, 0.85, 0.7], 0.7)  # crosses the target, ends below it: does not hold
        else:
            res = _fake_result([0.5, 0.85, 0.9], 0.9)
        rec = {"key": t.key, "workload": t.workload.name, "nodes": t.nodes, "method": t.method.name,
               "stage": t.stage, "lr": lr, "seed": t.seed, "args": args, "cpu_s": 1.0, "wall_s": 1.0,
               "load": [None, None], "data": None, "status": "ok", "error": None, "result": res, "steps": 10}
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "trial.json").write_text(json.dumps(rec))
        ran.append((t.method.name, t.stage, lr))
        return rec

    monkeypatch.setattr(benchmark, "_run_trial", fake)
    return ran


def test_the_runner_closes_each_grid_before_the_final_runs(tmp_path, fake_trials):
    (tmp_path / "s.toml").write_text(SPEC)
    spec = benchmark.load_spec(tmp_path / "s.toml")
    counts = benchmark.run(spec, tmp_path / "out", log=lambda *a, **k: None)
    assert counts["ran"] == 2 * (2 + 3 + 2) and counts["failed"] == 0
    for name in ("allreduce", "localsgd"):
        mine = [(stage, lr) for m, stage, lr in fake_trials if m == name]
        # the grid 0.025, 0.05, then extended up to 0.1, 0.2, 0.4 (0.2 interior), then the finals at 0.2
        assert mine == [("tune", 0.025), ("tune", 0.05), ("tune", 0.1), ("tune", 0.2), ("tune", 0.4),
                        ("final", 0.2), ("final", 0.2)]
    trials = benchmark.collect(spec, tmp_path / "out")
    assert len(trials) == 14
    res = benchmark.analyse(spec, trials)
    nd = res["workloads"]["blobs"]["nodes"]["2"]
    m = nd["methods"]["allreduce"]
    assert m["lr"] == 0.2 and m["grid"] == {"closed": "interior", "extensions": [0.1, 0.2, 0.4]}
    assert m["budget"]["tune"]["runs"] == 5
    # a re-run redoes nothing: the extensions are found finished on disk
    fake_trials.clear()
    again = benchmark.run(spec, tmp_path / "out", log=lambda *a, **k: None)
    assert again["ran"] == 0 and not fake_trials
    # held against ever crossed: localsgd's seed 1 crossed 0.8 and ended at 0.7
    loc = nd["methods"]["localsgd"]
    assert loc["links"]["10mbit@0"]["all_reached"] is False and loc["links"]["10mbit@0"]["reached"] == "1/2"
    assert loc["links_crossed"]["10mbit@0"]["all_reached"] is True
    assert nd["verdicts"]["10mbit@0"]["winner"] == "allreduce" and nd["verdicts"]["10mbit@0"]["second"] is None
    assert nd["verdicts_crossed"]["10mbit@0"]["second"] is not None
    # the report lists the extensions and gives both criteria
    res.update(spec=spec.raw, trials=trials)
    md = benchmark.report(res, tmp_path / "r.md", tmp_path, write=False)
    assert "| blobs | 2 | allreduce | 0.025, 0.05, 0.1, 0.2, 0.4 | 0.2 | 0.1, 0.2, 0.4 | interior |" in md
    assert "## Held against ever crossed" in md and "localsgd at blobs/2 nodes (final 70.00%)" in md


def test_the_held_criterion_times_the_first_crossing():
    goal = benchmark.Goal(0.8, "test_acc", True, 0.005)
    up = _fake_result([0.5, 0.85, 0.9], 0.9)
    assert benchmark.holds(up, goal) and benchmark._to_target(up, goal, 1e7, 0.0)[1] == 2000
    dips = _fake_result([0.5, 0.85, 0.797], 0.797)  # within the tolerance: holds
    assert benchmark.holds(dips, goal) and benchmark._to_target(dips, goal, 1e7, 0.0)[1] == 2000
    falls = _fake_result([0.5, 0.85, 0.79], 0.79)
    assert not benchmark.holds(falls, goal) and benchmark._to_target(falls, goal, 1e7, 0.0) == (None, None)
    assert benchmark._to_target(falls, goal, 1e7, 0.0, held=False)[1] == 2000
    loss = benchmark.Goal(3.9, "test_bpb", False, 0.005)
    assert benchmark.holds({"final": {"final_test_bpb": 3.904}}, loss)
    assert not benchmark.holds({"final": {"final_test_bpb": 3.91}}, loss)


# ----------------------------------------------------------------------------- overrides
def _refused(tmp_path, capsys, text):
    (tmp_path / "s.toml").write_text(text)
    assert benchmark.main(["plan", "--spec", str(tmp_path / "s.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"benchmark: {tmp_path / 's.toml'}: "), err
    return err.removeprefix(f"benchmark: {tmp_path / 's.toml'}: ")


def test_an_override_without_a_reason_is_refused(tmp_path, capsys):
    err = _refused(tmp_path, capsys, SPEC.replace('lr = 0.05\n[links]',
                                                  'lr = 0.05\noverrides = {local_steps = {value = 8}}\n[links]'))
    assert err.startswith("methods.localsgd.overrides.local_steps: no reason: an option set away from the paper's "
                          "default states why")
    err = _refused(tmp_path, capsys, SPEC.replace('lr = 0.05\n[links]',
                                                  'lr = 0.05\noverrides = {local_steps = {value = 8, reason = " "}}'
                                                  '\n[links]'))
    assert err.startswith("methods.localsgd.overrides.local_steps: no reason")
    err = _refused(tmp_path, capsys, SPEC.replace('lr = 0.05\n[links]', 'lr = 0.05\noverrides = {local_steps = 8}\n'
                                                                       '[links]'))
    assert err.startswith("methods.localsgd.overrides.local_steps: 8: an override is a table with its value and "
                          "its reason")


def test_an_option_in_the_flags_is_refused(tmp_path, capsys):
    err = _refused(tmp_path, capsys, SPEC.replace('["--algo", "localsgd"]',
                                                  '["--algo", "localsgd", "--algo-opt", "local_steps=4"]'))
    assert err.startswith("methods.localsgd.flags: --algo-opt sets an option away from the algorithm's paper "
                          "default: give it in methods.NAME.overrides")


def test_an_override_runs_as_an_option_and_the_report_shows_it_with_its_reason(tmp_path):
    (tmp_path / "s.toml").write_text(SPEC.replace(
        'lr = 0.05\n[links]', 'lr = 0.05\noverrides = {local_steps = {value = 4, reason = "short runs"}}\n[links]'))
    spec = benchmark.load_spec(tmp_path / "s.toml")
    m = spec.methods[1]
    assert m.overrides == (("local_steps", 4, "short runs"),)
    t = benchmark.Trial(spec.workloads[0], 2, m, "tune", 0.05, 0)
    args = benchmark._train_args(t, 0.05, tmp_path, "cpu")
    assert args[args.index("--algo"):args.index("--lr")] == ["--algo", "localsgd", "--algo-opt", "local_steps=4"]
    res = {"workloads": {"blobs": {"nodes": {"2": {"methods": {
        "localsgd": {"flags": list(m.run_flags), "overrides": {"local_steps": {"value": 4, "reason": "short runs"}}},
        "old": {"flags": ["--algo", "sparseloco", "--algo-opt", "local_steps=8"]}}}}}}}
    table = benchmark.options_table(res)
    assert "**local_steps=4** (override; default 8)" in table and "| local_steps: short runs |" in table
    assert "**local_steps=8** (no reason recorded; default 15)" in table and "old (local_steps=8)" in table
    assert "optimizer=sgd" in table  # the options left at their defaults are listed too



def test_a_part_says_whether_it_kept_the_protocol():
    """The benchmark's front page marks a part whose options or grids depart from the
    protocol its page states, and says how."""
    def tune(*lrs):
        return [{"lr": x} for x in lrs]

    def part(methods):
        return {"protocol": {}, "workloads": {"blobs": {"nodes": {"2": {"methods": methods}}}}}

    kept = part({"allreduce": {"flags": ["--algo", "allreduce"], "lr": 0.1, "tuning": tune(0.05, 0.1, 0.2)},
                 "localsgd": {"flags": ["--algo", "localsgd", "--algo-opt", "local_steps=4"],
                              "overrides": {"local_steps": {"value": 4, "reason": "short runs"}},
                              "lr": 0.1, "tuning": tune(0.05, 0.1, 0.2, 0.4),
                              "grid": {"closed": "the next rate diverged", "extensions": [0.4]}}})
    assert benchmark.protocol_kept(kept) == "kept"
    old = part({"sparseloco": {"flags": ["--algo", "sparseloco", "--algo-opt", "local_steps=8"], "lr": 0.05,
                               "tuning": tune(0.05, 0.1, 0.2)},
                "signum": {"flags": ["--algo", "signum"], "lr": 0.2, "tuning": tune(0.05, 0.1, 0.2)}})
    assert benchmark.protocol_kept(old) == (
        "not kept: options set with no reason (sparseloco (local_steps=8)); 2 grids open (selected at the edge "
        "(made before grids were closed))")
    limit = part({"signum": {"flags": ["--algo", "signum"], "lr": 0.0125, "tuning": tune(0.0125, 0.025, 0.05, 0.1),
                             "grid": {"closed": "at the edge after 3 extension(s): the limit",
                                      "extensions": [0.025, 0.0125]}}})
    assert benchmark.protocol_kept(limit) == "not kept: 1 grid open (at the edge after 3 extension(s): the limit)"


def test_the_committed_specs_keep_the_paper_defaults():
    """No method of the committed specs sets an option without its reason; the modern
    methods run their papers' local steps."""
    for name in ("benchmark.toml", "benchmark-pilot.toml", "benchmark-cost.toml", "benchmark-gpu.toml"):
        spec = benchmark.load_spec(REPO / "experiments" / name)
        for m in spec.methods:
            assert "--algo-opt" not in m.flags and all(why for _, _, why in m.overrides)
            assert "local_steps" not in {k for k, _, _ in m.overrides}
    spec = benchmark.load_spec(REPO / "experiments" / "benchmark.toml")
    assert spec.bandwidths == ("10mbit", "100mbit", "1gbit", "10gbit") and spec.latencies == ("0", "10ms", "50ms")


# ----------------------------------------------------------------------------- profiles
def _part(times: dict[str, list[float | None]], seeds=(0, 1)):
    """A results dict with one cell (one workload, node count and link): each method's
    per-seed held time."""
    methods = {name: {"seeds": {str(i): {"links": {"10mbit@0": {"time_s": x}}} for i, x in enumerate(ts)}}
               for name, ts in times.items()}
    return {"protocol": {"seeds": list(seeds)}, "links": ["10mbit@0"],
            "workloads": {"w": {"nodes": {"4": {"methods": methods}}}}}


def test_the_profile_score_is_the_normalised_area():
    prof = benchmark.profiles([_part({"a": [1.0, 1.0], "b": [2.0, 2.0], "c": [5.0, 5.0], "d": [1.0, None]})],
                              draws=50)
    m = prof["methods"]
    assert list(m) == ["a", "b", "c", "d"] and prof["tau_max"] == 4.0
    assert m["a"]["score"] == 1.0 and m["b"]["score"] == pytest.approx(2 / 3) and m["c"]["score"] == 0.0
    assert m["d"]["score"] == 0.0  # a seed that does not hold: infinite time
    assert m["a"]["lo"] == m["a"]["hi"] == 1.0  # identical seeds: the bootstrap cannot move it
    assert m["b"]["wins"] == 0 and m["a"]["wins"] == 1 and m["a"]["cells"] == 1
    # two cells (a second part): a method absent from one counts only the cell it ran
    prof = benchmark.profiles([_part({"a": [1.0, 1.0], "b": [2.0, 2.0]}), _part({"a": [3.0, 3.0]})], draws=20)
    assert prof["methods"]["a"]["cells"] == 2 and prof["methods"]["b"]["cells"] == 1
    # seeds that differ give an interval
    prof = benchmark.profiles([_part({"a": [1.0, 3.0], "b": [2.0, 2.0]})], draws=200)
    a = prof["methods"]["a"]
    assert a["lo"] < a["score"] <= a["hi"]


def test_the_size_section_says_how_the_ranking_moved():
    small = _part({"a": [1.0, 1.0], "b": [2.0, 2.0], "c": [3.0, 3.0], "d": [1.5, 1.5]})
    large = _part({"a": [3.0, 3.0], "b": [1.0, 1.0], "c": [2.0, 2.0], "d": [1.5, 1.5]})
    small["workloads"]["w"].update(model_options={"width": 64}, params=1000)
    large["workloads"]["w"].update(model_options={"width": 128}, params=4000)
    text = benchmark.size_section([small, large], draws=20)
    assert "score (rank) at w (width=64; 1,000 parameters) | score (rank) at w (width=128; 4,000 parameters)" in text
    assert "| a | 1.00 [1.00, 1.00] (1) | 0.33 [0.33, 0.33] (4) | -3 |" in text
    assert "| b | 0.67 [0.67, 0.67] (3) | 1.00 [1.00, 1.00] (1) | +2 |" in text
    assert "| d | 0.83 [0.83, 0.83] (2) | 0.83 [0.83, 0.83] (2) | = |" in text
    assert "Leaders at w (width=64; 1,000 parameters): a; at w (width=128; 4,000 parameters): b." in text
    assert "over the 4 methods ranked at both: -0.40. Moved three places or more: a (-3)." in text
    assert benchmark.size_section([small]) == ""
    two = _part({"a": [1.0, 1.0]})
    two["workloads"]["v"] = two["workloads"]["w"]
    with pytest.raises(ValueError, match="one workload at one size"):
        benchmark.size_section([small, two])


def test_the_profile_plot_degrades_without_matplotlib(tmp_path, monkeypatch):
    prof = benchmark.profiles([_part({"a": [1.0, 1.0], "b": [2.0, 2.0]})], draws=10)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert benchmark.profile_plot(prof, tmp_path / "p.png") is None and not (tmp_path / "p.png").exists()
    text = benchmark.profile_section(prof, "p.png", False)
    assert "needs matplotlib (`pip install gossip[analysis]`)" in text and "| 1 | a | 1.000 [1.000, 1.000] |" in text


# ----------------------------------------------------------------------------- existing results
def test_existing_results_are_scored_again_at_new_links_and_by_both_criteria(tmp_path):
    """The pilot's committed results (run at 3 bandwidths, before the held criterion) are
    scored at 10 Gbit/s from their recorded bytes and rounds, without training."""
    from experiments import race
    from gossip.tools import crossover

    res, prov = benchmark.read_benchmark_results(REPO / "experiments" / "results" / "benchmark-pilot.json")
    assert "10gbit@0" not in res["links"]
    spec = benchmark.load_spec(REPO / "experiments" / "benchmark-pilot.toml")
    new = benchmark.rescore(res, spec.bandwidths, spec.latencies)
    assert "10gbit@50ms" in new["links"] and new["rescored"]["from"] == res["links"]
    by_key = {t["key"]: t for t in res["trials"]}
    nd = new["workloads"]["mnist1d"]["nodes"]["4"]
    for name, m in nd["methods"].items():
        for sd in m.get("seeds", {}).values():
            result = by_key[sd["trial"]]["result"]
            pts = benchmark._points(result)
            first = next((p for p in pts if p["metric"] is not None and p["metric"] >= 0.85), None)
            got = sd["links"]["10gbit@10ms"]
            if first is None:
                assert got["time_crossed_s"] is None
                continue
            want = race.modelled_time(first, result["calls_per_step"], result["world_size"],
                                      crossover.parse_rate("10gbit"), 0.01)
            assert got["time_crossed_s"] == pytest.approx(want)
            assert got["time_s"] == (want if sd["holds"] else None) or got["time_s"] == pytest.approx(want)
            assert sd["holds"] == (result["final"]["final_test_acc"] >= 0.85 - 0.005)
        # the links the file held keep their old figures under the criterion before
        for key in res["links"]:
            old = res["workloads"]["mnist1d"]["nodes"]["4"]["methods"][name]
            if "links" in old and old["links"][key]["time_s"]:
                assert m["links_crossed"][key]["time_s"]["mean"] == pytest.approx(old["links"][key]["time_s"]["mean"])
    md = benchmark.report({**res, "provenance": prov}, tmp_path / "p.md", tmp_path, write=False,
                          bandwidths=spec.bandwidths, latencies=spec.latencies)
    head = md.index("## Options as run")
    assert head < md.index("## Protocol") < md.index("## Verdict") < md.index("## Performance profile")
    assert "**local_steps=8** (no reason recorded; default 15)" in md  # sparseloco ran at 8 then
    assert "| mnist1d | 4 | 10gbit@0 |" in md and "The links 10gbit@0, 10gbit@10ms, 10gbit@50ms were scored" in md
    assert "made before grids were closed" in md or "Every selected rate is interior" in md


# ----------------------------------------------------------------------------- the workload that scales
def test_the_gpu_spec_dry_run_prints_the_plan_and_the_parameter_count(tmp_path, capsys):
    out = tmp_path / "out"
    assert benchmark.main(["run", "--spec", str(REPO / "experiments" / "benchmark-gpu.toml"), "--out", str(out),
                           "--dry-run"]) == 0
    text = capsys.readouterr().out
    head = text.splitlines()[0]
    assert head.startswith("workload gpt-25m: model gpt (layers=8, width=512, heads=8), ") and "device cuda" in head
    params = int(head.split("), ")[1].split(" parameters")[0].replace(",", ""))
    assert params >= 20_000_000
    assert "gpt-25m n=16 sparseloco final lr=selected seed=0: python -m gossip.train --simulate 16" in text
    assert "--model-opt layers=8 --model-opt width=512 --model-opt heads=8" in text and "--device cuda" in text
    assert text.rstrip().endswith("24 trials (and up to 1 more per method where a grid is extended)")
    assert not out.exists()  # nothing ran, nothing was written


def test_a_size_knob_is_model_options(tmp_path, capsys):
    spec = benchmark.load_spec(REPO / "experiments" / "benchmark.toml")
    gpt = next(w for w in spec.workloads if w.name == "gpt")
    assert gpt.model_flags == ("--model-opt", "layers=2", "--model-opt", "width=64", "--model-opt", "heads=4")
    assert benchmark.parameter_counts(spec)["gpt"] == 120_576  # the size the results files record
    err = _refused(tmp_path, capsys, SPEC.replace('nodes = [2]', 'nodes = [2]\nmodel_options = {hidden = [1.5]}'))
    assert err.startswith("workloads.blobs.model_options.hidden: [1.5]: expected a number, true/false or text")


# ----------------------------------------------------------------------------- the time model, calibrated
def test_the_calibration_recovers_the_terms_the_link_model_leaves_out():
    """Fake measured runs whose time is the model's plus 1.5 s per evaluation and 2 ms per
    message round: the fit finds both, and each method's error after calibration (fitted
    on the other methods) vanishes."""
    cal = benchmark.fit_calibration([(e, r, 1.5 * e + 0.002 * r) for e in (1, 2, 3) for r in (0, 40, 300)])
    assert cal.eval_s == pytest.approx(1.5) and cal.message_s == pytest.approx(0.002)
    # a term the data would make negative is dropped
    cal = benchmark.fit_calibration([(1, 10, 1.0), (2, 10, 2.0), (3, 0, 3.2)])
    assert cal.message_s >= 0 and cal.eval_s >= 0

    n = 4
    calls = {"allreduce": {"all_reduce": 1.0}, "gossip": {"exchange": 2.0}, "local": {"all_reduce": 0.1}}
    trials, runs = [], {}
    for name, c in calls.items():
        pts = []
        for epoch in (1, 2, 3):
            step = 30 * epoch
            model = 0.5 * epoch + 0.1
            rounds = step * sum(k * {"all_reduce": 6, "exchange": 1}[op] for op, k in c.items())
            pts.append({"step": step, "epoch": float(epoch), "model_s": model, "time_s": model + 1.5 * epoch + 0.002 * rounds})
        trials.append({"key": f"w/n4/{name}/seed0", "result": {"calls_per_step": c}})
        last = pts[-1]
        runs[name] = {"10mbit": {"ok": True, "trial": f"w/n4/{name}/seed0", "points": pts,
                                 "to_target": {"step": last["step"], "epoch": last["epoch"], "model_s": last["model_s"],
                                               "time_s": last["time_s"]}}}
    out = benchmark.calibration({"nodes": n, "bandwidths": ["10mbit"], "runs": runs}, {"trials": trials})
    c = out["10mbit"]
    assert c["eval_s"] == pytest.approx(1.5) and c["message_s"] == pytest.approx(0.002)
    for name, m in c["methods"].items():
        assert m["before"] < -0.5 and m["after"] == pytest.approx(0.0, abs=1e-9)
    text = benchmark.calibration_section({"nodes": n, "bandwidths": ["10mbit"], "runs": runs}, {"trials": trials})
    assert "- 10mbit: 1.5 s per evaluation, 2 ms per message round" in text and "| allreduce | -" in text


def test_a_part_whose_calibrated_model_stays_off_takes_the_measured_verdict():
    """Where the simulated trials' model, calibrated, is off by a median above 25 % at a
    bandwidth, the part's verdict there is the measured order, beside the model's; where
    it holds (within 25 %), no measured verdict is given."""
    n = 4
    calls = {"allreduce": {"all_reduce": 1.0}, "gossip": {"exchange": 2.0}, "local": {"all_reduce": 0.1}}
    # measured times to the target, and the simulated trials' modelled ones: the model has
    # gossip first, the measured order is local, allreduce, gossip
    measured_s = {"allreduce": 20.0, "gossip": 30.0, "local": 10.0}

    def fake(sim_of):
        trials, runs = [], {}
        for name, c in calls.items():
            pts = []
            for epoch in (1, 2, 3):
                step = 30 * epoch
                pts.append({"step": step, "epoch": float(epoch), "model_s": measured_s[name] * epoch / 3,
                            "time_s": measured_s[name] * epoch / 3})
            trials.append({"key": f"w/n4/{name}/seed0", "result": {"calls_per_step": c}})
            last = pts[-1]
            runs[name] = {"10mbit": {"ok": True, "trial": f"w/n4/{name}/seed0", "points": pts,
                                     "simulated_time_s": sim_of(name),
                                     "to_target": {"step": last["step"], "epoch": last["epoch"],
                                                   "model_s": last["model_s"], "time_s": last["time_s"]}}}
        return {"nodes": n, "bandwidths": ["10mbit"], "runs": runs}, {"trials": trials}

    off = fake(lambda name: {"allreduce": 6.0, "gossip": 2.0, "local": 5.0}[name])
    text = benchmark.calibration_section(*off)
    assert "above 25%: the verdict at 10mbit is the measured one" in text
    assert "**At 10mbit this part's verdict is the measured one**" in text
    assert "Measured, local reaches the target first; the model put gossip first" in text
    ranks = [line.split(" | ")[:2] for line in text.splitlines() if line.startswith("| ") and " s |" in line]
    assert ranks == [["| 1", "local"], ["| 2", "allreduce"], ["| 3", "gossip"]]
    held = fake(lambda name: 0.9 * measured_s[name])
    text = benchmark.calibration_section(*held)
    assert "measured one" not in text and "of the simulated trials' 10% before, 10% after" in text


def test_the_overview_says_how_to_run_a_size_not_run_yet():
    from experiments import render

    spec = benchmark.load_spec(REPO / "experiments" / "benchmark.toml")
    page = render.Overview(parts=(), spec="experiments/benchmark.toml", estimate="experiments/results/benchmark-cost.json",
                           sizes=(("gpt", "experiments/results/benchmark-gpt-n4.json"),
                                  ("gpt-w128", "experiments/results/no-such-part.json")))
    text = "\n".join(page.by_size(spec))
    assert "## How the ranking moves with the model's size" in text
    assert ("The workload `gpt-w128` (gpt, layers=2, width=128, heads=4) of `experiments/benchmark.toml` has not "
            "been run yet") in text
    assert "--results experiments/results/no-such-part.json --workloads gpt-w128 --nodes 4 --jobs 2" in text
