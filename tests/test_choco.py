"""CHOCO-SGD (``--algo choco``) on the in-process simulator and through the CLI.

References are dense matrices written plainly here: adapt-then-combine D-PSGD
X <- W (X + U) for the identity compressor with gamma = 1, the exact average for
CHOCO-gossip, and the repository's D-PSGD on a label-sorted logistic regression.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess

import numpy as np
import pytest
import torch

import topologies
from gossip import algorithms, compress
from gossip import train as gossip_train
from gossip.comm import SimulatedCommunicator


def make(name, topo, **opts):
    return algorithms.build(name, SimulatedCommunicator(topo), **opts)


def dense_W(topo):
    W = topo.matrix
    W = W.toarray() if hasattr(W, "toarray") else np.asarray(W)
    return torch.tensor(W, dtype=torch.float32)


def quadratic(n, d, seed=0):
    """u_i = -0.1 (x_i - a_i): every node pulled towards its own a_i (non-iid)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randn(d, generator=g)


# ------------------------------------------------------------------ reductions, invariants
@pytest.mark.parametrize("topo_name,n,params", [("ring", 6, {}), ("star", 5, {}), ("expander", 10, {"degree": 3, "seed": 1})])
@pytest.mark.parametrize("start", ["x1", "zero"])
def test_identity_and_gamma_1_is_adapt_then_combine_dpsgd(topo_name, n, params, start):
    topo = topologies.build(topo_name, n, **params)
    W = dense_W(topo)
    A, x1 = quadratic(n, 20)
    X = x1.repeat(n, 1) + 0.1 * torch.randn(n, 20, generator=torch.Generator().manual_seed(3))
    Xr = X.clone()
    alg = make("choco", topo, compressor="identity", gamma=1.0, start=start)
    alg.setup(X)
    for t in range(40):
        alg.step(X, -0.1 * (X - A))
        Xr = W @ (Xr - 0.1 * (Xr - A))  # x^{t+1} = W (x^t - eta g^t)
        torch.testing.assert_close(X, Xr, rtol=1e-5, atol=1e-5, msg=f"step {t + 1}")


@pytest.mark.parametrize("start", ["x1", "zero"])
def test_choco_gossip_with_topk_converges_linearly_to_the_average(start):
    """No gradients (U = 0): the squared distance to the exact average shrinks by a
    factor at least as small every 50 steps, and the average itself never moves."""
    n, d = 8, 200
    topo = topologies.build("ring", n)
    X = torch.randn(n, d, generator=torch.Generator().manual_seed(0))
    mean = X.mean(0)
    alg = make("choco", topo, compressor="topk:p=0.1", gamma=0.1, start=start)
    alg.setup(X)
    errs = []
    for t in range(1, 401):
        alg.step(X, torch.zeros_like(X))
        if t % 50 == 0:
            errs.append(float(((X - mean) ** 2).sum()))
    torch.testing.assert_close(X.mean(0), mean, rtol=0, atol=1e-5)
    ratios = [b / a for a, b in zip(errs, errs[1:])]
    assert max(ratios[2:]) < 0.3, ratios  # geometric, once the estimates have caught up
    assert errs[-1] < 1e-5 * errs[0], errs


@pytest.mark.parametrize("spec,start", [("topk:p=0.1", "x1"), ("sign", "zero"), ("quant:bits=3", "x1")])
def test_every_holder_has_the_same_estimates_and_s_is_their_weighted_sum(spec, start):
    """The invariant that replaces per-neighbour copies: with track_replicas the
    per-neighbour estimates are kept too; each equals the owner's own xhat bit for bit,
    and s_i = sum_j W_ij xhat_j (self included) up to rounding."""
    topo = topologies.build("torus", 9)
    n, d = 9, 37
    A, x1 = quadratic(n, d, seed=4)
    alg = make("choco", topo, compressor=spec, gamma=0.2, start=start, track_replicas=True)
    X = x1.repeat(n, 1)
    alg.setup(X)
    idx, w = topo.padded_neighbors()
    W = dense_W(topo).to(torch.float64)
    for _ in range(25):
        alg.step(X, -0.1 * (X - A))
        s = alg.state
        for i in range(n):
            for k in range(idx.shape[1]):
                if w[i, k] > 0:
                    assert torch.equal(s.replicas[i, k], s.xhat[idx[i, k]]), (i, k)
        dense = (W @ s.xhat.to(torch.float64)).to(torch.float32)
        torch.testing.assert_close(s.mix, dense, rtol=0, atol=1e-5)
    assert alg.replica_drift(X) < 1e-5
    # the untracked run keeps O(d) per node and takes exactly the same steps
    plain = make("choco", topo, compressor=spec, gamma=0.2, start=start)
    X2 = x1.repeat(n, 1)
    plain.setup(X2)
    for _ in range(25):
        plain.step(X2, -0.1 * (X2 - A))
    assert plain.state.replicas.numel() == 0 and plain.state.mix.shape == (n, d)
    assert torch.equal(X2, X)


