"""Unequal node speeds: the specs, the modelled time, the event clock and AD-PSGD.

Pure tests of ``gossip.speeds`` and ``gossip.clock``, then short simulated runs of
``gossip.train`` in this process: a synchronous algorithm computes the same numbers at
any speed (only its modelled time changes), and AD-PSGD with one node 4x slower
finishes the same number of gradients in far less modelled time than D-PSGD, at about
its accuracy.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import topologies
from gossip import algorithms, clock, comm, speeds
from tests.test_train import final_params, read_jsonl, train

QUICK = ["--data", "synthetic", "--batch-size", "64", "--no-progress", "--log-every", "1"]


# ------------------------------------------------------------------------------ speeds
def test_speed_specs():
    assert speeds.parse("uniform", 4).uniform
    s = speeds.parse("slow:nodes=2,factor=4", 5)
    assert s.multipliers.tolist() == [4, 4, 1, 1, 1] and not s.uniform
    assert s.times(7, base=0.5).tolist() == [2, 2, 0.5, 0.5, 0.5]
    a, b = speeds.parse("lognormal:sigma=0.5,seed=3", 8), speeds.parse("lognormal:sigma=0.5,seed=3", 8)
    assert np.array_equal(a.multipliers, b.multipliers) and a.multipliers.std() > 0
    assert speeds.parse("lognormal:sigma=0,seed=1", 3).uniform


def test_speed_trace(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("# seconds per step, one column per node\n0.1,0.2,0.3\n0.4,0.5,0.6\n")
    s = speeds.parse(f"trace:{f}", 3)
    assert s.times(0).tolist() == [0.1, 0.2, 0.3] and s.times(3).tolist() == [0.4, 0.5, 0.6]
    assert clock.sync_time(s, 3, 99.0, 1.0) == pytest.approx(0.3 + 0.6 + 0.3 + 1.0)
    with pytest.raises(speeds.SpeedError, match="line 2 has 3 values; the run has 4 nodes"):
        speeds.parse(f"trace:{f}", 4)


@pytest.mark.parametrize("spec, match", [
    ("fast", "expected uniform, slow:nodes=K,factor=F"),
    ("slow:nodes=1", "missing factor="),
    ("slow:nodes=9,factor=4", "nodes=9 must be between 1 and the 8 nodes"),
    ("slow:nodes=1,factor=0.5", "factor=0.5 must be a finite number >= 1"),
    ("slow:nodes=x,factor=2", "nodes='x' is not an integer"),
    ("lognormal:sigma=0.5", "missing seed="),
    ("lognormal:sigma=0.5,seed=0,mu=1", "unknown parameter 'mu=1'"),
    ("trace:/no/such/file.csv", "cannot read it"),
])
def test_bad_speed_specs(spec, match):
    with pytest.raises(speeds.SpeedError, match=match):
        speeds.parse(spec, 8)


# ------------------------------------------------------------------------------ the clock
def test_sync_time_is_the_slowest_node_plus_the_exchange():
    s = speeds.parse("slow:nodes=1,factor=4", 8)
    assert clock.sync_time(s, 10, 0.5, 3.0) == pytest.approx(10 * 0.5 * 4 + 3.0)
    link = clock.Link(8e6, 0.01, overhead=1.0)
    assert link.transfer_s(1e6, rounds=2) == pytest.approx(1.0 + 0.02)
    with pytest.raises(ValueError, match="bandwidth must be"):
        clock.Link(0.0)


def test_links_read_as_the_tools_read_them():
    from gossip.tools import units

    for rate in ("10mbit", "1gbit", "100mbps", "1.5kibit", "2e3kbit"):
        for lat in ("", "0", "5ms", "500us", "0.05s", "0.2"):
            link = clock.parse_link(f"{rate},{lat}" if lat else rate)
            assert link.bandwidth == units.parse_rate(rate) and link.latency == units.parse_time(lat or "0")
    for bad in ("fast", "100M,5ms", "1gbit,soon", "-1gbit"):
        with pytest.raises(ValueError, match="expected"):
            clock.parse_link(bad)


def test_event_clock_order_and_busy_links():
    """Two active nodes share one passive partner: the second waits for the link."""
    s = speeds.parse("uniform", 3)
    c = clock.EventClock(s, 1.0, 0.5, [True, False, True], lambda i, k: 1)
    evs = [c.next() for _ in range(6)]
    got = [(e.node, e.partner, e.time, e.end) for e in evs]
    assert got[:3] == [(0, 1, 1.0, 1.5), (1, None, 1.0, 1.0), (2, 1, 1.5, 2.0)]
    # node 1 computes on meanwhile (passive: never waits); node 0 is next at 1.5 + 1
    assert got[3:] == [(1, None, 2.0, 2.0), (0, 1, 2.5, 3.0), (1, None, 3.0, 3.0)]
    assert c.now == 3.0


def test_event_clock_slow_node_holds_up_no_one():
    s = speeds.parse("slow:nodes=1,factor=4", 8)
    topo = topologies.build("ring", 8)
    algo = algorithms.build("adpsgd", comm.SimulatedCommunicator(topo, world_size=8))
    c = clock.EventClock(s, 1.0, 0.0, algo.active, algo.choose)
    for _ in range(8 * 40):
        c.next()
    assert c.steps[0] * 3 < c.steps[2]  # the slow node computes a quarter as often
    assert 0.9 * 40 * 8 / 7.25 < c.now < 1.1 * 40 * 8 / 7.25  # the gradients at the rate of all nodes together


def test_adpsgd_needs_a_bipartite_graph():
    with pytest.raises(ValueError, match="needs a bipartite graph; ring on 5 nodes is not"):
        algorithms.build("adpsgd", comm.SimulatedCommunicator(topologies.build("ring", 5), world_size=5))
    a = algorithms.build("adpsgd", comm.SimulatedCommunicator(topologies.build("ring", 6), world_size=6))
    assert a.active == [True, False] * 3 and a.partners[0] == [1, 5] and a.partners[1] == []


def test_average_pair_is_the_mean_and_counts_its_bytes():
    c = comm.SimulatedCommunicator(topologies.build("ring", 4), world_size=4)
    a = algorithms.build("adpsgd", c)
    X = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    a.setup(X)
    a.average_pair(X, 0, 3)
    assert X[0].tolist() == X[3].tolist() == [4.5, 5.5, 6.5] and X[1].tolist() == [3, 4, 5]
    nb = a.payload_compressor.payload_nbytes(3)
    assert c.ledger.sent_by(0) == c.ledger.sent_by(3) == nb and c.ledger.sent_by(1) == 0


# ------------------------------------------------------------------------------ training
def _summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_speeds_change_a_synchronous_runs_time_not_its_numbers(tmp_path):
    """D-PSGD at uniform speed and with one node 4x slower: the same losses, bytes and
    parameters bit for bit; the modelled time is the slowest node's compute plus the link."""
    common = ["--simulate", "4", "--algo", "dpsgd", "--epochs", "1", "--max-steps", "6", "--compute-time", "0.5",
              "--link", "8mbit,10ms", *QUICK]
    a, b = tmp_path / "a", tmp_path / "b"
    assert train(*common, "--out", str(a)).returncode == 0
    r = train(*common, "--node-speed", "slow:nodes=1,factor=4", "--out", str(b))
    assert r.returncode == 0, r.stderr
    assert torch.equal(final_params(a), final_params(b))
    for k in range(4):
        ra, rb = read_jsonl(a / f"metrics-rank{k}.jsonl"), read_jsonl(b / f"metrics-rank{k}.jsonl")
        assert [x.get("loss") for x in ra] == [x.get("loss") for x in rb]
    sa, sb = _summary(a), _summary(b)
    per_step = sa["bytes_sent_per_node_per_step"]
    codec_a = sa["time_split_s"]["compress"] / 4
    link = 1.05 * 8 * per_step * 6 / 8e6 + 0.01 * 6
    assert sa["modelled_time_s"] == pytest.approx(6 * 0.5 + link + codec_a, rel=1e-6)
    assert sb["modelled_time_s"] == pytest.approx(6 * 2.0 + link + sb["time_split_s"]["compress"] / 4, rel=1e-6)


