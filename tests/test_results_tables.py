"""The experiments behind the docs' rendered tables, at a tiny size: each writes its
results file with provenance, and experiments/render.py turns it into the table.

(The race, the gossip_compare study and sweep_network are covered where their own smoke tests
run: tests/test_race.py, tests/test_notebooks.py, tests/test_netshape_sweep.py.)"""

from __future__ import annotations

import pytest
import torch

from experiments import _cli
from experiments import _provenance as P
from experiments import bench_topologies, cold_start, crossover_check, render, sgp_overlap, sharded_bytes, study


def _row(rate, overlap, repeat, step, comm, comp):
    return {"rate": rate, "overlap": overlap, "repeat": repeat, "step_s": step, "step_s_p90": step + 0.01,
            "comm_s_per_step": comm, "compute_s_per_step": comp, "bytes_per_step": 499_280.0}


def test_sgp_overlap_table_takes_the_fastest_repeat_and_the_median_parts():
    rows = [_row("100mbit", 0, 0, 0.120, 0.052, 0.059), _row("100mbit", 1, 0, 0.095, 0.016, 0.072),
            _row("100mbit", 0, 1, 0.116, 0.050, 0.061), _row("100mbit", 1, 1, 0.099, 0.018, 0.070),
            _row("10mbit", 0, 0, 0.491, 0.485, 0.049), _row("10mbit", 1, 0, 0.498, 0.479, 0.042)]
    table = render.TABLES["sgp_overlap"].render({"rows": rows})
    lines = table.splitlines()
    assert lines[0].startswith("| link | overlap | step, min over repeats |")
    # min step over repeats; medians of the parts; overlap 0 carries max / sum of its parts
    assert lines[2] == "| 100 Mbit/s | 0 | 0.116 s | 0.126 s | 0.060 s | 0.051 s | 0.060 s / 0.111 s |"
    assert lines[3] == "| 100 Mbit/s | 1 | 0.095 s | 0.105 s | 0.071 s | 0.017 s |  |"
    assert lines[4] == "| 10 Mbit/s | 0 | 0.491 s | 0.501 s | 0.049 s | 0.485 s | 0.485 s / 0.534 s |"
    assert len(lines) == 6