def test_an_unbiased_compressor_is_used_as_q_over_1_plus_omega():
    """randk keeps k of d values scaled by d/k, omega = d/k - 1: divided by 1 + omega,
    what is added to the estimates is the k values themselves, unscaled."""
    topo = topologies.build("ring", 4)
    d = 40
    alg = make("choco", topo, compressor="randk:k=10", gamma=0.5, start="zero")
    X = torch.randn(4, d, generator=torch.Generator().manual_seed(2))
    alg.setup(X)
    x = X.clone()
    alg.step(X, torch.zeros_like(X))
    xhat = alg.state.xhat
    kept = xhat != 0
    assert bool((kept.sum(1) == 10).all())
    torch.testing.assert_close(xhat[kept], x[kept], rtol=1e-6, atol=1e-7)


def test_state_round_trip_gives_a_bit_identical_continuation():
    topo = topologies.build("ring", 5)
    n, d = 5, 30
    A, x1 = quadratic(n, d, seed=8)
    for spec in ("topk:p=0.2", "quant:bits=4"):
        a1 = make("choco", topo, compressor=spec, seed=3)
        X1 = x1.repeat(n, 1)
        a1.setup(X1)
        for _ in range(7):
            a1.step(X1, -0.1 * (X1 - A))
        sd, Xs = a1.state_dict(), X1.clone()
        for _ in range(5):
            a1.step(X1, -0.1 * (X1 - A))
        a2 = make("choco", topo, compressor=spec, seed=3)
        X2 = Xs.clone()
        a2.setup(torch.zeros_like(X2))  # a fresh start, overwritten by the state
        a2.load_state_dict(sd)
        for _ in range(5):
            a2.step(X2, -0.1 * (X2 - A))
        assert torch.equal(X1, X2), spec


def test_setup_traffic_is_counted_as_setup_and_steps_send_one_payload_per_neighbour():
    topo = topologies.build("ring", 4)
    d = 1000
    X = torch.randn(4, d, generator=torch.Generator().manual_seed(0))
    check = 4 * 2 * 16  # the communicator's 16-byte size check per neighbour, once per payload size
    for start, setup_bytes in (("x1", 4 * 2 * compress.build("identity").payload_nbytes(d) + check), ("zero", 0)):
        c = SimulatedCommunicator(topo)
        alg = algorithms.build("choco", c, compressor="topk:p=0.01", start=start)
        alg.setup(X.clone())
        assert c.ledger.setup_bytes_sent == setup_bytes, start
        Y = X.clone()
        for _ in range(3):
            alg.step(Y, torch.zeros_like(Y))
        per_step = 4 * 2 * compress.build("topk:p=0.01").payload_nbytes(d)
        assert c.ledger.step_bytes_sent == 3 * per_step + check, start
    assert alg.needs_static_graph and alg.wire_format().label == "topk:p=0.01"


# ------------------------------------------------------------------ local steps
def ledger_run(spec, steps, **opts):
    """choco on a ring of 5 with a fixed pull per node; the final models and the ledger."""
    topo = topologies.build("ring", 5)
    c = SimulatedCommunicator(topo)
    alg = algorithms.build("choco", c, compressor=spec, seed=2, **opts)
    A, x1 = quadratic(5, 30, seed=6)
    X = x1.repeat(5, 1)
    alg.setup(X)
    for _ in range(steps):
        alg.step(X, -0.1 * (X - A))
    return X, c.ledger.as_dict(), alg