def test_adpsgd_beats_dpsgd_with_a_slow_node(tmp_path):
    """8 nodes on a ring, one 4x slower, the same number of gradients: AD-PSGD's modelled
    time is at most 0.6x D-PSGD's and its final accuracy within 2 points."""
    common = ["--simulate", "8", "--epochs", "2", "--node-speed", "slow:nodes=1,factor=4",
              "--compute-time", "0.01", "--lr", "0.1", *QUICK]
    out = {}
    for algo in ("dpsgd", "adpsgd"):
        out[algo] = tmp_path / algo
        r = train(*common, "--algo", algo, "--out", str(out[algo]))
        assert r.returncode == 0, r.stderr
    d, a = _summary(out["dpsgd"]), _summary(out["adpsgd"])
    assert a["steps"] == d["steps"]
    assert a["modelled_time_s"] <= 0.6 * d["modelled_time_s"]
    assert abs(a["final_test_acc"] - d["final_test_acc"]) <= 0.02
    # the same seed and speeds: the same events, the same numbers
    again = tmp_path / "again"
    assert train(*common, "--algo", "adpsgd", "--out", str(again)).returncode == 0
    assert torch.equal(final_params(out["adpsgd"]), final_params(again))


@pytest.mark.parametrize("args, match", [
    (["--node-speed", "slow:nodes=9,factor=4"], "nodes=9 must be between 1 and the 8 nodes"),
    (["--node-speed", "fast"], "--node-speed 'fast': expected uniform"),
    (["--link", "fast"], "--link 'fast'"),
    (["--compute-time", "-1"], "--compute-time must be a finite number > 0"),
    (["--algo", "adpsgd", "--topology", "complete"], "needs a bipartite graph"),
])
def test_bad_input_is_one_line(tmp_path, args, match):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    r = train("--simulate", "8", "--max-steps", "1", *QUICK, *args)
    assert r.returncode != 0
    assert match in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_adpsgd_simulation_resumes_bit_identical(tmp_path):
    """The event clock and every node's update in flight are in the checkpoint: a run
    stopped at step 7 and resumed ends where the uninterrupted run ends, bit for bit,
    with the same modelled time."""
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["--simulate", "4", "--algo", "adpsgd", "--node-speed", "slow:nodes=1,factor=3", "--compute-time",
              "0.01", "--momentum", "0.9", "--epochs", "1", *QUICK]
    assert train(*common, "--out", str(full)).returncode == 0
    r = train(*common, "--out", str(part), "--max-steps", "7", "--checkpoint-every", "3")
    assert r.returncode == 0, r.stderr
    r = train(*common, "--resume", str(part))
    assert r.returncode == 0, r.stderr
    assert torch.equal(final_params(full), final_params(part))
    a, b = _summary(full), _summary(part)
    assert a["steps"] == b["steps"] and a["final_test_loss"] == b["final_test_loss"]
    # the clock's seconds are the same; the codec's are measured (so is what a loaded
    # machine makes of them): the modelled time less the codec's share of each node
    def clock_s(s: dict) -> float:
        return s["modelled_time_s"] - s["time_split_s"]["compress"] / 4

    assert clock_s(a) == pytest.approx(clock_s(b), rel=1e-9)


