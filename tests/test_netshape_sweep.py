"""experiments/sweep_network.py: measuring a run's files, the sweep's bookkeeping, outputs.

The network and the training are replaced by a stand-in launcher that writes the
files ``gossip.train`` writes (``metrics-rank<k>.jsonl``, ``summary.json``), so these
tests need no rights and no cluster; the cluster itself is tested in
test_netshape_cluster.py.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

from experiments import sweep_network as sw  # noqa: E402


def _write_metrics(run_dir: Path, ranks: int, steps: int, step_s: float, bytes_per_step: int,
                   spe: int, slow_steps=(), start: float = 0.0) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    for k in range(ranks):
        t = start
        with open(run_dir / f"metrics-rank{k}.jsonl", "w") as fh:
            for s in range(1, steps + 1):
                t += step_s * (10 if s in slow_steps else 1)
                fh.write(json.dumps({"kind": "train", "step": s, "epoch": s / spe, "time": t, "loss": 1.0,
                                     "bytes_sent": s * bytes_per_step, "bytes_recv": s * bytes_per_step,
                                     "compute_s": 0.001 * s, "compress_s": 0.0, "comm_s": 0.5 * step_s * s}) + "\n")
                if s % spe == 0:
                    fh.write(json.dumps({"kind": "eval", "step": s, "time": t, "test_acc": 0.5}) + "\n")
    (run_dir / "summary.json").write_text(json.dumps({"steps": steps, "params": 1000, "wall_time_s": t}))


def test_measure_run_median_after_warmup(tmp_path):
    # step 1 (start-up) and step 7 (say, an evaluation) are slow; the median ignores both
    _write_metrics(tmp_path, ranks=2, steps=12, step_s=0.1, bytes_per_step=1000, spe=4, slow_steps=(1, 7))
    m = sw.measure_run(tmp_path, warmup=2, steps=10)
    assert m["step_s"] == pytest.approx(0.1)
    assert m["step_s_p90"] >= m["step_s"]
    assert m["bytes_per_step"] == pytest.approx(1000)
    assert m["steps_measured"] == 8 and m["steps_run"] == 12  # the counters cover the whole run
    assert m["steps_per_epoch_from_records"] == 4
    assert m["comm_s_per_step"] == pytest.approx(0.05)


def test_measure_run_needs_enough_steps(tmp_path):
    _write_metrics(tmp_path, ranks=1, steps=3, step_s=0.1, bytes_per_step=10, spe=3)
    with pytest.raises(RuntimeError, match=r"3 step record\(s\), need more than --warmup 5"):
        sw.measure_run(tmp_path, warmup=5)
    with pytest.raises(RuntimeError, match="no metrics-rank"):
        sw.measure_run(tmp_path / "empty", warmup=0)


def test_parse_algos():
    assert sw.parse_algos("allreduce,dpsgd,dcd:8,ecd:4,naive") == [
        ("allreduce", None), ("dpsgd", None), ("dcd", 8), ("ecd", 4), ("naive", 8)]
    with pytest.raises(sw.SweepError, match=r"unknown algorithm 'adam' in --algos; accepted: allreduce"):
        sw.parse_algos("adam")
    with pytest.raises(sw.SweepError, match=r"bad bits 'x' in --algos item 'dcd:x'"):
        sw.parse_algos("dcd:x")
    with pytest.raises(sw.SweepError, match=r"dpsgd sends fp32 and takes no :bits"):
        sw.parse_algos("dpsgd:8")
    assert sw.parse_algos("choco-top1,choco-sign") == [("choco-top1", None), ("choco-sign", None)]
    with pytest.raises(sw.SweepError, match=r"choco-sign sends fp32 and takes no :bits"):
        sw.parse_algos("choco-sign:8")


def test_ideal_ratios():
    # ring all-reduce moves 2(n-1)/n models per node; ring gossip 2 models at `bits`
    assert sw.ideal_bytes_ratio("dcd", 8, 4) == pytest.approx(1 / 3)
    assert sw.ideal_bytes_ratio("ecd", 8, 8) == pytest.approx(2 / 7)
    assert sw.ideal_bytes_ratio("dpsgd", None, 4) == pytest.approx(4 / 3)
    assert sw.ideal_bytes_ratio("allreduce", None, 8) == 1.0
    # choco on the ring: 2 payloads of 0.64 bits (top-1%: index and value) or 1 bit (sign) per value
    assert sw.ideal_bytes_ratio("choco-top1", None, 8) == pytest.approx(2 * 0.64 / 32 / (14 / 8))
    assert sw.ideal_bytes_ratio("choco-sign", None, 4) == pytest.approx(2 / 32 / (6 / 4))


class FakeLauncher:
    """Writes what a run under a shaped network would: time per step = bytes / rate + rounds x latency."""

    runs: list[str] = []
    BYTES = {"allreduce": 1500, "dpsgd": 2000, "dcd": 520, "ecd": 520, "choco": 80, "sgp": 1000}
    ROUNDS = {"allreduce": 6, "dpsgd": 1, "dcd": 1, "ecd": 1, "choco": 1, "sgp": 1}

    shaping, tcp_cc = "both", "reno"

    def __init__(self, nodes, prefix, subnet, **kw):
        self.nodes = nodes
        self.rate = self.lat = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def shape(self, rate_bps, latency_s):
        self.rate, self.lat = rate_bps, latency_s
        return "emulated"

    def run(self, cmd, cell_dir, run_dir, timeout, window=None):
        algo = cmd[cmd.index("--algo") + 1]
        FakeLauncher.runs.append(cell_dir.name)
        b = self.BYTES[algo]
        step_s = b * 8 / self.rate + self.ROUNDS[algo] * self.lat
        _write_metrics(run_dir, self.nodes, steps=8, step_s=step_s, bytes_per_step=b, spe=4)
        return [sw.RankRun(True, 0, int(b * 8 * 1.05)) for _ in range(self.nodes)], 1.0, ""


@pytest.fixture
def fake(monkeypatch):
    FakeLauncher.runs = []
    monkeypatch.setattr(sw, "_VClusterLauncher", FakeLauncher)
    monkeypatch.setattr(sw, "_train_help", lambda python: "usage: gossip.train --algo ... --emulate-latency MS")
    monkeypatch.setattr(sw, "_calibrate", lambda args, out: 4)
    return FakeLauncher


ARGS = ["--nodes", "4", "--algos", "allreduce,dcd:8", "--bandwidth", "20mbit,5mbit",
        "--latency", "1ms,20ms", "--steps", "8", "--warmup", "2"]


def test_sweep_writes_results_and_skips_measured_cells(tmp_path, fake):
    out = tmp_path / "sweep"
    assert sw.main([*ARGS, "--out", str(out), "--results", str(tmp_path / "r" / "sweep.json")]) == 0
    assert len(fake.runs) == 8
    # --results: the rows with the provenance record, which docs/network.md's table renders
    from experiments import _provenance, render

    res, prov = _provenance.read(tmp_path / "r" / "sweep.json")
    assert prov["command"].endswith("--out OUT/sweep --results OUT/sweep.json") and "experiments/sweep_network.py" in prov["sources"]
    ratios = render.TABLES["sweep_network"].render(res)
    assert ratios.splitlines()[0] == "| bandwidth | latency (emulated) | all-reduce step | DCD 8-bit / all-reduce |"
    ar = next(r for r in res["rows"] if r["algo"] == "allreduce" and r["bandwidth_mbit"] == 5 and r["latency_ms"] == 20)
    dcd = next(r for r in res["rows"] if r["algo"] == "dcd" and r["bandwidth_mbit"] == 5 and r["latency_ms"] == 20)
    assert f"| 5 Mbit/s | 20 ms | {ar['step_s']:.3f} s | {dcd['step_s'] / ar['step_s']:.2f} |" in ratios
    assert ratios.splitlines()[-1] == "| *ideal (bytes)* | | | *0.333* |"
    with open(out / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 8
    for col in ("algo", "nodes", "bandwidth_mbit", "latency_ms", "latency_mode", "step_s", "epoch_s",
                "bytes_per_step", "iface_bytes_per_step"):
        assert col in rows[0]
    assert {r["latency_mode"] for r in rows} == {"emulated"}
    data = json.loads((out / "results.json").read_text())
    row = next(r for r in data["rows"] if r["algo"] == "dcd" and r["bandwidth_mbit"] == 5 and r["latency_ms"] == 20)
    assert row["step_s"] == pytest.approx(520 * 8 / 5e6 + 0.020)
    assert row["epoch_s"] == pytest.approx(4 * row["step_s"])
    assert row["bytes_per_step"] == pytest.approx(520) and row["bits"] == 8
    assert row["iface_bytes_per_step"] == pytest.approx(520 * 1.05, rel=1e-3)
    assert (out / "fig3.png").stat().st_size > 10_000
    table = (out / "results.md").read_text()
    assert "latency" in table and "emulated" in table and "| dcd:8 | 5 | 20 | emulated |" in table
    # latency is emulated here: the command carries it
    cmd = (out / "cells" / row["cell"] / "command.txt").read_text()
    assert "--emulate-latency 20" in cmd

    # a re-run measures nothing again; --force measures everything again
    assert sw.main([*ARGS, "--out", str(out)]) == 0
    assert len(fake.runs) == 8
    assert sw.main([*ARGS, "--out", str(out), "--algos", "allreduce,dcd:8,ecd:8"]) == 0
    assert len(fake.runs) == 12  # only the new algorithm's cells
    assert sw.main([*ARGS, "--out", str(out), "--force"]) == 0
    assert len(fake.runs) == 20
    assert sw.main(["--out", str(out), "--plot-only"]) == 0
    assert len(fake.runs) == 20


def test_cells_measured_at_other_code_are_measured_again(tmp_path, fake, monkeypatch, capsys):
    # a resumed sweep takes a cell as measured only at the same code: the results'
    # provenance names this checkout's commit, which a cell of another commit would belie
    _provenance = sw._provenance  # the module sweep_network imported (experiments/ is on the path)

    out, results = tmp_path / "sweep", tmp_path / "r.json"
    assert sw.main([*ARGS, "--out", str(out)]) == 0
    assert len(fake.runs) == 8
    cell = json.loads(next((out / "cells").glob("*/cell.json")).read_text())
    assert cell["code"]["source_ids"]["experiments/sweep_network.py"] == \
        _provenance.source_ids(["experiments/sweep_network.py"])["experiments/sweep_network.py"]
    assert sw.main([*ARGS, "--out", str(out)]) == 0  # the same code: nothing measured again
    assert len(fake.runs) == 8

    real = _provenance.source_ids
    monkeypatch.setattr(_provenance, "source_ids",  # gossip/train.py as if changed since
                        lambda sources, rev="HEAD": {**real(sources, rev), "gossip/train.py": "0" * 40})
    capsys.readouterr()
    assert sw.main(["--out", str(out), "--plot-only", "--results", str(results)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--results with --plot-only: 8 of the cells" in err[0] and "gossip/train.py" in err[0]
    assert not results.exists()
    assert sw.main([*ARGS, "--out", str(out), "--results", str(results)]) == 0
    assert len(fake.runs) == 16  # every cell measured again, each saying why
    err = capsys.readouterr().err
    assert err.count("changed since: gossip/train.py; measuring it again") == 8
    res, prov = _provenance.read(results)
    assert {r["code"]["source_ids"]["gossip/train.py"] for r in res["rows"]} == {"0" * 40}

    # a cell written before cells recorded their code is measured again too
    f = out / "cells" / cell["cell"] / "cell.json"
    old = json.loads(f.read_text())
    del old["code"]
    f.write_text(json.dumps(old))
    assert sw.main([*ARGS, "--out", str(out)]) == 0
    assert len(fake.runs) == 17 and "measured before cells recorded their code" in capsys.readouterr().err


def test_choco_cells_run_choco_with_their_compressor_on_the_sweeps_graph(tmp_path, fake):
    out = tmp_path / "sweep"
    assert sw.main(["--nodes", "4", "--algos", "allreduce,choco-top1,choco-sign", "--bandwidth", "5mbit",
                    "--latency", "1ms", "--steps", "8", "--warmup", "2", "--out", str(out)]) == 0
    rows = {r["algo"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert set(rows) == {"allreduce", "choco-top1", "choco-sign"} and all(r["ok"] for r in rows.values())
    for name, spec in (("choco-top1", "topk:p=0.01"), ("choco-sign", "sign")):
        assert rows[name]["bits"] is None and rows[name]["bytes_per_step"] == pytest.approx(80)
        cmd = (out / "cells" / rows[name]["cell"] / "command.txt").read_text()
        assert f"--algo choco --topology ring --compressor {spec} " in cmd, cmd
    table = (out / "results.md").read_text()
    assert "| choco-top1 | 5 | 1 | emulated |" in table and "| choco-sign | 5 | 1 | emulated |" in table
    assert f"| {2 * 0.64 / 32 / 1.5:.3f} |" in table  # the ideal ratio of top-1% on a ring of 4
    assert (out / "fig3.png").stat().st_size > 10_000


def test_time_varying_and_sgp_cells_carry_their_flags(tmp_path, fake):
    out = tmp_path / "sweep"
    names = ["dpsgd-onepeer", "dpsgd-matching", "sgp", "sgp-overlap"]
    assert sw.main(["--nodes", "4", "--algos", ",".join(["allreduce", *names]), "--bandwidth", "5mbit",
                    "--latency", "1ms", "--steps", "8", "--warmup", "2", "--out", str(out)]) == 0
    rows = {r["algo"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert set(rows) == {"allreduce", *names} and all(r["ok"] for r in rows.values())
    flags = {"dpsgd-onepeer": "--algo dpsgd --topology ring --topology onepeer-exp",
             "dpsgd-matching": "--algo dpsgd --topology ring --topology matching",
             "sgp": "--algo sgp --topology ring --topology onepeer-exp",
             "sgp-overlap": "--algo sgp --topology ring --topology onepeer-exp --algo-opt overlap=1"}
    for name, want in flags.items():
        cmd = (out / "cells" / rows[name]["cell"] / "command.txt").read_text()
        assert want in cmd, cmd  # the variant's own graph comes after the sweep's, so it wins
    table = (out / "results.md").read_text()
    for name in names:  # one model per step on a one-peer graph: 1/1.5 of a ring all-reduce of 4
        assert f"| {name} | 5 | 1 | emulated |" in table
    assert table.count(f"| {1 / 1.5:.3f} |") == 4


def test_failed_cell_is_reported_and_retried(tmp_path, fake, monkeypatch):
    out = tmp_path / "sweep"

    def broken(self, cmd, cell_dir, run_dir, timeout, window=None):
        FakeLauncher.runs.append(cell_dir.name)
        return [sw.RankRun(False, 1, 0)], 1.0, "rank 1 exit 1: boom"

    monkeypatch.setattr(FakeLauncher, "run", broken)
    args = ["--nodes", "2", "--algos", "dpsgd", "--bandwidth", "5mbit", "--latency", "1ms", "--steps", "4",
            "--warmup", "1", "--out", str(out)]
    assert sw.main(args) == 1
    row = json.loads((out / "results.json").read_text())["rows"][0]
    assert not row["ok"] and "boom" in row["error"]
    monkeypatch.undo()
    monkeypatch.setattr(sw, "_VClusterLauncher", FakeLauncher)
    monkeypatch.setattr(sw, "_train_help", lambda python: "--emulate-latency")
    monkeypatch.setattr(sw, "_calibrate", lambda args, out: 4)
    assert sw.main(args) == 0  # the failed cell is measured again
    assert len(FakeLauncher.runs) == 2


@pytest.mark.parametrize("flags, match", [
    (["--bandwidth", "5mb"], "--bandwidth: bad rate '5mb'"),
    (["--latency", "20"], "--latency: bad latency '20'"),
    (["--algos", "sgd"], "unknown algorithm 'sgd'"),
    (["--steps", "3", "--warmup", "5"], "need --steps >= 2 and 0 <= --warmup < --steps - 1"),
])
def test_bad_arguments_one_line(tmp_path, flags, match):
    p = subprocess.run([sys.executable, "-m", "experiments.sweep_network", "--out", str(tmp_path),
                        *flags], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and match in lines[0], p.stderr


def test_hosts_dry_run_prints_the_commands(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sw, "_train_help", lambda python: "--emulate-latency")
    monkeypatch.setattr(sw, "_calibrate", lambda args, out: 4)
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("# rank 0 first\nalice@node0 eth0 10.0.0.1\nnode1 ens5\n")
    assert sw.main(["--hosts", str(hosts), "--algos", "dcd:8", "--bandwidth", "5mbit", "--latency", "20ms",
                    "--steps", "4", "--warmup", "1", "--out", str(tmp_path / "o"), "--dry-run",
                    "--remote-repo", "/srv/gossip"]) == 0
    printed = capsys.readouterr().out
    assert "ssh -o BatchMode=yes alice@node0 'sudo /srv/gossip/experiments/tc_shape.sh apply --dev eth0 " \
           "--rate 5000000bit --delay 20000us'" in printed
    assert "MASTER_ADDR=10.0.0.1" in printed and "GLOO_SOCKET_IFNAME=ens5" in printed and "RANK=1" in printed
    assert "tc_shape.sh clear --dev ens5" in printed  # the hosts are always left unshaped
    assert sw.main(["--hosts", str(hosts), "--algos", "choco-top1", "--bandwidth", "5mbit", "--latency", "20ms",
                    "--steps", "4", "--warmup", "1", "--out", str(tmp_path / "c"), "--dry-run",
                    "--remote-repo", "/srv/gossip"]) == 0
    printed = capsys.readouterr().out
    assert "-m gossip.train --algo choco --topology ring --compressor topk:p=0.01 " in printed, printed


def test_step_window_reads_the_counters_at_two_steps(tmp_path):
    path = tmp_path / "metrics-rank0.jsonl"
    tx = {"bytes": 0}
    probe = sw._StepWindow(path, first=2, last=5, counters=lambda: [{"tx_bytes": tx["bytes"]}, {"tx_bytes": 0}])
    probe()  # no file yet: nothing happens
    with open(path, "w", buffering=1) as fh:
        for step in range(1, 8):
            tx["bytes"] += 1000 if step > 2 else 50_000  # start-up traffic before the window
            fh.write(json.dumps({"kind": "train", "step": step, "time": step}) + "\n")
            if step == 4:
                fh.write('{"kind": "train", "st')  # a record cut in the middle: read later
                probe()
                fh.write('ep": 4.5, "time": 4}\n')
            probe()
    assert probe.marks["first"][0] == 2 and probe.marks["last"][0] == 5
    assert probe.per_step() == [1000.0, 0.0]