@pytest.mark.parametrize("spec", ["topk:p=0.1", "quant:bits=4"])
def test_local_steps_1_is_choco_bit_for_bit(spec):
    ref, led, _ = ledger_run(spec, 9)
    got, led1, alg = ledger_run(spec, 9, local_steps=1)
    assert torch.equal(got, ref) and led1["bytes"] == led["bytes"] and alg.period == 1


def test_local_steps_h_gossips_every_h_steps_with_1_over_h_of_the_bytes():
    """Steps H, 2H, ... are choco's steps exactly (a plain choco stepped only there, the
    local updates added in between by hand, ends bit for bit where H does); the steps in
    between send nothing and leave the estimates alone."""
    H, steps = 4, 12
    topo = topologies.build("ring", 5)
    A, x1 = quadratic(5, 30, seed=6)
    c_h, c_1 = SimulatedCommunicator(topo), SimulatedCommunicator(topo)
    alg = algorithms.build("choco", c_h, compressor="topk:p=0.1", local_steps=H)
    ref = algorithms.build("choco", c_1, compressor="topk:p=0.1")
    X, Xr = x1.repeat(5, 1), x1.repeat(5, 1)
    alg.setup(X)
    ref.setup(Xr)
    for t in range(1, steps + 1):
        before = alg.state.xhat.clone()
        alg.step(X, -0.1 * (X - A))
        if t % H:
            Xr.add_(-0.1 * (Xr - A))
            assert torch.equal(alg.state.xhat, before), t
        else:
            ref.step(Xr, -0.1 * (Xr - A))
        assert torch.equal(X, Xr), t
    assert alg.state.t == steps + 1 and alg.period == H
    # bytes: 1/H of H = 1's over the same 12 steps (one payload to each of 2 neighbours per
    # gossip step), the setup exchange of x_1 the same
    def gossip_bytes(led):
        setup = led["setup"]["sent"] - led["setup"]["control"]["sent"]
        return led["ops"]["exchange"]["sent"] - setup

    _, full, _ = ledger_run("topk:p=0.1", steps)
    _, led, _ = ledger_run("topk:p=0.1", steps, local_steps=H)
    payload = compress.build("topk:p=0.1").payload_nbytes(30)
    assert gossip_bytes(full) == 5 * 2 * payload * steps
    assert gossip_bytes(led) == gossip_bytes(full) // H == 5 * 2 * payload * (steps // H)
    assert led["ops"]["exchange"]["calls"] == 1 + steps // H and led["setup"] == full["setup"]


def test_local_steps_resume_in_the_middle_of_a_round_is_bit_identical():
    topo = topologies.build("ring", 5)
    A, x1 = quadratic(5, 30, seed=8)
    a1 = make("choco", topo, compressor="sign", local_steps=3)
    X1 = x1.repeat(5, 1)
    a1.setup(X1)
    for _ in range(7):  # t = 8 next: the second step of the third round
        a1.step(X1, -0.1 * (X1 - A))
    sd, Xs = a1.state_dict(), X1.clone()
    for _ in range(5):
        a1.step(X1, -0.1 * (X1 - A))
    a2 = make("choco", topo, compressor="sign", local_steps=3)
    X2 = Xs.clone()
    a2.setup(torch.zeros_like(X2))
    a2.load_state_dict(sd)
    for _ in range(5):
        a2.step(X2, -0.1 * (X2 - A))
    assert sd["t"] == 8 and torch.equal(X1, X2)
    with pytest.raises(TypeError, match=r"Arg `local_steps` must be an integer, got float 2\.5"):
        algorithms.ChocoConfig(local_steps=2.5)


# ------------------------------------------------------------------ heterogeneous problem
def logistic_problem(n=8, d=800, per_node=384, seed=0):
    """Label-sorted shards: nodes 0-3 hold (almost) only label 0, nodes 4-7 label 1."""
    g = torch.Generator().manual_seed(seed)
    w_true = torch.randn(d, generator=g)
    F = torch.randn(n * per_node, d, generator=g)
    y = (F @ w_true / d**0.5 + torch.randn(n * per_node, generator=g) > 0).float()
    order = torch.argsort(y, stable=True)
    return F[order].view(n, per_node, d), y[order].view(n, per_node)