def test_lockstep_round_against_a_plain_reference():
    """GossipOptimizer's step: updates at the round's start, then in id order each active
    node averages with its drawn partner and each node adds its update."""
    c = comm.SimulatedCommunicator(topologies.build("ring", 6), world_size=6)
    a = algorithms.build("adpsgd", c, seed=5)
    g = torch.Generator().manual_seed(0)
    X, U = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    a.setup(X.clone())
    ref = X.clone()
    for k in range(3):
        for i in range(6):
            if i % 2 == 0:
                j = a.choose(i, k)
                assert j in ((i + 1) % 6, (i - 1) % 6)
                ref[i] = ref[j] = 0.5 * (ref[i] + ref[j])
            ref[i] += U[i]
        a.step(X, U)
    assert torch.allclose(X, ref, atol=1e-6)


@pytest.mark.multiprocess
def test_torchrun_ranks_sleep_for_their_speed_and_compute_the_same_numbers(tmp_path):
    """Under torchrun rank 0 is 3x slower (it sleeps for the difference): the numbers are
    the simulation's, bit for bit, and summary.json models the time."""
    from tests.conftest import why
    from tests.test_train import torchrun, train

    args = ["--algo", "dpsgd", "--topology", "complete", "--epochs", "1", "--max-steps", "4", "--node-speed",
            "slow:nodes=1,factor=3", *QUICK]
    r = torchrun(2, *args, "--out", str(tmp_path / "dist"))
    assert r.returncode == 0, why(r)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the twin in this process, with the ranks' thread count
    try:
        r = train("--simulate", "2", "--simulate-mode", "loop", *args, "--out", str(tmp_path / "sim"))
    finally:
        torch.set_num_threads(threads)
    assert r.returncode == 0, r.stderr
    assert torch.equal(final_params(tmp_path / "dist"), final_params(tmp_path / "sim"))
    s = _summary(tmp_path / "dist")
    assert s["mode"] == "torchrun" and s["modelled_time_s"] > 0


