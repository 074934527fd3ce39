"""Time-varying topologies (onepeer-exp, matching): W(t), their products and gaps, the
communicators following W(t), D-PSGD on them (simulation = torchrun), and the
algorithms that refuse them."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

import topologies
from gossip import algorithms, comm
from tests._dist import run_world
from tests.conftest import child_env
from tests.test_train import QUICK, _one_error_line, final_params, train


# ------------------------------------------------------------------ topology math
@pytest.mark.parametrize("n", [2, 4, 8, 16, 32])
def test_onepeer_exp_period_product_is_exact_average_for_powers_of_two(n):
    topo = topologies.build("onepeer-exp", n)
    K = int(math.log2(n))
    assert topo.period == K and topo.time_varying and topo.directed
    M = topo.product()
    assert np.array_equal(M, np.full((n, n), 1.0 / n))  # exact, not within tolerance
    f = topo.figures()
    assert f["exact_average"] and f["rho"] == 0.0 and f["spectral_gap"] == 1.0
    assert topo.consensus_steps(1e-3) == K


@pytest.mark.parametrize("n", [8, 6])
def test_onepeer_exp_each_step_sends_to_i_plus_2_to_the_t_and_is_doubly_stochastic(n):
    topo = topologies.build("onepeer-exp", n)
    K = (n - 1).bit_length()
    for t in range(2 * K + 1):
        W = topo.at(t)
        k = 2 ** (t % K)
        Wd = W.to_dense()
        assert np.allclose(Wd.sum(0), 1.0, atol=0, rtol=0) and np.allclose(Wd.sum(1), 1.0, atol=0, rtol=0)
        for i in range(n):
            ids, w = W.neighbors(i)  # whom i receives from
            assert ids.tolist() == [(i - k) % n] and w.tolist() == [0.5]
            assert W.out_neighbors(i).tolist() == [(i + k) % n]
            assert W.self_weight(i) == 0.5
        assert int(W.degrees.max()) == 1
        if 2 * k != n:
            assert not np.array_equal(Wd, Wd.T)  # directed: D-PSGD uses its rows as they are


@pytest.mark.parametrize("n", [3, 5, 6, 12])
def test_onepeer_exp_other_n_is_not_exact_average_and_reports_its_gap(n):
    topo = topologies.build("onepeer-exp", n)
    K = math.ceil(math.log2(n))
    assert topo.period == K
    M = topo.product()
    assert np.allclose(M.sum(0), 1) and np.allclose(M.sum(1), 1)  # still doubly stochastic
    rho = np.linalg.norm(M - 1.0 / n, 2)
    f = topo.figures()
    assert not f["exact_average"] and 0.0 < f["rho"] < 1.0
    assert f["rho"] == pytest.approx(rho, abs=1e-14)
    # two periods contract at least rho^2, by submultiplicativity
    assert np.linalg.norm(topo.product(steps=2 * K) - 1.0 / n, 2) <= rho**2 + 1e-12
    if n == 3:  # (2I + P + P^2)/4 - J/3 has eigenvalues (2 + w + w^2)/4 = 1/4
        assert f["rho"] == pytest.approx(0.25, abs=1e-14)


def test_matching_is_a_seeded_perfect_matching_per_step():
    n = 10
    topo = topologies.build("matching", n, seed=3)
    seen = set()
    for t in range(30):
        p = topo.partners(t)
        assert np.array_equal(p[p], np.arange(n)) and not np.any(p == np.arange(n))
        W = topo.at(t).to_dense()
        assert np.array_equal(W, W.T) and np.array_equal(W.sum(1), np.ones(n))
        seen.add(tuple(p))
    assert len(seen) > 20  # a different matching (almost) every step
    again = topologies.build("matching", n, seed=3)
    assert all(np.array_equal(topo.partners(t), again.partners(t)) for t in (0, 7, 29))
    other = topologies.build("matching", n, seed=4)
    assert any(not np.array_equal(topo.partners(t), other.partners(t)) for t in range(5))


@pytest.mark.parametrize("n", [4, 8])
def test_matching_expected_gap_closed_form_and_monte_carlo(n):
    topo = topologies.build("matching", n, seed=0)
    f = topo.figures()
    assert f["rho"] == pytest.approx((n - 2) / (2 * (n - 1)), abs=1e-15)
    assert f["spectral_gap"] == pytest.approx(n / (2 * (n - 1)), abs=1e-15)
    W = topo.at(0).to_dense()
    assert np.allclose(W.T @ W, W)  # a projection: E[W^T W] = E[W]
    T = 4000
    C = np.zeros((n, n))
    for t in range(T):
        np.add.at(C, (np.arange(n), topo.partners(t)), 1.0)
    E = 0.5 * np.eye(n) + 0.5 * C / T  # the empirical mean of W(t) = (I + P(t))/2
    lam = np.sort(np.linalg.eigvalsh(E))[-2]
    # each entry of E is a mean of T bounded draws: standard error < 0.5/sqrt(T) ~ 0.008
    assert abs(lam - f["rho"]) < 0.05


def test_time_varying_refuses_bad_input_in_one_line():
    with pytest.raises(topologies.TopologyError, match="n must be even"):
        topologies.build("matching", 7)
    with pytest.raises(topologies.TopologyError, match="weights are fixed"):
        topologies.build("onepeer-exp", 8, weights="metropolis")
    with pytest.raises(topologies.TopologyError, match="step t must be an integer >= 0"):
        topologies.build("onepeer-exp", 8).at(-1)
    # a step is validated like a static matrix, short of symmetry and connectivity
    bad = np.eye(4) * 0.5
    bad[0, 1] = 0.6
    with pytest.raises(topologies.TopologyError, match="sum to 1"):
        topologies.Topology(bad, symmetric=False, connected=False)
    with pytest.raises(topologies.TopologyError, match="symmetric spectrum"):
        topologies.build("onepeer-exp", 8).at(0).spectral_gap


def test_cli_onepeer_exp_json(tmp_path):
    r = subprocess.run([sys.executable, "-m", "topologies", "onepeer-exp", "16", "--json"],
                       capture_output=True, text=True, cwd=tmp_path, env=child_env(),
                       timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["name"] == "onepeer-exp" and out["n"] == 16 and out["time_varying"] is True
    assert out["period"] == 4 and out["degree_per_step"] == 1 and out["exact_average"] is True
    assert out["rho"] == 0.0 and out["spectral_gap"] == 1.0 and out["steps_to_1e-3"] == 4
    r = subprocess.run([sys.executable, "-m", "topologies", "matching", "7"], capture_output=True, text=True,
                       cwd=tmp_path, env=child_env(), timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "n must be even" in r.stderr


def test_analysis_rows_for_time_varying_graphs():
    from gossip.tools import analysis

    gaps = analysis.spectral_gaps([8, 12], names=("ring", "onepeer-exp", "matching"))
    one = gaps[gaps.topology == "onepeer-exp"].set_index("n")
    assert one.loc[8, "spectral_gap"] == 1.0 and 0 < one.loc[12, "rho"] < 1 and one["degree"].eq(1).all()
    assert one["lambda2"].isna().all()
    m = gaps[gaps.topology == "matching"].set_index("n")
    assert m.loc[8, "rho"] == pytest.approx(6 / 14)
    curve = analysis.consensus_contraction(topologies.build("onepeer-exp", 12), 16)
    assert (curve.measured <= curve.rho_t + 1e-12).all()  # the period bound holds at every step
    exact = analysis.consensus_contraction(topologies.build("onepeer-exp", 16), 4)
    assert exact.measured.iloc[-1] < 1e-14  # one period: the exact average


# ------------------------------------------------------------------ communicators
def test_simulated_exchange_follows_w_of_t_with_degree_one_traffic():
    n = 8
    topo = topologies.build("onepeer-exp", n)
    c = comm.SimulatedCommunicator(topo, check_sizes=False)
    P = torch.arange(n, dtype=torch.uint8).unsqueeze(1).repeat(1, 5)
    with pytest.raises(ValueError, match="`step`"):
        c.neighbor_exchange(P)
    for t in range(3):
        rec = c.neighbor_exchange(P, step=t)
        k = 2**t
        for i in range(n):
            ids, got = rec.neighbors(i)
            assert ids.tolist() == [(i - k) % n] and got[0, 0].item() == (i - k) % n
    for i in range(n):  # one message of 5 bytes per step, each to a single peer
        assert c.ledger.sent_by(i) == 3 * 5 and c.ledger.received_by(i) == 3 * 5


def _dense_dpsgd(topo, X, A, steps):
    out = []
    for t in range(steps):
        W = torch.as_tensor(topo.at(t).to_dense(), dtype=X.dtype)
        X = W @ X - 0.1 * (X - A)
        out.append(X)
    return out


@pytest.mark.parametrize("name", ["onepeer-exp", "matching"])
def test_dpsgd_on_time_varying_graph_matches_dense_reference(name):
    n, d = 8, 33
    g = torch.Generator().manual_seed(0)
    A = torch.randn(n, d, generator=g)
    X = torch.randn(n, d, generator=g)  # fp32: what goes on the wire
    topo = topologies.build(name, n)
    alg = algorithms.build("dpsgd", comm.SimulatedCommunicator(topo))
    Y = X.clone()
    alg.setup(Y)
    ref = _dense_dpsgd(topo, X, A, 6)
    for t in range(6):
        alg.step(Y, -0.1 * (Y - A))
        torch.testing.assert_close(Y, ref[t], rtol=0, atol=1e-5)


@pytest.mark.parametrize("topology", ["onepeer-exp", "matching"])
@pytest.mark.parametrize("algo", ["dcd", "ecd", "choco"])
def test_replica_algorithms_refuse_time_varying_graphs_in_one_line(algo, topology):
    c = comm.SimulatedCommunicator(topologies.build(topology, 4))
    with pytest.raises(ValueError, match=f"^{algo} keeps replicas of fixed neighbours .*time-varying") as e:
        algorithms.build(algo, c)
    assert "\n" not in str(e.value)
    assert algorithms.DCD.needs_static_graph and algorithms.ECD.needs_static_graph and algorithms.Choco.needs_static_graph
    assert not algorithms.DPSGD.needs_static_graph and not algorithms.Naive.needs_static_graph
    assert not algorithms.SGP.needs_static_graph


def test_cli_refuses_dcd_on_onepeer_exp_and_dpsgd_resumes_bit_identically(tmp_path):
    _one_error_line(train("--simulate", "4", "--algo", "dcd", "--topology", "onepeer-exp", *QUICK,
                          "--out", str(tmp_path / "bad")), "dcd", "time-varying")
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["--simulate", "4", "--algo", "dpsgd", "--topology", "onepeer-exp", *QUICK, "--epochs", "1"]
    assert train(*common, "--out", str(full)).returncode == 0
    r = train(*common, "--out", str(part), "--max-steps", "3", "--checkpoint-every", "3")
    assert r.returncode == 0, r.stderr
    r = train(*common, "--resume", str(part))
    assert r.returncode == 0, r.stderr
    assert torch.equal(final_params(full), final_params(part))
    s = json.loads((full / "summary.json").read_text())
    assert s["topology"] == "onepeer-exp"


# ------------------------------------------------------------------ real processes
STEPS, D = 7, 129


def _problem(n):
    g = torch.Generator().manual_seed(11)
    return torch.randn(n, D, generator=g) * 0.5, torch.randn(D, generator=g)


def _dist_run(name: str, n: int, algo: str, opts: dict):
    import torch.distributed as dist

    topo = topologies.build(name, n, seed=5)
    c = comm.DistCommunicator(topo, timeout=30)
    alg = algorithms.build(algo, c, **opts)
    A, x1 = _problem(n)
    X = x1.clone().unsqueeze(0)
    alg.setup(X)
    r = dist.get_rank()
    out = []
    for _ in range(STEPS):
        alg.step(X, -0.1 * (X - A[r : r + 1]))
        out.append(X[0].clone())
    partners = [topo.partners(t).tolist() for t in range(STEPS)] if name == "matching" else []
    return torch.stack(out), c.ledger.sent_by(r), c.ledger.received_by(r), partners


def sim_run(name: str, n: int, algo: str, opts: dict):
    topo = topologies.build(name, n, seed=5)
    c = comm.SimulatedCommunicator(topo)
    alg = algorithms.build(algo, c, **opts)
    A, x1 = _problem(n)
    X = x1.repeat(n, 1)
    alg.setup(X)
    out = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' thread count
    try:
        for _ in range(STEPS):
            alg.step(X, -0.1 * (X - A))
            out.append(X.clone())
    finally:
        torch.set_num_threads(threads)
    return torch.stack(out, dim=1), c


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["onepeer-exp", "matching"])
def test_dpsgd_simulation_equals_torchrun_bit_for_bit_with_degree_one_traffic(name):
    n = 4
    res = run_world(n, _dist_run, name, n, "dpsgd", {"seed": 5}, timeout=120)
    sim, c = sim_run(name, n, "dpsgd", {"seed": 5})
    payload = algorithms.build("dpsgd", c).compressor.payload_nbytes(D)
    for rank, (traj, sent, received, partners) in enumerate(res):
        assert torch.equal(traj, sim[rank]), f"rank {rank} differs from its simulated twin"
        assert sent == c.ledger.sent_by(rank) and received == c.ledger.received_by(rank)
        # degree 1: one payload per step (and one 16-byte size check), not one per neighbour
        assert sent == STEPS * payload + 16
        if partners:  # every rank drew the same matchings without communicating
            assert partners == res[0][3]