def logistic_loss_grad(F, y, X):
    z = torch.einsum("npd,nd->np", F, X)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(z, y, reduction="none").mean(1)
    return loss, torch.einsum("np,npd->nd", torch.sigmoid(z) - y, F) / F.shape[1]


def train_logistic(name, F, y, steps=400, lr=0.5, **opts):
    """lr_t = lr * 10 / (t + 10); returns the loss of the averaged model and the bytes sent."""
    n, _, d = F.shape
    c = SimulatedCommunicator(topologies.build("ring", n))
    alg = algorithms.build(name, c, **opts)
    X = torch.zeros(n, d)
    alg.setup(X)
    for t in range(steps):
        _, G = logistic_loss_grad(F, y, X)
        alg.step(X, -lr * 10 / (t + 10) * G)
    xbar = X.mean(0, keepdim=True).expand(n, d).contiguous()
    return float(logistic_loss_grad(F, y, xbar)[0].mean()), c.ledger.bytes_sent


@pytest.fixture
def one_thread():
    """The three trainings are many small steps: one thread is faster on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_heterogeneous_topk_and_sign_reach_dpsgd_loss_with_a_twentieth_of_the_bytes(one_thread):
    F, y = logistic_problem()
    base, base_bytes = train_logistic("dpsgd", F, y)
    for spec in ("topk:p=0.01", "sign"):
        loss, sent = train_logistic("choco", F, y, compressor=spec)  # default gamma
        assert loss <= 1.05 * base, (spec, loss, base)
        assert sent * 20 <= base_bytes, (spec, sent, base_bytes)  # setup traffic included
    # the unbiased-only algorithms cannot take these compressors at all
    with pytest.raises(ValueError, match="choco"):
        train_logistic("dcd", F, y, compressor="topk:p=0.01")


# ------------------------------------------------------------------ declarations, bad input
def test_algorithms_that_keep_estimates_of_fixed_neighbours_say_so():
    c = SimulatedCommunicator(topologies.build("ring", 4))
    static = {n for n in algorithms.available() if algorithms.build(n, c).needs_static_graph}
    # the replica keepers, and AD-PSGD, whose active/passive split is a 2-colouring of the graph
    assert static == {"dcd", "ecd", "choco", "adpsgd"}


@pytest.mark.parametrize("algo", ["dcd", "ecd", "naive"])
@pytest.mark.parametrize("spec", ["topk:p=0.01", "sign", "randomk:p=0.1"])
def test_unbiased_only_algorithms_refuse_a_biased_compressor_pointing_at_choco(algo, spec):
    c = SimulatedCommunicator(topologies.build("ring", 4))
    with pytest.raises(ValueError) as e:
        algorithms.build(algo, c, compressor=spec)
    msg = str(e.value)
    assert "\n" not in msg and f"of {algo} must be unbiased" in msg and spec in msg and "'choco'" in msg, msg


@pytest.mark.parametrize("opts,pattern", [
    ({"gamma": 0}, r"Arg `gamma` \(consensus step\) must be a number in \(0, 1\], got 0"),
    ({"gamma": 1.5}, r"Arg `gamma` .* got 1\.5"),
    ({"gamma": float("nan")}, r"Arg `gamma` .* got nan"),
    ({"gamma": "0.1"}, r"Arg `gamma` .* got '0\.1'"),
    ({"start": "ones"}, r"Arg `start` must be one of 'x1', 'zero', got 'ones'"),
    ({"compressor": "fp16"}, r"Arg `compressor` of choco must be a contraction or unbiased, got 'fp16'.*accepted: .*topk"),
    ({"compressor": "topk:p=2"}, r"topk: parameter `p`"),
    ({"seed": -1}, r"Arg `seed` must be >= 0"),
    ({"local_steps": 0}, r"Arg `local_steps` must be >= 1, got 0"),
    ({"gamma_": 0.1}, r"choco: .*unexpected keyword argument 'gamma_'; accepted options: compressor, gamma, seed, start"),
])
def test_bad_config_is_one_line(opts, pattern):
    c = SimulatedCommunicator(topologies.build("ring", 4))
    with pytest.raises(ValueError, match=pattern) as e:
        algorithms.build("choco", c, **opts)
    assert "\n" not in str(e.value)


def test_track_replicas_must_be_a_bool():
    with pytest.raises(TypeError, match=r"Arg `track_replicas` must be a bool, got 'yes'"):
        algorithms.ChocoConfig(track_replicas="yes")


# ------------------------------------------------------------------ the CLI
QUICK = ["--data", "synthetic", "--epochs", "1", "--batch-size", "64", "--no-progress"]


def cli(*args: str) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = gossip_train.main(list(args))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def final_params(run_dir):
    from gossip import checkpoint

    step = max(int(p.name.split("-step")[1].split("-")[0]) for p in run_dir.glob("ckpt-step*-rank*.pt"))
    files = sorted(run_dir.glob(f"ckpt-step{step}-rank*.pt"), key=lambda p: int(p.stem.split("rank")[1]))
    return torch.cat([checkpoint.load_checkpoint(f)["optimizer"]["params"] for f in files])


def test_cli_runs_choco_and_resumes_bit_identically(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["--simulate", "4", "--algo", "choco", "--compressor", "topk:p=0.01", "--algo-opt", "gamma=0.2", *QUICK]
    r = cli(*common, "--out", str(full))
    assert r.returncode == 0, r.stderr
    s = json.loads((full / "summary.json").read_text())
    cfg = json.loads((full / "config.json").read_text())
    assert s["algo"] == "choco" and cfg["algo_options"] == {"gamma": 0.2}
    assert s["compressor"] == "topk:p=0.01" and s["steps"] > 10
    assert 0 < s["bytes_ratio_to_dpsgd"] < 0.05  # top-1%: 8 bytes per kept value plus a header
    r = cli(*common, "--out", str(part), "--max-steps", "7", "--checkpoint-every", "3")
    assert r.returncode == 0, r.stderr
    r = cli(*common, "--resume", str(part))
    assert r.returncode == 0, r.stderr
    assert torch.equal(final_params(full), final_params(part))
    b = json.loads((part / "summary.json").read_text())
    assert (b["steps"], b["final_test_loss"]) == (s["steps"], s["final_test_loss"])


def test_cli_local_steps_resumes_mid_round_and_sends_once_per_round(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["--simulate", "4", "--algo", "choco", "--compressor", "topk:p=0.01", "--algo-opt", "local_steps=3", *QUICK]
    r = cli(*common, "--out", str(full))
    assert r.returncode == 0, r.stderr
    s = json.loads((full / "summary.json").read_text())
    assert json.loads((full / "config.json").read_text())["algo_options"] == {"local_steps": 3}
    # ring of 4: one top-1% payload to each of 2 neighbours at steps 3, 6, ...; one size check
    # each; and x_1 once at the start
    payload = compress.build("topk:p=0.01").payload_nbytes(s["params"])
    gossip = (s["steps"] // 3) * 2 * payload + 2 * 16
    assert s["bytes_sent_per_node_total"] == s["setup_bytes_per_node"] + gossip
    assert s["bytes_sent_per_node_per_step"] == gossip / s["steps"]
    r = cli(*common, "--out", str(part), "--max-steps", "7", "--checkpoint-every", "5")  # step 5: mid-round
    assert r.returncode == 0, r.stderr
    r = cli(*common, "--resume", str(part))
    assert r.returncode == 0, r.stderr
    assert torch.equal(final_params(full), final_params(part))
    b = json.loads((part / "summary.json").read_text())
    assert (b["steps"], b["final_test_loss"]) == (s["steps"], s["final_test_loss"])


@pytest.mark.parametrize("args,needles", [
    (["--algo", "dcd", "--compressor", "topk:p=0.01"], ["dcd must be unbiased", "'choco'"]),
    (["--algo", "naive", "--compressor", "sign"], ["naive must be unbiased", "'choco'"]),
    (["--algo", "choco", "--algo-opt", "gamma=2"], ["gamma", "(0, 1]"]),
    (["--algo", "choco", "--compressor", "fp16"], ["choco", "contraction or unbiased"]),
    (["--algo", "choco", "--algo-opt", "local_steps=0"], ["local_steps", ">= 1", "got 0"]),
])
def test_cli_bad_input_is_one_line(args, needles):
    r = cli("--simulate", "4", *args, *QUICK)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("gossip.train: error:"), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