@pytest.mark.multiprocess
def test_adpsgd_under_torchrun_runs_with_no_barrier_and_exits_cleanly(tmp_path):
    """4 ranks on a ring, rank 0 (active) 4x slower: every exchange an active rank starts
    is answered (the passive ranks' replies are as many bytes as the active ranks'
    requests), every rank ends its steps and the launch exits 0 with no abort at exit
    (the passive ranks' serving threads are joined). Refused in one line on every rank:
    --tensorboard, whose mean over the ranks is a barrier at every logged step."""
    from tests.conftest import torchrun_jobs, why

    common = ["--algo", "adpsgd", "--topology", "ring", "--epochs", "1", "--max-steps", "8",
              "--node-speed", "slow:nodes=1,factor=4", *QUICK]
    jobs = [("tensorboard", [*common, "--tensorboard", "--out", str(tmp_path / "tb")]),
            ("run", [*common, "--out", str(tmp_path / "run")])]
    r, codes = torchrun_jobs(4, jobs, timeout=240, cwd=tmp_path)
    assert r.returncode == 0 and codes["run"] == [0, 0, 0, 0], why(r)
    assert "terminate called" not in r.stderr, why(r)
    assert len(codes["tensorboard"]) == 4 and all(c != 0 for c in codes["tensorboard"]), why(r)
    refused = [ln for ln in r.stderr.splitlines() if "gossip.train: error:" in ln]
    assert len(refused) == 4 and all("--tensorboard: its mean over the ranks is a collective" in ln
                                     for ln in refused), r.stderr
    sent = []
    for k in range(4):
        recs = [x for x in read_jsonl(tmp_path / "run" / f"metrics-rank{k}.jsonl") if x["kind"] == "train"]
        assert recs[-1]["step"] == 8
        sent.append(recs[-1]["bytes_sent"])
    assert sent[0] == sent[2] > 0 and sent[0] % 8 == 0, sent  # one model per step from each active rank
    # a passive rank's records trail its replies (it may end its steps before its
    # neighbours' requests): the run's totals, taken after the last reply, add up
    s = _summary(tmp_path / "run")
    assert s["bytes_sent_per_node_total"] * 4 == 2 * (sent[0] + sent[2]), (s["bytes_sent_per_node_total"], sent)
    assert s["mode"] == "torchrun" and s["steps"] == 8 and s["modelled_time_s"] > 0
    assert np.isfinite(s["final_test_acc"])