def test_sgp_overlap_refuses_bad_arguments_in_one_line(capsys):
    for argv, msg in ((["--rate", ","], "--rate must name at least one rate"),
                      (["--steps", "3", "--warmup", "3"], "need --steps > --warmup and --repeats >= 1")):
        with pytest.raises(SystemExit) as e:
            sgp_overlap.main(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err


def test_crossover_check_pairs_each_measured_cell_with_the_nearest_prediction():
    measured = [  # sweep_network.py's results.csv rows, as csv.DictReader gives them
        {"algo": "dpsgd", "bits": "", "bandwidth_mbit": "50", "latency_ms": "0.13", "latency_mode": "emulated",
         "step_s": "0.125", "bytes_per_step": "630928", "iface_bytes_per_step": "680000", "ok": "True"},
        {"algo": "ecd", "bits": "8", "bandwidth_mbit": "5", "latency_ms": "0.13", "latency_mode": "emulated",
         "step_s": "0.300", "bytes_per_step": "157808", "iface_bytes_per_step": "", "ok": "True"},
        {"algo": "ecd", "bits": "8", "bandwidth_mbit": "50", "latency_ms": "0.13", "latency_mode": "emulated",
         "step_s": "", "bytes_per_step": "", "iface_bytes_per_step": "", "ok": "False"},  # a failed cell: left out
    ]
    pred = {"rows": [  # python -m gossip.tools.crossover --json
        {"label": "dpsgd", "bytes": 630_000, "step_s": [{"bandwidth": 5e6, "latency": 1.3e-4, "seconds": 1.0},
                                                        {"bandwidth": 5e7, "latency": 1.3e-4, "seconds": 0.105}]},
        {"label": "ecd@quant:bits=8", "bytes": 157_000, "step_s": [{"bandwidth": 5e6, "latency": 1.3e-4, "seconds": 0.27},
                                                                   {"bandwidth": 5e7, "latency": 1.3e-4, "seconds": 0.03}]}]}
    rows = crossover_check.compare(measured, pred, {"dpsgd": "dpsgd", "ecd:8": "ecd@quant:bits=8"})
    assert [(r["algo"], r["bandwidth_mbit"], r["predicted_s"]) for r in rows] == [("dpsgd", 50, 0.105), ("ecd:8", 5, 0.27)]
    assert rows[0]["predicted_over_measured"] == pytest.approx(0.84) and rows[1]["iface_bytes_per_step"] is None
    table = render.TABLES["crossover_check"].render({"rows": rows}).splitlines()
    assert table[2] == ("| dpsgd | 50 Mbit/s | 0.13 ms (emulated) | 105.0 ms | 125.0 ms | 0.84 | 630,000 | 630,928 | "
                        "680,000 |")
    assert table[3].endswith("| 0.90 | 157,000 | 157,808 | - |")


def test_bench_topologies_writes_its_results_and_the_table(tmp_path, capsys):
    path = tmp_path / "topo.json"
    assert bench_topologies.main(["--n", "64", "--repeats", "1", "--results", str(path)]) == 0
    res, prov = P.read(path)
    assert prov["sources"] == ["topologies", "experiments/bench_topologies.py"] and prov["machine"]["memcpy_gbps"] > 0
    assert set(res["cli"]) == {"start-up (--list)", "ring", "expander, degree 4"}
    ring = res["cli"]["ring"]
    assert ring["command"] == "python -m topologies ring 64 --json" and ring["printed"]["n"] == 64
    assert ring["wall_s"][0] > 0 and res["split"]["ring"]["spectrum_s"][0] > 0
    table = render.TABLES["bench_topologies"].render(res)
    assert table.splitlines()[0].startswith("| `python -m topologies ...`, n = 64 | wall, median of 1 (range) |")
    assert "| expander, degree 4 |" in table and table in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        bench_topologies.main(["--n", "4"])
    assert e.value.code == 2 and "need --n >= 5" in capsys.readouterr().err


def test_ecd_recipes_writes_last_and_best_accuracy(tmp_path, capsys):
    path = tmp_path / "ecd.json"
    assert study.main(["--runs", "demo,lr0.1", "--epochs-scale", "0.1", "--data", "synthetic",
                       "--out", str(tmp_path / "runs"), "--results", str(path)], name="ecd_recipes") == 0
    res, prov = P.read(path)
    assert "python -m experiments run ecd_recipes --runs demo,lr0.1 " in prov["command"]
    assert "experiments/studies/ecd_recipes.toml" in prov["sources"]
    demo = res["runs"]["demo"]
    assert demo["epochs"] == 2 and [p["epoch"] for p in demo["points"]] == [1, 2]
    assert demo["final_test_acc"] == demo["points"][-1]["test_acc"]  # the averaged model at the last epoch
    best = max(demo["points"], key=lambda p: p["test_acc"])
    table = render.TABLES["ecd_recipes"].render(res).splitlines()
    assert table[2].startswith(f"| the demo: lr 0.05 constant | 2 | {demo['final_test_acc']:.1%}".replace("%", " %"))
    assert table[2].endswith(f"({best['epoch']:g}) |") and table[3].startswith("| lr 0.1 constant | 2 |")
    with pytest.raises(SystemExit) as e:
        study.main(["--runs", "demo,fast", "--out", str(tmp_path)], name="ecd_recipes")
    assert e.value.code == 2 and "--runs: unknown fast; known: demo, demo-25," in capsys.readouterr().err


@pytest.mark.parametrize("name", study.studies())
def test_a_study_spec_trains_the_configurations_its_results_file_recorded(name):
    """A script that became a study spec trains what it trained: the spec's configurations
    are the ones its committed results file recorded (what the witnesses re-run), and each
    run's label, epochs and flags (its command; its row) are the file's."""
    import shlex

    s = study.load(study.spec_path(name))
    res, prov = P.read(P.REPO / "experiments" / "results" / f"{name}.json")
    params = {k: res.get(k, v) for k, v in s.params.items()} if s.params else None
    lrs = {n: r["lr"] for n, r in res["results"].items()} if s.keep == "tuned" else None
    assert study.configs(s, data=res.get("data") if s.keep == "curve" else None, params=params,
                         lrs=lrs) == prov["configs"]
    if s.keep == "rows":  # each run's row, in order
        assert [{k: row[k] for k in r.row} for r, row in zip(s.runs.values(), res["rows"])] == \
            [r.row for r in s.runs.values()] and len(res["rows"]) == len(s.runs)
    else:
        runs = {"curve": res.get("runs"), "modelled": res.get("results"), "tuned": res.get("results")}.get(s.keep, res)
        assert list(s.runs) == list(runs)
    for n, r in s.runs.items():
        if s.keep == "curve":
            assert (runs[n]["label"], runs[n]["epochs"], runs[n]["flags"]) == (r.label, r.epochs, [*s.base, *r.flags])
        elif s.keep == "tuned":  # each run's flags and base rate, and the grid it was tuned on
            assert (res["methods"][n]["flags"], res["methods"][n]["base_lr"]) == (r.flags, r.lr)
            assert [g["lr"] for g in runs[n]["grid"]] == [round(r.lr * f, 10) for f in res["lr_factors"]]
        elif s.keep == "summary":  # the command each run was, its steps included
            assert runs[n]["command"] == "python -m gossip.train " + shlex.join(
                [*s.base, *r.flags, "--max-steps", str(r.max_steps)])
    # its recorded command still runs, as `python -m experiments run NAME`, with options the study has
    cmd = study.as_study_command(P.as_module(prov["command"]))
    assert f"python -m experiments run {name} " in cmd
    argv = shlex.split(cmd.split(f" run {name} ", 1)[1])
    p = _cli.parser(lambda q: study.options(q, s), study.__doc__, name)
    a = p.parse_args([name, *argv])
    assert {k: getattr(a, k) for k in s.params} == (params or {})


def test_a_bad_study_spec_is_one_line(tmp_path):
    bad = tmp_path / "s.toml"
    for text, needle in [('[study]\nkeep = "x"\n[runs.a]\nepochs = 1\n', "keep = 'x'; accepted: curve, summary, rows"),
                         ('[study]\n[runs.a]\nepochs = 0\n', "[runs.a] epochs must be a positive integer"),
                         ('[study]\n[runs.a]\nepochs = 1\nlr = 2\n', "[runs.a] lr: unknown key"),
                         ('[study]\nbase = "--x"\n[runs.a]\nepochs = 1\n', "base: a list of strings"),
                         ('[study]\nkeep = "rows"\n[runs.a]\nflags = ["--simulate", "{n}"]\n',
                          "[runs.a]: {n} in its flags: not a parameter of [study] params (none declared)"),
                         ('[study]\nkeep = "rows"\nparams = { jobs = 2 }\n[runs.a]\n', "'jobs' cannot name a parameter"),
                         ('[study]\nkeep = "rows"\nparams = { n = true }\n[runs.a]\n', "n = True; accepted: an integer"),
                         ('[study]\nkeep = "rows"\n[runs.a]\nrow = { m = 1 }\n', "[runs.a] row: a table of strings"),
                         ('[study]\ntable = "nosuch"\n[runs.a]\nepochs = 1\n', "table = 'nosuch': not a table of"),
                         ('[study]\nkeep = "tuned"\nparams = { epochs = 2 }\n[runs.a]\nlr = 0.1\n',
                          "declares epochs, tune_epochs, samples, seed (missing: tune_epochs, samples, seed)"),
                         ('[study]\nkeep = "tuned"\nparams = { epochs = 2, tune_epochs = 1, samples = 9, seed = 0 }\n'
                          '[runs.a]\nlr = 0\n', "[runs.a] lr must be a positive number"),
                         ('[study]\nkeep = "tuned"\nlr_factors = [1, -2]\nparams = { epochs = 2, tune_epochs = 1, samples = 9, seed = 0 }\n'
                          '[runs.a]\nlr = 1\n',
                          "lr_factors: a list of positive numbers"),
                         ('[study]\nbaseline = "a"\n[runs.a]\nepochs = 1\n', "baseline: only a 'tuned' study has it")]:
        bad.write_text(text)
        with pytest.raises(study.StudyError) as e:
            study.load(bad)
        assert needle in str(e.value)


def test_a_rows_study_fills_its_parameters_and_keeps_one_row_per_run(tmp_path, capsys):
    """sharded_accuracy at a tiny size: --nodes fills {nodes}, each run trains in process
    and leaves its row, the table is the docs' (experiments/tables.py), and the recorded
    configurations carry the parameters given."""
    path = tmp_path / "sa.json"
    assert study.main(["--nodes", "2", "--epochs", "1", "--max-steps", "1", "--data", "synthetic",
                       "--runs", "allreduce,signum-sharded", "--out", str(tmp_path / "runs"), "--json", str(path)],
                      name="sharded_accuracy") == 0
    res, prov = P.read(path)
    assert "python -m experiments run sharded_accuracy --nodes 2 " in prov["command"]
    assert "experiments/studies/sharded_accuracy.toml" in prov["sources"] and "experiments/training.py" in prov["sources"]
    assert [(r["method"], r["exchange"]) for r in res["rows"]] == [("allreduce", "fp32"), ("signum", "sharded")]
    assert all(r["steps"] == 1 and r["bytes_per_node_per_step"] > 0 for r in res["rows"])
    assert (res["nodes"], res["epochs"], res["max_steps"], res["data"]) == (2, 1, 1, "synthetic")
    assert prov["configs"][1][:2] == ["--simulate", "2"] and prov["configs"][1][-2:] == ["--data", "synthetic"]
    table = (tmp_path / "runs" / "results.md").read_text()
    assert table == render.TABLES["sharded_accuracy"].render(res) + "\n"
    assert "| signum | sharded |" in table and "| allreduce | fp32 all-reduce |" in table


def test_sharded_bytes_reads_both_legs_from_the_ledger(tmp_path, capsys):
    path = tmp_path / "sb.json"
    assert sharded_bytes.main(["--nodes", "2,4", "--results", str(path)]) == 0
    res, prov = P.read(path)
    assert res["params"] == 124_810 and "gossip/compress" in prov["sources"]
    efsgd8 = res["rows"][0]
    assert efsgd8["payload_bytes"] > 124_810  # a byte a value, plus the header
    for n in ("2", "4"):  # each leg carries a shard's payload and its own small header
        assert 1.0 <= efsgd8["per_n"][n]["vs_two_ring_legs"] < 1.01
    table = render.TABLES["sharded_bytes"].render(res).splitlines()
    assert table[0] == "| bytes/node/step | payload | n = 2 | n = 4 | all-gather at n = 4 (computed) |"
    assert table[-1].startswith("| diloco `quant:bits=4`, H = 10 | 62,448 / 10 |") and table[-1].endswith("| 2x |")
    with pytest.raises(SystemExit) as e:
        sharded_bytes.main(["--nodes", "1,4"])
    assert e.value.code == 2 and "--nodes must be a comma list of integers >= 2, got '1,4'" in capsys.readouterr().err


def test_cold_start_writes_its_results_and_the_table(tmp_path, monkeypatch, capsys):
    threads = torch.get_num_threads()
    cache = tmp_path / "inductor"
    cache.mkdir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    path = tmp_path / "cold.json"
    assert cold_start.main(["quant:bits=8", "identity", "--numel", "4096", "--results", str(path)]) == 0
    res, prov = P.read(path)
    assert prov["sources"] == ["gossip/compress", "experiments/cold_start.py"]
    assert "TORCHINDUCTOR_CACHE_DIR=PATH " in prov["command"]  # the cache folder is named, not spelled out
    assert "python -m experiments.cold_start quant:bits=8 identity --numel 4096 --results" in prov["command"]
    assert res["numel"] == 4096 and res["threads"] == 1 and res["inductor_cache"] == "empty"
    assert [r["compressor"] for r in res["rows"]] == ["quant:bits=8", "identity"]
    assert all(0 < r["first_s"] < 60 and 0 < r["second_s"] < 60 for r in res["rows"])
    assert torch.get_num_threads() == threads  # one thread while timing, the caller's count restored
    table = render.TABLES["cold_start"].render(res)
    lines = table.splitlines()
    assert lines[0] == f"Backend `{res['backend']}`, inductor cache empty at the start, torch {res['torch']}:"
    assert lines[2] == "| compressor (4,096 values, 1 thread) | first encode+decode | second | first under 5 s |"
    q = res["rows"][0]
    verdict = "yes" if q["first_s"] < res["target_first_s"] else "**no**"  # the bench reports the speed; no test times it
    assert lines[4] == f"| quant:bits=8 | {q['first_s']:.2f} s | {q['second_s']:.2f} s | {verdict} |"
    fast = {**res, "rows": [{"compressor": "quant:bits=8", "first_s": 1.25, "second_s": 0.01}]}
    assert render.TABLES["cold_start"].render(fast).splitlines()[-1] == "| quant:bits=8 | 1.25 s | 0.01 s | yes |"
    slow = {**res, "rows": [{"compressor": "quant:bits=8", "first_s": 13.86, "second_s": 4.52}]}
    assert render.TABLES["cold_start"].render(slow).splitlines()[-1] == "| quant:bits=8 | 13.86 s | 4.52 s | **no** |"
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cold_start.main(["quant:bits=99"])
    assert e.value.code == 2 and "bits" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cold_start.main(["identity", "--numel", "0"])
    assert e.value.code == 2 and "--numel must be positive, got 0" in capsys.readouterr().err


def test_the_full_compressor_table_gives_every_column_and_the_verdicts():
    row = {"compressor": "quant:bits=3", "numel": 16777216, "encode_gbps": 4.868, "decode_gbps": 11.293,
           "memcpy_gbps": 13.68, "encode_ratio": 0.356, "decode_ratio": 0.825, "roundtrip_ratio": 0.249,
           "roundtrip_ratio_cpu": 0.249, "load_avg": 0.37, "bytes_per_element": 0.375, "ratio_to_fp32": 0.094,
           "ratio_to_ideal": 1.0, "rel_error": 0.6125}
    lines = render.TABLES["bench_compress_all"].render([row, {**row, "compressor": "fp16"}]).splitlines()
    assert lines[0].startswith("| compressor (16,777,216 values) | enc GB/s | dec GB/s | memcpy GB/s |")
    assert lines[2] == ("| quant:bits=3 | 4.868 | 11.293 | 13.68 | 0.356 | 0.825 | 0.249 | 0.249 | 0.37 | 0.3750 | "
                        "1.0000 | 0.6125 | ≥ 1/4: **not met** |")
    assert lines[3].startswith("| fp16 | 4.868 |") and lines[3].endswith("| 0.6125 |  |")  # no target
