"""Tests of the topologies package: builders, weight rules, validation, spectra.

The checks of the matrices are written out here with numpy and networkx rather than
by calling the package's own validation, so a bug there cannot hide a bug elsewhere.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import time

import networkx as nx
import numpy as np
import pytest
import scipy.sparse as sp
from scipy.sparse.linalg import LinearOperator, eigsh

import topologies
from topologies import Topology, TopologyError, spectral

from tests.conftest import REPO


def dense(topo: Topology) -> np.ndarray:
    return topo.to_dense()


def assert_mixing_matrix(W: np.ndarray) -> None:
    """Symmetric, non-negative, doubly stochastic (1e-12), connected."""
    n = W.shape[0]
    assert W.shape == (n, n)
    np.testing.assert_array_equal(W, W.T)
    assert (W >= 0).all()
    assert np.abs(W.sum(axis=0) - 1).max() <= 1e-12
    assert np.abs(W.sum(axis=1) - 1).max() <= 1e-12
    G = nx.from_numpy_array(W - np.diag(np.diag(W)))
    assert nx.is_connected(G)


# ------------------------------------------------------------------ the package
def test_never_imports_torch():
    code = (
        "import sys, topologies, topologies.__main__, topologies.spectral;"
        "topologies.build('expander', 16).rho;"
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_public_surface():
    assert set(topologies.__all__) >= {
        "Topology", "TopologyError", "build", "available", "ring", "torus", "expander",
        "complete", "exponential", "hypercube", "star", "from_graph", "from_adjacency",
    }
    for name in topologies.__all__:
        assert hasattr(topologies, name)
    assert issubclass(TopologyError, ValueError)
    assert list(topologies.available()) == [
        "complete", "expander", "exponential", "hypercube", "matching", "onepeer-exp", "ring", "star", "torus"
    ]


# ------------------------------------------------------------- closed forms
@pytest.mark.parametrize("n", [3, 4, 5, 8, 9, 16, 33, 100])
def test_ring_closed_form(n):
    topo = topologies.ring(n)
    W = dense(topo)
    assert np.all(W[W > 0] == 1 / 3)
    assert topo.lambda2 == pytest.approx((1 + 2 * math.cos(2 * math.pi / n)) / 3, abs=1e-12)
    lambdan = -1 / 3 if n % 2 == 0 else (1 - 2 * math.cos(math.pi / n)) / 3
    assert topo.lambdan == pytest.approx(lambdan, abs=1e-12)
    assert topo.rho == pytest.approx(max(abs(topo.lambda2), abs(lambdan)), abs=1e-12)
    assert topo.spectral_gap == pytest.approx(1 - topo.rho, abs=1e-12)


@pytest.mark.parametrize("m", [3, 4, 5, 6, 7, 10, 16])
def test_square_torus_closed_form(m):
    topo = topologies.torus(m * m)
    assert (topo.params["rows"], topo.params["cols"]) == (m, m)
    assert np.all(dense(topo)[dense(topo) > 0] == 1 / 5)
    assert topo.lambda2 == pytest.approx((3 + 2 * math.cos(2 * math.pi / m)) / 5, abs=1e-12)
    if m % 2 == 0:
        assert topo.lambdan == pytest.approx(-3 / 5, abs=1e-12)


@pytest.mark.parametrize("rows, cols", [(3, 4), (3, 7), (4, 9), (5, 8)])
def test_rectangular_torus_closed_form(rows, cols):
    topo = topologies.torus(rows * cols, rows=rows, cols=cols)
    a = np.cos(2 * np.pi * np.arange(rows) / rows)
    b = np.cos(2 * np.pi * np.arange(cols) / cols)
    ev = np.sort((1 + 2 * a[:, None] + 2 * b[None, :]).ravel() / 5)
    assert topo.lambda2 == pytest.approx(ev[-2], abs=1e-12)
    assert topo.lambdan == pytest.approx(ev[0], abs=1e-12)


@pytest.mark.parametrize("n", [2, 3, 7, 64, 300])
def test_complete_graph_has_rho_zero(n):
    topo = topologies.complete(n)
    np.testing.assert_allclose(dense(topo), np.full((n, n), 1 / n), rtol=0, atol=1e-16)
    assert topo.rho == 0.0
    assert topo.spectral_gap == 1.0
    assert topo.consensus_steps() == 1


@pytest.mark.parametrize("dim", [1, 2, 3, 5, 8])
def test_hypercube_closed_form(dim):
    topo = topologies.hypercube(2**dim)
    assert topo.degrees.tolist() == [dim] * 2**dim
    assert topo.lambda2 == pytest.approx(1 - 2 / (dim + 1), abs=1e-12)
    assert topo.lambdan == pytest.approx(-1 + 2 / (dim + 1), abs=1e-12)


@pytest.mark.parametrize("n", [3, 10, 57])
def test_star_metropolis_closed_form(n):
    topo = topologies.star(n)  # W_0j = 1/n, W_00 = 1/n, W_jj = 1 - 1/n
    assert topo.params["weights"] == "metropolis"
    assert topo.lambda2 == pytest.approx(1 - 1 / n, abs=1e-12)
    assert topo.lambdan == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("n", [6, 7, 20])
def test_lazy_halves_the_spectrum(n):
    plain, lazy = topologies.ring(n), topologies.ring(n, lazy=True)
    np.testing.assert_allclose(dense(lazy), (np.eye(n) + dense(plain)) / 2, rtol=0, atol=1e-16)
    assert lazy.params["lazy"] is True
    assert lazy.lambda2 == pytest.approx((1 + plain.lambda2) / 2, abs=1e-12)
    assert lazy.lambdan == pytest.approx((1 + plain.lambdan) / 2, abs=1e-12)
    assert lazy.lambdan >= 0


def test_exponential_graph_edges():
    n = 12  # hops 1, 2, 4, 8; undirected: +-1, +-2, +-4, +-8 = -+4 mod 12 -> 7 offsets
    topo = topologies.exponential(n)
    ids, _ = topo.neighbors(0)
    assert ids.tolist() == sorted({1, 2, 4, 8, 11, 10, 8, 4})
    topo16 = topologies.exponential(16)  # +8 and -8 coincide: degree 2*4 - 1
    assert set(topo16.degrees.tolist()) == {7}


# ----------------------------------------------------- every builder, many n
def _cases():
    for n in [3, 4, 5, 6, 9, 10, 17, 32, 100]:
        yield f"ring-{n}", lambda n=n: topologies.ring(n)
        yield f"complete-{n}", lambda n=n: topologies.complete(n)
        yield f"star-{n}", lambda n=n: topologies.star(n)
        yield f"exponential-{n}", lambda n=n: topologies.exponential(n)
    for n in [9, 12, 15, 16, 18, 20, 36, 45, 64, 99, 100]:
        yield f"torus-{n}", lambda n=n: topologies.torus(n)
    for n in [2, 4, 8, 16, 64, 128]:
        yield f"hypercube-{n}", lambda n=n: topologies.hypercube(n)
    for n, d in [(4, 3), (6, 3), (10, 3), (10, 4), (11, 4), (16, 5), (50, 7), (64, 4), (101, 6)]:
        for seed in range(4):
            yield f"expander-{n}-{d}-{seed}", lambda n=n, d=d, s=seed: topologies.expander(
                n, degree=d, seed=s
            )
    for n in [5, 12, 30]:
        yield f"ring-lazy-{n}", lambda n=n: topologies.ring(n, lazy=True)
        yield f"star-lazy-{n}", lambda n=n: topologies.star(n, lazy=True)
        yield f"exponential-metropolis-{n}", lambda n=n: topologies.exponential(
            n, weights="metropolis"
        )


CASES = dict(_cases())


@pytest.mark.parametrize("case", list(CASES))
def test_every_builder_gives_a_valid_mixing_matrix(case):
    topo = CASES[case]()
    W = dense(topo)
    assert_mixing_matrix(W)
    # the per-node views agree with the matrix
    off = W - np.diag(np.diag(W))
    np.testing.assert_array_equal(topo.degrees, np.count_nonzero(off, axis=1))
    np.testing.assert_array_equal(topo.self_weights, np.diag(W))
    for i in range(topo.n):
        ids, w = topo.neighbors(i)
        assert ids.dtype == np.int64 and w.dtype == np.float64
        np.testing.assert_array_equal(ids, np.flatnonzero(off[i]))
        np.testing.assert_array_equal(w, off[i, ids])
        assert topo.self_weight(i) == W[i, i]
    # weights are 1/(d+1) everywhere on regular graphs under the default rule
    if topo.params["weights"] == "uniform" and not topo.params["lazy"]:
        d = int(topo.degrees[0])
        assert np.all(W[W > 0] == 1 / (d + 1))


@pytest.mark.parametrize("case", ["ring-5", "star-10", "torus-20", "expander-11-4-1", "complete-4"])
def test_padded_neighbors_layout(case):
    topo = CASES[case]()
    idx, w = topo.padded_neighbors()
    D = int(topo.degrees.max())
    assert idx.shape == w.shape == (topo.n, D)
    assert idx.dtype == np.int64 and w.dtype == np.float64
    W = dense(topo)
    for i in range(topo.n):
        d = int(topo.degrees[i])
        ids, weights = topo.neighbors(i)
        np.testing.assert_array_equal(idx[i, :d], ids)
        assert np.all(np.diff(idx[i, :d]) > 0)
        np.testing.assert_array_equal(w[i, :d], weights)
        assert np.all(idx[i, d:] == i) and np.all(w[i, d:] == 0.0)
    # sum_j w[i, j] x[idx[i, j]] + W_ii x_i is (W x)_i
    x = np.random.default_rng(0).standard_normal(topo.n)
    np.testing.assert_allclose((w * x[idx]).sum(axis=1) + topo.self_weights * x, W @ x, atol=1e-14)
    idx[0, 0] = -1  # fresh arrays: the topology is not affected
    assert topo.padded_neighbors()[0][0, 0] != -1


# -------------------------------------------------------------- weight rules
def _irregular_graphs():
    yield "star", nx.star_graph(9)
    yield "path", nx.path_graph(7)
    yield "lollipop", nx.lollipop_graph(5, 4)
    yield "barbell", nx.barbell_graph(4, 2)
    yield "wheel", nx.wheel_graph(8)
    for seed in range(5):
        g = nx.gnp_random_graph(30, 0.15, seed=seed)
        yield f"gnp-{seed}", g.subgraph(max(nx.connected_components(g), key=len)).copy()
        yield f"ba-{seed}", nx.barabasi_albert_graph(40, 2, seed=seed)


IRREGULAR = dict(_irregular_graphs())


@pytest.mark.parametrize("name", list(IRREGULAR))
def test_metropolis_on_irregular_graphs(name):
    G = IRREGULAR[name]
    topo = topologies.from_graph(G)
    assert topo.params["weights"] == "metropolis"  # the default on irregular graphs
    W = dense(topo)
    assert_mixing_matrix(W)
    nodes = sorted(G)
    pos = {v: i for i, v in enumerate(nodes)}
    for u, v in G.edges():
        i, j = pos[u], pos[v]
        assert W[i, j] == 1 / (1 + max(G.degree(u), G.degree(v)))
    assert np.count_nonzero(W - np.diag(np.diag(W))) == 2 * G.number_of_edges()
    with pytest.raises(TopologyError, match=r"weights='uniform' needs a regular graph .*use weights='metropolis'"):
        topologies.from_graph(G, weights="uniform")


def test_metropolis_equals_uniform_on_regular_graphs():
    for G in [nx.cycle_graph(9), nx.petersen_graph(), nx.random_regular_graph(3, 20, seed=1)]:
        a = topologies.from_graph(G, weights="uniform")
        b = topologies.from_graph(G, weights="metropolis")
        np.testing.assert_allclose(dense(a), dense(b), rtol=0, atol=1e-16)
        assert topologies.from_graph(G).params["weights"] == "uniform"


def test_metropolis_stays_doubly_stochastic_on_a_huge_star():
    # the centre's row has 100,000 entries: float64 summation alone drifts past 1e-12
    topo = topologies.star(100_000)
    W = topo.matrix
    assert sp.issparse(W)
    assert math.fsum(W.getrow(0).data.tolist()) == pytest.approx(1.0, abs=1e-15)
    assert topo.lambda2 == pytest.approx(1 - 1e-5, abs=1e-12)


def test_from_graph_and_from_adjacency_agree():
    G = nx.lollipop_graph(4, 3)
    a = topologies.from_graph(G, lazy=True)
    b = topologies.from_adjacency(nx.to_numpy_array(G), lazy=True)
    c = topologies.from_adjacency(sp.csr_matrix(nx.to_numpy_array(G)), lazy=True)
    np.testing.assert_array_equal(dense(a), dense(b))
    np.testing.assert_array_equal(dense(a), dense(c))
    assert (a.name, b.name) == ("graph", "adjacency")
    assert topologies.from_graph(G, name="lollipop").name == "lollipop"


def test_from_graph_orders_nodes_by_sorted_label():
    G = nx.Graph([("c", "a"), ("a", "b"), ("b", "c"), ("c", "d")])  # d hangs off c
    topo = topologies.from_graph(G)
    assert topo.degrees.tolist() == [2, 2, 3, 1]  # a, b, c, d


def test_self_loops_are_dropped_with_a_warning():
    A = np.ones((4, 4))
    with pytest.warns(UserWarning, match=r"ignoring 4 self loop\(s\)"):
        topo = topologies.from_adjacency(A)
    np.testing.assert_allclose(dense(topo), np.full((4, 4), 0.25))
    G = nx.cycle_graph(5)
    G.add_edge(0, 0)
    with pytest.warns(UserWarning, match="self loop"):
        assert topologies.from_graph(G).is_regular


def test_user_matrix_is_used_as_given():
    W = np.array([[0.5, 0.3, 0.2], [0.3, 0.4, 0.3], [0.2, 0.3, 0.5]])
    topo = Topology(W, name="mine", params={"source": "test"})
    np.testing.assert_array_equal(topo.matrix, W)
    assert topo.name == "mine" and topo.params["source"] == "test"
    assert topo.lambda2 == pytest.approx(np.linalg.eigvalsh(W)[-2], abs=1e-14)


# -------------------------------------------------------- gossip contraction
@pytest.mark.parametrize("case", ["ring-17", "torus-36", "expander-50-7-2", "star-10"])
def test_gossip_contracts_the_lambda2_eigenvector_by_lambda2(case):
    topo = CASES[case]()
    W = dense(topo)
    vals, vecs = np.linalg.eigh(W)
    x0 = vecs[:, -2] + 3.0  # an eigenvector of lambda_2 plus a consensus value
    x = x0.copy()
    for t in range(1, 41):
        x = W @ x
        np.testing.assert_allclose(x - x.mean(), topo.lambda2**t * (x0 - x0.mean()), atol=1e-12)
        assert x.mean() == pytest.approx(3.0 + x0.mean() - 3.0, abs=1e-12)


def test_consensus_steps_bound_the_contraction():
    topo = topologies.ring(8)
    t = topo.consensus_steps(1e-3)
    assert t == math.ceil(math.log(1e-3) / math.log(topo.rho)) == 32
    assert topo.rho**t <= 1e-3 < topo.rho ** (t - 1)
    swap = Topology(np.array([[0.0, 1.0], [1.0, 0.0]]))  # bipartite, no self weight
    assert swap.rho == 1.0 and swap.consensus_steps() is None
    with pytest.raises(ValueError, match=r"eps must be in \(0, 1\), got 2"):
        topo.consensus_steps(2)


# ------------------------------------------------------ dense vs sparse spectra
SPECTRAL_CASES = {
    "ring-301": (lambda: topologies.ring(301), "shift-invert"),
    "ring-lazy-300": (lambda: topologies.ring(300, lazy=True), "shift-invert"),
    "torus-10x100": (lambda: topologies.torus(1000, rows=10), "shift-invert"),
    "torus-20x30": (lambda: topologies.torus(600, rows=20, cols=30), "lanczos"),
    "torus-3x101": (lambda: topologies.torus(303, rows=3), "shift-invert"),
    "path-400": (lambda: topologies.from_graph(nx.path_graph(400)), "shift-invert"),
    "expander-600": (lambda: topologies.expander(600, degree=3, seed=1), "lanczos"),
    "hypercube-512": (lambda: topologies.hypercube(512), "lanczos"),
    "exponential-500": (lambda: topologies.exponential(500), "lanczos"),
    "star-300": (lambda: topologies.star(300), "lanczos"),
    "complete-64": (lambda: topologies.complete(64), "lanczos"),
    "ba-500": (lambda: topologies.from_graph(nx.barabasi_albert_graph(500, 2, seed=3)), "lanczos"),
}


@pytest.mark.parametrize("case", list(SPECTRAL_CASES))
def test_sparse_and_dense_spectra_agree(case):
    build, route = SPECTRAL_CASES[case]
    topo = build()
    d, s = topo.spectrum("dense"), topo.spectrum("sparse")
    assert (d.method, s.method) == ("dense", "sparse")
    assert s.routes == (route, route) and s.converged
    assert s.lambda2 == pytest.approx(d.lambda2, abs=1e-10)
    assert s.lambdan == pytest.approx(d.lambdan, abs=1e-10)
    assert s.spectral_gap == pytest.approx(d.spectral_gap, abs=1e-10)
    assert topo.spectrum() is topo.spectrum()  # cached


@pytest.mark.parametrize("rows, cols", [(3, 1001), (5, 1001), (3, 3333), (7, 1429), (10, 1000)])
def test_sparse_spectrum_of_thin_tori_matches_the_closed_form(rows, cols):
    # odd sides leave the Gershgorin shift far below a clustered lambda_n: the bottom
    # end needs the certified shift refinement
    topo = topologies.torus(rows * cols, rows=rows)
    s = topo.spectrum("sparse")
    a = np.cos(2 * np.pi * np.arange(rows) / rows)
    b = np.cos(2 * np.pi * np.arange(cols) / cols)
    ev = np.sort((1 + 2 * a[:, None] + 2 * b[None, :]).ravel() / 5)
    assert s.routes == ("shift-invert", "shift-invert") and s.converged
    assert s.lambda2 == pytest.approx(ev[-2], abs=1e-13)
    assert s.lambdan == pytest.approx(ev[0], abs=1e-13)


def test_sparse_spectrum_agrees_with_arpack():
    # an independent reference for the plain Lanczos of the sparse method
    topo = topologies.expander(3000, degree=4, seed=5)
    W = topo.matrix
    assert sp.issparse(W)  # n above the dense threshold: the default is sparse
    assert topo.spectrum().method == "sparse"
    n = topo.n
    deflated = LinearOperator((n, n), matvec=lambda x: W @ np.ravel(x) - np.ravel(x).mean(), dtype=float)
    top = eigsh(deflated, k=1, which="LA", tol=1e-12, return_eigenvectors=False)[0]
    bottom = eigsh(W, k=1, which="SA", tol=1e-12, return_eigenvectors=False)[0]
    assert topo.lambda2 == pytest.approx(top, abs=1e-10)
    assert topo.lambdan == pytest.approx(bottom, abs=1e-10)


def test_sparse_method_warns_when_it_cannot_converge(monkeypatch):
    monkeypatch.setattr(spectral, "_LANCZOS_STEPS", 10)
    monkeypatch.setattr(spectral, "_SHIFT_INVERT_STEPS", 3)
    monkeypatch.setattr(spectral, "_ROUND_STEPS", 3)
    monkeypatch.setattr(spectral, "_REFINE_ROUNDS", 1)
    topo = topologies.torus(3 * 1001, rows=3)
    with pytest.warns(spectral.SpectralWarning) as record:
        s = topo.spectrum("sparse")
    assert not s.converged
    messages = [str(w.message) for w in record]
    assert any(m.startswith("lambda_n of this 3003-node matrix did not converge: ") for m in messages)
    assert all(re.search(r"is within \S+ of an eigenvalue \(asked for 1e-10\)$", m) for m in messages)


# --------------------------------------------------------------- large n
@pytest.mark.parametrize("n", [100_000, 100_001])
def test_ring_of_100k_nodes_matches_the_closed_form(n):
    start = time.perf_counter()
    topo = topologies.ring(n)
    s = topo.spectrum()
    assert s.method == "sparse" and s.converged
    assert s.lambda2 == pytest.approx((1 + 2 * math.cos(2 * math.pi / n)) / 3, abs=1e-13)
    # 1 - lambda_2 = (4/3) sin^2(pi/n), computed without cancellation on both sides
    assert s.one_minus_lambda2 == pytest.approx(4 / 3 * math.sin(math.pi / n) ** 2, rel=1e-6)
    lambdan = -1 / 3 if n % 2 == 0 else (1 - 2 * math.cos(math.pi / n)) / 3
    assert s.lambdan == pytest.approx(lambdan, abs=1e-13)
    assert topo.consensus_steps() == math.ceil(math.log(1e-3) / math.log1p(-s.spectral_gap))
    print(f"ring n={n}: {time.perf_counter() - start:.2f} s")


def test_expander_of_100k_nodes():
    start = time.perf_counter()
    topo = topologies.expander(100_000, degree=4, seed=0)
    s = topo.spectrum()
    assert s.method == "sparse" and s.routes == ("lanczos", "lanczos") and s.converged
    # Friedman: lambda_2 of the adjacency of a random 4-regular graph is about
    # 2 sqrt(3) for large n; W = (A + I)/5
    assert s.lambda2 == pytest.approx((1 + 2 * math.sqrt(3)) / 5, abs=2e-3)
    assert s.lambdan == pytest.approx((1 - 2 * math.sqrt(3)) / 5, abs=2e-3)
    print(f"expander n=100000: {time.perf_counter() - start:.2f} s")


# ------------------------------------------------------------- Topology API
def test_matrix_is_dense_up_to_the_threshold_and_csr_above():
    small = topologies.ring(spectral.DENSE_MAX_N)
    big = topologies.ring(spectral.DENSE_MAX_N + 1)
    assert isinstance(small.matrix, np.ndarray)
    assert isinstance(big.matrix, sp.csr_matrix)
    with pytest.raises(ValueError, match="read-only"):
        small.matrix[0, 0] = 1.0
    copy = small.to_dense()
    copy[0, 0] = 1.0  # copies are writable and independent
    assert small.matrix[0, 0] == 1 / 3
    assert isinstance(small.to_sparse(), sp.csr_matrix)
    assert topologies.ring(100).spectrum().method == "dense"
    assert big.spectrum().method == "sparse"


def test_summary_and_repr():
    topo = topologies.star(10)
    summary = topo.summary()
    assert list(summary) == [
        "name", "n", "min_degree", "max_degree", "lambda2", "lambdan", "rho",
        "spectral_gap", "steps_to_1e-3",
    ]
    assert (summary["min_degree"], summary["max_degree"]) == (1, 9)
    assert "star" in repr(topo) and "metropolis" in repr(topo)
    with pytest.raises(TypeError):
        topo.params["weights"] = "uniform"  # read-only mapping


def test_node_index_errors():
    topo = topologies.ring(5)
    with pytest.raises(IndexError, match=r"node 5 is out of range for a 5-node topology \(0..4\)"):
        topo.neighbors(5)
    with pytest.raises(IndexError, match="node -1 is out of range"):
        topo.self_weight(-1)
    with pytest.raises(TypeError, match="node index must be an integer, got 1.5"):
        topo.neighbors(1.5)


# ------------------------------------------------------------------ registry
def test_build_resolves_names_and_parameters():
    assert topologies.build("ring", 8).name == "ring"
    assert topologies.build(" Ring ", 8).n == 8
    t = topologies.build("torus", 12, rows=3)
    assert (t.params["rows"], t.params["cols"]) == (3, 4)
    e = topologies.build("expander", 20, degree=3, seed=7, weights="metropolis", lazy=True)
    assert e.params == {"degree": 3, "seed": 7, "weights": "metropolis", "lazy": True}
    # seed is for random topologies; deterministic ones ignore it (a run seed may be passed)
    assert topologies.build("ring", 8, seed=3).params == {"weights": "uniform", "lazy": False}
    for name in topologies.available():
        assert topologies.describe(name)


def test_expander_is_reproducible_and_seeded():
    a = topologies.expander(40, degree=3, seed=11)
    b = topologies.build("expander", 40, degree=3, seed=11)
    c = topologies.expander(40, degree=3, seed=12)
    np.testing.assert_array_equal(dense(a), dense(b))
    assert not np.array_equal(dense(a), dense(c))
    # seed=None is a fixed default, so that every rank builds the same graph
    np.testing.assert_array_equal(
        dense(topologies.expander(40, degree=3)), dense(topologies.expander(40, degree=3, seed=0))
    )
    assert topologies.expander(40, degree=3).params["seed"] == 0


def test_register_a_new_name():
    def petersen(n, *, weights=None, lazy=False):
        if n != 10:
            raise TopologyError(f"petersen: n must be 10, got n={n}")
        return topologies.from_graph(nx.petersen_graph(), weights=weights, lazy=lazy, name="petersen")

    try:
        topologies.register("petersen_test", petersen, "the Petersen graph")
        assert "petersen_test" in topologies.available()
        assert topologies.build("petersen_test", 10).lambda2 == pytest.approx(2 / 4)
        with pytest.raises(TopologyError, match="'petersen_test' is already registered"):
            topologies.register("petersen_test", petersen, "again")
    finally:
        topologies.registry._REGISTRY.unregister("petersen_test")
    with pytest.raises(TopologyError, match=r"lower-case identifier \(hyphens allowed\), got 'Bad Name'"):
        topologies.register("Bad Name", petersen, "x")


# ---------------------------------------------------------- every error message
BAD_PARAMETERS = [
    (lambda: topologies.ring(2), r"^ring: n must be >= 3, got n=2$"),
    (lambda: topologies.ring(-4), r"^ring: n must be >= 3, got n=-4$"),
    (lambda: topologies.ring(8.0), r"^ring: n must be an integer >= 3, got n=8\.0$"),
    (lambda: topologies.ring("8"), r"^ring: n must be an integer >= 3, got n='8'$"),
    (lambda: topologies.ring(True), r"^ring: n must be an integer >= 3, got n=True$"),
    (lambda: topologies.complete(1), r"^complete: n must be >= 2, got n=1$"),
    (lambda: topologies.star(0), r"^star: n must be >= 2, got n=0$"),
    (lambda: topologies.exponential(1), r"^exponential: n must be >= 2, got n=1$"),
    (lambda: topologies.hypercube(12), r"^hypercube: n must be a power of 2 \(2, 4, 8, 16, \.\.\.\), got n=12; the nearest are 8 and 16$"),
    (lambda: topologies.hypercube(1), r"^hypercube: n must be >= 2, got n=1$"),
    (lambda: topologies.torus(7), r"^torus: n must be >= 9, got n=7$"),
    (lambda: topologies.torus(14), r"^torus: n=14 has no factorisation rows x cols with both sides >= 3; use an n such as 9, 12, 15, 16, or give rows and cols$"),
    (lambda: topologies.torus(101), r"^torus: n=101 has no factorisation .* use an n such as 99, 100, 102, 104"),
    (lambda: topologies.torus(16, rows=2, cols=8), r"^torus: rows and cols must both be >= 3 \(a side of 1 or 2 would repeat an edge\), got rows=2, cols=8$"),
    (lambda: topologies.torus(16, rows=4, cols=5), r"^torus: rows \* cols must equal n, got rows=4, cols=5 \(rows \* cols = 20\) and n=16$"),
    (lambda: topologies.torus(16, rows=3), r"^torus: rows=3 does not divide n=16; give a divisor of n, or both rows and cols with rows \* cols = n$"),
    (lambda: topologies.torus(16, cols=5), r"^torus: cols=5 does not divide n=16"),
    (lambda: topologies.torus(16, rows=4.0), r"^torus: rows must be an integer >= 1, got rows=4\.0$"),
    (lambda: topologies.expander(5, degree=3), r"^expander: n \* degree must be even \(each edge has two ends\), got n=5, degree=3$"),
    (lambda: topologies.expander(4, degree=4), r"^expander: degree must be < n \(a simple graph has at most n - 1 neighbours per node\), got n=4, degree=4$"),
    (lambda: topologies.expander(10, degree=2), r"^expander: degree must be >= 3, got degree=2$"),
    (lambda: topologies.expander(3, degree=3), r"^expander: n must be >= 4, got n=3$"),
    (lambda: topologies.expander(10, degree=3.5), r"^expander: degree must be an integer >= 3, got degree=3\.5$"),
    (lambda: topologies.expander(10, seed=-1), r"^expander: seed must be a non-negative integer or None, got seed=-1$"),
    (lambda: topologies.expander(10, seed="x"), r"^expander: seed must be a non-negative integer or None, got seed='x'$"),
    (lambda: topologies.ring(8, weights="max"), r"^ring: weights must be 'uniform' or 'metropolis' \(or None for the default\), got weights='max'$"),
    (lambda: topologies.ring(8, lazy="yes"), r"^ring: lazy must be True or False, got lazy='yes'$"),
    (lambda: topologies.star(5, weights="uniform"), r"^star: weights='uniform' needs a regular graph \(every node the same degree\), but node 1 has degree 1 and node 0 has degree 4; use weights='metropolis', which works on any graph$"),
    (lambda: topologies.build("rng", 8), r"^unknown topology 'rng'; known topologies: complete, expander, exponential, hypercube, matching, onepeer-exp, ring, star, torus$"),
    (lambda: topologies.build(3, 8), r"^unknown topology 3; known topologies: complete"),
    (lambda: topologies.build("ring", 8, degree=3), r"^ring: unknown parameter 'degree'; ring accepts weights, lazy$"),
    (lambda: topologies.build("expander", 8, rows=3, cols=2), r"^expander: unknown parameter 'cols', 'rows'; expander accepts degree, weights, lazy, seed$"),
]


@pytest.mark.parametrize("call, message", BAD_PARAMETERS)
def test_bad_parameters_are_refused_with_a_clear_message(call, message):
    with pytest.raises(TopologyError, match=message):
        call()


def _doubly_stochastic_off_by_column():
    # rows sum to 1 and every entry is within 1e-12 of its mirror, yet column 0
    # collects three asymmetries: 2.7e-12 over 1
    W = np.full((4, 4), 0.25)
    for i in (1, 2, 3):
        W[i, 0] += 0.9e-12
        W[i, i] -= 0.9e-12
    return W


def _disconnected():
    return sp.block_diag([np.full((2, 2), 0.5), np.full((3, 3), 1 / 3)])


BAD_MATRICES = [
    (np.ones((2, 3)) / 3, r"^mixing matrix must be square \(n x n\), got shape \(2, 3\)$"),
    (np.ones(4) / 4, r"^mixing matrix must be square \(n x n\), got shape \(4,\)$"),
    (sp.csr_matrix(np.ones((2, 3))), r"^mixing matrix must be square, got shape \(2, 3\)$"),
    (np.ones((1, 1)), r"^a topology needs n >= 2 nodes, got a 1 x 1 matrix$"),
    ([["a", "b"], ["c", "d"]], r"^mixing matrix must hold real numbers"),
    (np.eye(2) * (1 + 1j), r"^mixing matrix must hold real numbers"),
    (np.array([[0.5, np.nan], [0.5, 0.5]]), r"^mixing matrix must be finite: W\[0, 1\] = nan$"),
    (
        np.array([[1.5, -0.5], [-0.5, 1.5]]),
        r"^mixing matrix must be non-negative: W\[0, 1\] = -0\.5; gossip weights are averaging weights",
    ),
    (
        np.array([[0.5, 0.5, 0.0], [0.25, 0.5, 0.25], [0.25, 0.0, 0.75]]),
        r"^mixing matrix must be symmetric: W\[\d, \d\] = 0\.\d+ but W\[\d, \d\] = 0\.\d+ \(difference 0\.25 > 1e-12\); use an undirected graph",
    ),
    (
        np.array([[0.5, 0.4], [0.4, 0.6]]),
        r"^every row of the mixing matrix must sum to 1 \(within 1e-12\): row 0 sums to 0\.9; rescale it, or set the self weight W\[0, 0\] = 1 - \(sum of the other weights\)",
    ),
    (
        _doubly_stochastic_off_by_column(),
        r"^every column of the mixing matrix must sum to 1 \(within 1e-12\): column 0 sums to 1\.0000000000027",
    ),
    (
        _disconnected(),
        r"^the graph of the mixing matrix must be connected, but it has 2 components \(node 0 is in one of 2 nodes, node 2 is not in it\); .* add edges joining the components$",
    ),
]


@pytest.mark.parametrize("matrix, message", BAD_MATRICES)
def test_bad_matrices_are_refused_naming_the_rule(matrix, message):
    with pytest.raises(TopologyError, match=message):
        Topology(matrix)


BAD_GRAPHS = [
    (lambda: topologies.from_graph(nx.DiGraph([(0, 1), (1, 0)])), r"^from_graph: the graph must be undirected .*pass G\.to_undirected\(\)$"),
    (lambda: topologies.from_graph(nx.MultiGraph([(0, 1), (0, 1)])), r"^from_graph: multigraphs are not accepted .*pass networkx\.Graph\(G\)$"),
    (lambda: topologies.from_graph([(0, 1)]), r"^from_graph: expected a networkx graph, got list$"),
    (lambda: topologies.from_graph(nx.Graph([(0, 1), (2, 3)])), r"^the graph of the mixing matrix must be connected, but it has 2 components"),
    (lambda: topologies.from_graph(nx.empty_graph(1)), r"^from_graph: a topology needs n >= 2 nodes, got n=1$"),
    (lambda: topologies.from_adjacency(np.array([[0, 2], [2, 0]])), r"^from_adjacency: adjacency entries must be 0 or 1, got A\[0, 1\] = 2\.0; to use your own weights, pass the mixing matrix to topologies\.Topology\(W\)$"),
    (lambda: topologies.from_adjacency(np.array([[0, 1, 0], [0, 0, 1], [1, 0, 0]])), r"^from_adjacency: the adjacency matrix must be symmetric \(undirected graph\), but A\[0, 1\] = 1 and A\[1, 0\] = 0; use A \+ A\.T > 0"),
    (lambda: topologies.from_adjacency(np.ones((2, 3))), r"^from_adjacency: the adjacency matrix must be square, got shape \(2, 3\)$"),
    (lambda: topologies.from_adjacency(np.ones(3)), r"^from_adjacency: the adjacency matrix must be 2-D, got shape \(3,\)$"),
    (lambda: topologies.from_adjacency([["x"]]), r"^from_adjacency: the adjacency matrix must hold numbers"),
]


@pytest.mark.parametrize("call, message", BAD_GRAPHS)
def test_bad_graphs_are_refused(call, message):
    with pytest.raises(TopologyError, match=message):
        call()
