"""Single-process algorithm tests on the in-process simulator.

Each algorithm is checked against a dense-matrix reference written plainly here
(X <- W X + U and its compressed variants), fed the very payloads the algorithm put
on the wire, plus the paper's invariants and the identity-compressor reductions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import topologies
from gossip import algorithms, compress
from gossip.algorithms._common import node_keys, step_tag
from gossip.comm import SimulatedCommunicator


class Recorder:
    """Wraps a compressor and keeps every batch of payloads it encodes."""

    def __init__(self, inner):
        self.inner = inner
        self.encoded = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, X, keys, tag=0, out=None):
        P = self.inner.encode(X, keys, tag=tag, out=out)
        self.encoded.append(P.clone())
        return P

    def decode(self, P, numel, tag=None, out=None, *, share=False):
        return self.inner.decode(P, numel, tag=tag, out=out, share=share)


def quadratic_problem(n, d, seed=0):
    """f_i(x) = 0.5 x^T A_i x - b_i^T x with different A_i, b_i per node (non-iid)."""
    g = torch.Generator().manual_seed(seed)
    M = torch.randn(n, d, d, generator=g) / d**0.5
    A = M @ M.transpose(1, 2) + 0.5 * torch.eye(d)
    b = torch.randn(n, d, generator=g)
    x1 = torch.randn(d, generator=g)
    return A, b, x1


def grads(A, b, X):
    return torch.einsum("nij,nj->ni", A, X) - b


def dense_W(topo):
    W = topo.matrix
    W = W.toarray() if hasattr(W, "toarray") else np.asarray(W)
    return torch.tensor(W, dtype=torch.float32)


def make(name, topo, **opts):
    comm = SimulatedCommunicator(topo)
    return algorithms.build(name, comm, **opts)


TOPOS = [
    ("ring", 6, {}),
    ("torus", 9, {}),
    ("star", 5, {}),  # irregular: Metropolis-Hastings weights
]


@pytest.mark.parametrize("topo_name,n,params", TOPOS)
@pytest.mark.parametrize("algo,spec", [("dpsgd", None), ("naive", "quant:bits=4"), ("dcd", "quant:bits=6"), ("ecd", "quant:bits=6")])
def test_matches_dense_reference(topo_name, n, params, algo, spec):
    topo = topologies.build(topo_name, n, **params)
    W = dense_W(topo)
    d, gamma, T = 12, 0.05, 12
    A, b, x1 = quadratic_problem(n, d)
    opts = {} if spec is None else {"compressor": spec}
    alg = make(algo, topo, seed=3, **opts)
    X = x1.repeat(n, 1)
    alg.setup(X)
    rec = Recorder(alg.compressor)
    alg.compressor = rec
    C = lambda i: rec.inner.decode(rec.encoded[i], d)  # what went on the wire at step i

    Xr = X.clone()
    est = X.clone()  # ECD estimates (identical on all holders)
    for t in range(1, T + 1):
        U = -gamma * grads(A, b, X)
        Ur = -gamma * grads(A, b, Xr)
        alg.step(X, U)
        diagW = torch.diag(W).unsqueeze(1)
        if algo == "dpsgd":
            Xr = W @ Xr + Ur
        elif algo == "naive":
            Xr = diagW * Xr + (W - torch.diag(torch.diag(W))) @ C(t - 1) + Ur
        elif algo == "dcd":
            half = W @ Xr + Ur  # replicas equal the models
            _same_message(rec, t, half - Xr)
            Xr = Xr + C(t - 1)
        elif algo == "ecd":
            nxt = W @ est + Ur
            _same_message(rec, t, (1 - t / 2) * Xr + (t / 2) * nxt)
            est = (1 - 2 / t) * est + (2 / t) * C(t - 1)
            Xr = nxt
        torch.testing.assert_close(X, Xr, rtol=1e-4, atol=1e-5, msg=f"{algo} step {t}")


def test_reference_uses_the_same_payloads_as_a_fresh_encode():
    """The keys the algorithm uses are node_keys(seed, node, t): re-encoding reproduces them."""
    topo = topologies.build("ring", 4)
    alg = make("dcd", topo, compressor="quant:bits=4", seed=7)
    d = 10
    X = torch.randn(4, d)
    alg.setup(X.clone())
    rec = Recorder(alg.compressor)
    alg.compressor = rec
    Xa = X.clone()
    U = torch.randn(4, d) * 0.1
    Z = alg.state.mix + U - Xa
    alg.step(Xa, U)
    again = rec.inner.encode(Z, node_keys(7, torch.arange(4), 1), tag=step_tag(1))
    assert torch.equal(again, rec.encoded[0])


def _same_message(rec, t, Z):
    """The algorithm compressed what the reference says it should: re-encoding the
    reference's Z with the same keys gives the same values, except that an element the
    two computations put on either side of a rounding boundary may move by one level."""
    d = Z.shape[1]
    mine = rec.inner.decode(rec.inner.encode(Z, node_keys(3, torch.arange(Z.shape[0]), t), tag=step_tag(t)), d)
    sent = rec.inner.decode(rec.encoded[t - 1], d)
    level = (Z.max(1, keepdim=True).values - Z.min(1, keepdim=True).values) / (2**6 - 1)  # the tests use quant:bits=6
    assert bool(((mine - sent).abs() <= level * 1.001 + 1e-6).all()), f"step {t}"
    same_level = (mine - sent).abs() <= level * 1e-3
    assert float(same_level.float().mean()) > 0.9, f"step {t}"


def _dyadic(shape, gen, scale=64):
    return torch.randint(-scale, scale, shape, generator=gen).to(torch.float32) / scale


@pytest.mark.parametrize("algo", ["dcd", "ecd"])
def test_identity_compressor_reduces_to_dpsgd_bit_for_bit_when_arithmetic_is_exact(algo):
    """On a complete graph of 4 (weights 1/4) with dyadic data every operation is exact,
    so any difference would be the algorithm's, not rounding's. DCD for 5 steps; ECD for
    t = 1 (coefficient -1) and t = 2, the steps whose coefficients are dyadic."""
    topo = topologies.build("complete", 4)
    g = torch.Generator().manual_seed(0)
    d = 16
    x1 = _dyadic((1, d), g).repeat(4, 1)
    ref = make("dpsgd", topo)
    alg = make(algo, topo, compressor="identity")
    Xr, X = x1.clone(), x1.clone()
    ref.setup(Xr)
    alg.setup(X)
    steps = 5 if algo == "dcd" else 2
    for t in range(steps):
        U = _dyadic((4, d), g) / 16
        ref.step(Xr, U)
        alg.step(X, U)
        assert torch.equal(X, Xr), f"{algo} differs from dpsgd at step {t + 1}"


@pytest.mark.parametrize("algo", ["dcd", "ecd"])
@pytest.mark.parametrize("topo_name,n", [("ring", 8), ("expander", 10)])
def test_identity_compressor_reduces_to_dpsgd_to_rounding(algo, topo_name, n):
    params = {"degree": 3, "seed": 1} if topo_name == "expander" else {}
    topo = topologies.build(topo_name, n, **params)
    d = 20
    A, b, x1 = quadratic_problem(n, d, seed=2)
    ref = make("dpsgd", topo)
    alg = make(algo, topo, compressor="identity")
    Xr, X = x1.repeat(n, 1), x1.repeat(n, 1)
    ref.setup(Xr)
    alg.setup(X)
    for _ in range(50):
        ref.step(Xr, -0.05 * grads(A, b, Xr))
        alg.step(X, -0.05 * grads(A, b, X))
    torch.testing.assert_close(X, Xr, rtol=1e-4, atol=1e-5)


def test_dcd_replicas_equal_models_exactly():
    topo = topologies.build("torus", 9)
    n, d = 9, 15
    A, b, x1 = quadratic_problem(n, d, seed=4)
    alg = make("dcd", topo, compressor="quant:bits=3", track_replicas=True)
    X = x1.repeat(n, 1)
    alg.setup(X)
    idx, w = topo.padded_neighbors()
    for _ in range(25):
        alg.step(X, -0.05 * grads(A, b, X))
        R = alg.state.replicas
        for i in range(n):
            for k in range(idx.shape[1]):
                if w[i, k] > 0:
                    assert torch.equal(R[i, k], X[idx[i, k]]), (i, k)
    # the running weighted sum stands for the replicas up to float rounding
    assert alg.replica_drift(X) < 1e-5


def test_ecd_estimates_identical_on_every_holder():
    topo = topologies.build("ring", 7)
    n, d = 7, 11
    A, b, x1 = quadratic_problem(n, d, seed=5)
    alg = make("ecd", topo, compressor="quant:bits=4", track_replicas=True)
    X = x1.repeat(n, 1)
    alg.setup(X)
    idx, w = topo.padded_neighbors()
    for _ in range(20):
        alg.step(X, -0.05 * grads(A, b, X))
        R, own = alg.state.replicas, alg.state.self_estimate
        for i in range(n):
            for k in range(idx.shape[1]):
                if w[i, k] > 0:
                    assert torch.equal(R[i, k], own[idx[i, k]]), (i, k)
    assert alg.replica_drift(X) < 1e-4


def test_dpsgd_average_follows_mean_update():
    topo = topologies.build("expander", 12, degree=4, seed=0)
    n, d = 12, 9
    A, b, x1 = quadratic_problem(n, d, seed=6)
    g = torch.Generator().manual_seed(1)
    X = x1.repeat(n, 1) + 0.1 * torch.randn(n, d, generator=g)
    alg = make("dpsgd", topo)
    alg.setup(X)
    for _ in range(30):
        U = -0.05 * grads(A, b, X)
        expect = X.mean(0) + U.mean(0)
        alg.step(X, U)
        torch.testing.assert_close(X.mean(0), expect, rtol=1e-5, atol=1e-6)


def test_state_roundtrip_gives_identical_continuation():
    topo = topologies.build("ring", 5)
    n, d = 5, 8
    A, b, x1 = quadratic_problem(n, d, seed=8)
    for name in ["dcd", "ecd", "naive", "dpsgd"]:
        opts = {} if name == "dpsgd" else {"compressor": "quant:bits=5"}
        a1 = make(name, topo, **opts)
        X1 = x1.repeat(n, 1)
        a1.setup(X1)
        for _ in range(7):
            a1.step(X1, -0.05 * grads(A, b, X1))
        sd, Xs = a1.state_dict(), X1.clone()
        for _ in range(5):
            a1.step(X1, -0.05 * grads(A, b, X1))
        a2 = make(name, topo, **opts)
        X2 = Xs.clone()
        a2.setup(X2.clone())
        a2.load_state_dict(sd)
        for _ in range(5):
            a2.step(X2, -0.05 * grads(A, b, X2))
        assert torch.equal(X1, X2), name


def test_config_validation_messages():
    topo = topologies.build("ring", 4)
    comm = SimulatedCommunicator(topo)
    with pytest.raises(ValueError, match="unknown algorithm 'nope'; known: allreduce"):
        algorithms.build("nope", comm)
    with pytest.raises(ValueError, match="must be unbiased"):
        algorithms.build("dcd", comm, compressor="topk:k=3")
    with pytest.raises(ValueError, match="accepted options"):
        algorithms.build("ecd", comm, bits=8)
    with pytest.raises(ValueError, match="Arg `seed` must be >= 0"):
        algorithms.build("ecd", comm, seed=-1)
    with pytest.raises(ValueError, match="precision"):
        algorithms.build("dpsgd", comm, precision="fp8")


def logistic_problem(n, d=10, per_node=64, seed=0, sorted_split=True):
    g = torch.Generator().manual_seed(seed)
    w_true = torch.randn(d, generator=g)
    Xs = torch.randn(n * per_node, d, generator=g)
    y = (Xs @ w_true + 0.5 * torch.randn(n * per_node, generator=g) > 0).float()
    if sorted_split:  # label-sorted shards: strongly non-identical local data
        order = torch.argsort(y, stable=True)
        Xs, y = Xs[order], y[order]
    return Xs.view(n, per_node, d), y.view(n, per_node)


def logistic_loss_grad(F, y, X):
    z = torch.einsum("npd,nd->np", F, X)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(z, y, reduction="none").mean(1)
    grad = torch.einsum("np,npd->nd", torch.sigmoid(z) - y, F) / F.shape[1]
    return loss, grad


def train(name, topo, F, y, steps=300, lr=0.5, **opts):
    n, _, d = F.shape
    alg = make(name, topo, **opts)
    X = torch.zeros(n, d)
    alg.setup(X)
    for _ in range(steps):
        _, G = logistic_loss_grad(F, y, X)
        alg.step(X, -lr * G)
    xbar = X.mean(0, keepdim=True).expand(n, d)
    return float(logistic_loss_grad(F, y, xbar.contiguous())[0].mean())


def test_convergence_compressed_close_to_dpsgd_and_naive_worse():
    n = 8
    topo = topologies.build("ring", n)
    F, y = logistic_problem(n)
    base = train("dpsgd", topo, F, y)
    dcd8 = train("dcd", topo, F, y, compressor="quant:bits=8")
    ecd8 = train("ecd", topo, F, y, compressor="quant:bits=8")
    assert dcd8 <= base * 1.05, (dcd8, base)
    assert ecd8 <= base * 1.05, (ecd8, base)
    naive2 = train("naive", topo, F, y, compressor="quant:bits=2")
    dcd2 = train("dcd", topo, F, y, compressor="quant:bits=2")
    assert naive2 > dcd2, (naive2, dcd2)
