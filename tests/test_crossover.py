"""``python -m gossip.tools.crossover``: measured figures, the link model and its crossovers."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from gossip.tools import crossover as cx
from tests.conftest import run_process


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The tool's small simulations in this process on one intra-op thread, whatever
    OMP_NUM_THREADS says, as its child processes run (tests/conftest.py's child_env):
    more threads only spin on tensors this small and contend with the other test
    workers for the cores. No figure checked here depends on the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _m(label, nbytes, codec=0.0, compute=0.0, rounds=None):
    return cx.Measured(label=label, algo=label, decentralized=True, wire="x", bytes=nbytes, codec_s=codec,
                       compute_s=compute, rounds=rounds or {"exchange": 1.0})


@pytest.mark.parametrize("text, value", [("10mbit", 1e7), ("1gbit", 1e9), ("2.5e9", 2.5e9), ("100kbit", 1e5),
                                         ("1Gbit", 1e9), ("1tbit", 1e12), ("1kibit", 1024), ("2mibit", 2 * 2**20),
                                         # tc's bps units are BYTES per second: 100mbps is 800 Mbit/s
                                         ("100mbps", 8e8), ("100MBps", 8e8), ("1kbps", 8e3), ("1bps", 8),
                                         ("1kibps", 8 * 1024), ("1gibps", 8 * 2**30)])
def test_rates_in_tc_units(text, value):
    assert cx.parse_rate(text) == pytest.approx(value)


@pytest.mark.parametrize("bad", ["100MB", "100M", "100mb", "100Mb", "1b", "5kib"])
def test_a_rate_that_does_not_say_bits_or_bytes_is_refused(bad):
    """``100MB`` was read as 100 Mbit/s, where tc reads 100mbps as megabytes per second."""
    with pytest.raises(cx.CrossoverError, match="does not say bits or bytes: write .*bit for bits or .*bps for bytes"):
        cx.parse_rate(bad)


@pytest.mark.parametrize("text, value", [("0", 0.0), ("5ms", 5e-3), ("500us", 5e-4), ("0.05s", 0.05)])
def test_latencies(text, value):
    assert cx.parse_time(text) == pytest.approx(value)


@pytest.mark.parametrize("bad", ["fast", "-1mbit", "0", "10 furlongs"])
def test_bad_rates_say_what_is_accepted(bad):
    with pytest.raises(cx.CrossoverError, match="expected a positive rate"):
        cx.parse_rate(bad)


def test_the_crossover_is_where_the_step_times_meet():
    fp32 = _m("fp32", 4e6, codec=0.0)
    q8 = _m("q8", 1e6, codec=0.004)
    for lat in (0.0, 0.005):
        c = cx.crossover(q8, fp32, lat, n=8)
        assert c["wins"] == "below"
        bw = c["bandwidth"]
        assert bw == pytest.approx(cx.LINK_OVERHEAD * 8 * 3e6 / 0.004)  # wire bits saved over the codec's cost
        assert cx.step_time(q8, bw, lat, 8) == pytest.approx(cx.step_time(fp32, bw, lat, 8))
        assert cx.step_time(q8, bw / 2, lat, 8) < cx.step_time(fp32, bw / 2, lat, 8)
        assert cx.step_time(q8, bw * 2, lat, 8) > cx.step_time(fp32, bw * 2, lat, 8)
    assert cx.crossover(_m("free", 1e6), fp32, 0.0, 8) == {"wins": "always", "bandwidth": None}
    assert cx.crossover(_m("worse", 5e6, codec=1.0), fp32, 0.0, 8) == {"wins": "never", "bandwidth": None}


def test_latency_counts_the_rounds_of_each_call():
    ring_ar = _m("ar", 0.0, rounds={"all_reduce": 1.0})
    gossip = _m("g", 0.0, rounds={"exchange": 1.0})
    assert cx.step_time(ring_ar, 1e9, 0.01, 8) == pytest.approx(14 * 0.01)  # 2 (n - 1) rounds
    assert cx.step_time(gossip, 1e9, 0.01, 8) == pytest.approx(0.01)


def test_the_cli_measures_every_candidate_and_prints_json(tmp_path):
    r = run_process([sys.executable, "-m", "gossip.tools.crossover", "--params", "2000", "--world-size", "4",
                     "--algos", "ecd,dcd@quant:bits=4,efsgd@topk:p=0.05,signsgd", "--bandwidth", "10mbit,1gbit",
                     "--latency", "0,5ms", "--steps", "2", "--json"], timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    rows = {row["label"]: row for row in res["rows"]}
    assert list(rows) == ["allreduce", "dpsgd", "ecd", "dcd@quant:bits=4", "efsgd@topk:p=0.05", "signsgd"]
    d = res["params"]
    assert abs(d - 2000) <= 267  # an MLP 256-h-10: h steps of 267 parameters
    # D-PSGD on a ring sends x to 2 neighbours; ECD the same at 8 bits: a quarter, plus headers
    assert rows["dpsgd"]["bytes"] == pytest.approx(2 * 4 * d, rel=0.05)
    assert rows["ecd"]["bytes"] == pytest.approx(rows["dpsgd"]["bytes"] / 4, rel=0.1)
    assert rows["dcd@quant:bits=4"]["bytes"] < rows["ecd"]["bytes"]
    assert rows["ecd"]["setup_bytes"] > 0 and rows["allreduce"]["setup_bytes"] == 0
    assert rows["ecd"]["rounds"] == {"exchange": 1.0} and rows["allreduce"]["rounds"] == {"all_reduce": 1.0}
    for row in res["rows"]:
        assert row["codec_s"] >= 0 and row["compute_s"] > 0
        assert len(row["step_s"]) == 4 and set(row["crossover"]) == {"allreduce", "dpsgd"}
        for c in row["crossover"]["allreduce"]:
            assert c["wins"] in ("always", "never", "below", "above")
    assert "measuring ecd" in r.stderr


def test_the_table_and_the_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "x.png"
    r = run_process([sys.executable, "-m", "gossip.tools.crossover", "--params", "2000", "--world-size", "4",
                     "--algos", "ecd", "--steps", "1", "--plot", str(png)], timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "crossover against fp32 allreduce" in r.stdout and "modelled step time" in r.stdout
    assert png.stat().st_size > 1000


def test_a_large_world_size_is_modelled_from_a_few_measured_nodes():
    """Above --measure-nodes, each call's bytes are scaled by its accounting: the figures at
    12 nodes modelled from 4 equal those measured at 12 (up to the ring's integer rounding),
    on a ring and on a graph whose degree grows with n; the sharded exchange is left out."""
    def rows(*extra):
        a = cx._parser().parse_args(["--params", "2000", "--world-size", "12", "--steps", "2", *extra])
        res = cx.run(a, say=lambda line: None)
        return res, {r["label"]: r for r in res["rows"]}

    for topo, algos in (("ring", "ecd,demo,powersgd,localsgd,efsgd"), ("exponential", "ecd,noloco")):
        direct_res, direct = rows("--topology", topo, "--algos", algos)
        res, scaled = rows("--topology", topo, "--algos", algos, "--measure-nodes", "4")
        assert direct_res["measured_nodes"] == 12 and res["measured_nodes"] == 4 and res["world_size"] == 12
        if "efsgd" in algos:
            assert "efsgd" in direct and "efsgd" not in scaled and "sharded exchange" in res["left_out"]["efsgd"]
        for label, row in scaled.items():
            assert row["bytes"] == pytest.approx(direct[label]["bytes"], rel=1e-3), (topo, label)
            assert row["rounds"] == direct[label]["rounds"]
        if topo == "ring":
            assert scaled["demo"]["scaled"]["codec"] == pytest.approx(11 / 3)  # it decodes n - 1 payloads
            assert scaled["ecd"]["scaled"]["codec"] == 1.0  # a ring's degree is 2 at any n


def test_a_huge_world_size_answers_within_a_timeout(tmp_path):
    """--world-size 100000 used to simulate 100,000 nodes (minutes, stuck at 'measuring dpsgd')."""
    r = run_process([sys.executable, "-m", "gossip.tools.crossover", "--params", "2000", "--world-size", "100000",
                     "--algos", "ecd", "--steps", "1", "--json"], timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert res["world_size"] == 100_000 and res["measured_nodes"] == cx.MEASURE_NODES
    rows = {row["label"]: row for row in res["rows"]}
    d = res["params"]
    assert rows["allreduce"]["bytes"] == pytest.approx(2 * 4 * d * (100_000 - 1) / 100_000, rel=0.05)
    assert rows["dpsgd"]["bytes"] == pytest.approx(2 * 4 * d, rel=0.05)  # a ring: 2 neighbours at any n
    assert "measuring on 16 simulated nodes, modelling 100,000" in r.stderr


def test_two_links_model_a_run_in_groups():
    """--group-size G --intra --inter: a rank's step is the gradient all-reduce on the
    intra link every step, the slices' all-gather on the steps that exchange (or member
    0's broadcast for an algorithm that cannot be sliced), and 1/G of a group-node's
    bytes on the inter link (all of them on member 0's when it is not sliced)."""
    from gossip.comm.base import ring_allreduce_bytes

    intra, inter = cx.Link.parse("1gbit@1ms", "--intra"), cx.Link.parse("10mbit@20ms", "--inter")
    assert (intra.rate, intra.latency) == (1e9, 1e-3) and cx.Link.parse("1gbit", "--intra").latency == 0
    d, G, groups = 1000, 4, 3
    m = cx.Measured(label="p", algo="p", decentralized=False, wire="x", bytes=4000.0, codec_s=0.004, compute_s=0.1,
                    rounds={"all_reduce": 0.25}, exchange_share=0.25, shards_flat=True)
    t = cx.two_link_time(m, d, groups, G, intra, inter, overhead=1.0)
    gather = 3 * 4 * 250
    assert t["intra_bytes"] == ring_allreduce_bytes(4 * d, G) + 0.25 * gather and t["inter_bytes"] == 1000
    assert t["intra_s"] == pytest.approx(8 * (6000 + 0.25 * gather) / 1e9 + 1e-3 * (6 + 0.25 * 3))
    assert t["inter_s"] == pytest.approx(8 * 1000 / 1e7 + 0.02 * 0.25 * 4)  # 2 (groups - 1) rounds
    assert t["step_s"] == pytest.approx(0.1 + 0.001 + t["intra_s"] + t["inter_s"])
    u = cx.two_link_time(cx.dataclasses.replace(m, shards_flat=False), d, groups, G, intra, inter, overhead=1.0)
    assert u["inter_s"] == pytest.approx(8 * 4000 / 1e7 + 0.02 * 0.25 * 4) and u["codec_s"] == 0.004
    assert u["intra_bytes"] == ring_allreduce_bytes(4 * d, G) + 0.25 * 4 * d * 3 / 4


def test_two_links_on_the_cli():
    a = cx._parser().parse_args(["--params", "2000", "--world-size", "4", "--group-size", "2", "--intra",
                                 "100gbit@0.01ms", "--inter", "100mbit@20ms", "--algos", "localsgd", "--steps", "2",
                                 "--topology", "complete"])
    lines = []
    res = cx.run(a, say=lines.append)
    assert res["world_size"] == 2 and res["two_links"]["ranks"] == 4 and res["two_links"]["group_size"] == 2
    rows = {r["label"]: r for r in res["rows"]}
    d = res["params"]
    local = rows["localsgd"]
    assert 0 < local["exchange_share"] < 1 and local["shards_flat"]  # H local steps, one of them exchanges
    t = local["two_link"]
    assert t["inter_bytes"] == local["bytes"] / 2 and t["flat_s"] is not None
    assert t["intra_bytes"] == pytest.approx(4 * d + local["exchange_share"] * 4 * -(-d // 2))
    assert rows["allreduce"]["two_link"]["intra_bytes"] == pytest.approx(4 * d + 4 * -(-d // 2))
    assert "two links: 4 ranks in 2 groups of 2" in cx.render(res)


@pytest.mark.parametrize("args, needle", [
    (["--intra", "1gbit@1ms"], "--intra without --group-size and --inter: the two-link model needs"),
    (["--group-size", "3", "--intra", "1gbit", "--inter", "1mbit", "--world-size", "8"],
     "--group-size 3 with --world-size 8: expected a divisor"),
    (["--group-size", "2", "--intra", "1gbit", "--inter", "1mbit", "--world-size", "4", "--bandwidth", "1gbit"],
     "--bandwidth with --intra/--inter"),
    (["--group-size", "2", "--intra", "1gbit", "--inter", "1mbit", "--world-size", "4", "--node-speed",
      "slow:nodes=1,factor=4"], "--node-speed with --intra/--inter"),
    (["--group-size", "2", "--intra", "fast@1ms", "--inter", "1mbit", "--world-size", "4"],
     "--intra 'fast@1ms': bandwidth 'fast'"),
])
def test_two_links_bad_input(args, needle):
    with pytest.raises(cx.CrossoverError, match=needle):
        cx.run(cx._parser().parse_args(["--params", "2000", *args]), say=lambda line: None)


@pytest.mark.parametrize("args, needle", [
    (["--algos", "nope"], "unknown algorithm 'nope'"),
    (["--bandwidth", "fast"], "expected a positive rate"),
    (["--latency", "soon"], "expected a time"),
    (["--world-size", "1"], "--world-size 1: must be at least 2"),
    (["--params", "10"], "--params 10: expected 300"),
    (["--link-overhead", "0.5"], "--link-overhead 0.5: expected 1 to 10"),
    (["--topology", "torus", "--world-size", "7", "--algos", "ecd"], "--topology torus with --world-size 7"),
    (["--world-size", "100001"], "--world-size 100,001: at most 100,000 nodes are modelled"),
    (["--measure-nodes", "1"], "--measure-nodes 1: must be at least 2"),
    (["--node-speed", "fast"], "--node-speed 'fast': expected uniform"),
])
def test_bad_input_is_one_line(tmp_path, args, needle):
    r = run_process([sys.executable, "-m", "gossip.tools.crossover", "--params", "2000", *args], timeout=120, cwd=tmp_path)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("gossip.tools.crossover: error:")]
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_a_slow_node_slows_the_synchronous_step_and_adpsgd_runs_on_the_event_clock():
    """--node-speed: a synchronous candidate's compute is the slowest node's; adpsgd is
    timed on the event clock (no closed-form crossover) and needs less time per step."""
    args = ["--params", "2000", "--world-size", "4", "--algos", "adpsgd", "--bandwidth", "10mbit,1gbit",
            "--latency", "0", "--steps", "1", "--node-speed", "slow:nodes=1,factor=4"]
    res = cx.run(cx._parser().parse_args(args), say=lambda line: None)
    rows = {row["label"]: row for row in res["rows"]}
    assert res["node_speed"] == "slow:nodes=1,factor=4"
    assert rows["dpsgd"]["compute_s"] == pytest.approx(4 * rows["adpsgd"]["compute_s"])
    assert rows["adpsgd"]["asynchronous"] and not rows["dpsgd"]["asynchronous"]
    assert all(c["wins"] == "event clock" for c in rows["adpsgd"]["crossover"]["dpsgd"])
    for a, d in zip(rows["adpsgd"]["step_s"], rows["dpsgd"]["step_s"]):
        assert a["seconds"] < d["seconds"]
    assert "node speeds slow:nodes=1,factor=4" in cx.render(res)
