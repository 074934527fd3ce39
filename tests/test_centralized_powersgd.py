"""PowerSGD (Vogels et al. 2019, arXiv:1905.13727): dense reference, linearity, bytes, restore, gloo worlds, and
a cross-check against PyTorch's own ``powerSGD_hook``; the unbiased rank-r approximator
(Sec. 4.1) and best-approximation PowerSGD (App. G.7): dense references, unbiasedness,
convergence to the truncated SVD, bytes, restore."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gossip import algorithms, comm
from gossip.algorithms import ParamLayout
from gossip.algorithms._common import shared_key
from gossip.algorithms.powersgd import _Q_STREAM, orthogonalize
from tests._centralized import assert_restore_bit_identical
from tests._dist import run_world

# a linear layer, a conv weight (out, in, kh, kw), a bias, and a matrix too small to gain
SHAPES = [(16, 12), (8, 3, 3, 3), (8,), (3, 4)]
LAYOUT = ParamLayout(tuple(SHAPES))
D = sum(math.prod(s) for s in SHAPES)
N, T, RANK = 4, 5, 2


def _grads(n=N, t=T):
    g = torch.Generator().manual_seed(5)
    # a dominant low-rank part plus noise, so rank 2 captures something and EF matters
    base = torch.randn(t, 1, D, generator=g)
    return base + 0.5 * torch.randn(t, n, D, generator=g)


def _blocks():
    out, off = [], 0
    for sh in SHAPES:
        numel = math.prod(sh)
        out.append((off, sh, numel))
        off += numel
    return out


def _compressed(sh, rank=RANK, rate=2.0):
    if len(sh) < 2:
        return False
    n, k = sh[0], math.prod(sh[1:])
    r = min(n, k, rank)
    return (n + k) * r * rate < n * k


def _reference(grads, q0, lam, nesterov=True):
    """Alg. 2 around Alg. 1 written per node; P of the averaged matrix (linearity:
    mean_w(M_w Q) = (mean_w M_w) Q), orthogonalised by QR (sign-independent result)."""
    T_, n, d = grads.shape
    e = torch.zeros(n, d)
    mom = torch.zeros(d)  # the same on every node
    q = {}
    qoff = 0
    for off, sh, numel in _blocks():
        if _compressed(sh):
            k, r = numel // sh[0], min(sh[0], numel // sh[0], RANK)
            q[off] = q0[qoff : qoff + k * r].view(k, r).clone()
            qoff += k * r
    outs = []
    for t in range(T_):
        M = grads[t] + e
        delta = torch.empty(d)
        for off, sh, numel in _blocks():
            if not _compressed(sh):
                delta[off : off + numel] = M[:, off : off + numel].mean(0)
                continue
            nrow = sh[0]
            Ms = M[:, off : off + numel].reshape(n, nrow, -1)
            Mbar = Ms.mean(0)
            P = Mbar @ q[off]
            P_hat, _ = torch.linalg.qr(P)
            q[off] = Mbar.T @ P_hat
            delta[off : off + numel] = (P_hat @ q[off].T).reshape(-1)
        newe = torch.zeros(n, d)
        for off, sh, numel in _blocks():
            if _compressed(sh):
                newe[:, off : off + numel] = M[:, off : off + numel] - delta[off : off + numel]
        e = newe
        mom = lam * mom + delta
        outs.append(delta + lam * mom if nesterov else mom)
    return torch.stack(outs)


def _run_sim(grads, n=N, **opts):
    c = comm.SimulatedCommunicator(world_size=n)
    a = algorithms.build("powersgd", c, rank=RANK, **opts)
    a.setup(torch.zeros(n, D), LAYOUT)
    q0 = a.state.q[0].clone()
    outs = []
    for t in range(grads.shape[0]):
        a.set_lr(0.1)
        G = grads[t].clone()
        a.reduce_gradients(G)
        outs.append(G.clone())
    return torch.stack(outs), q0, a, c


@pytest.mark.parametrize("lam,nesterov", [(0.0, True), (0.9, True), (0.9, False)])
def test_powersgd_matches_dense_reference(lam, nesterov):
    grads = _grads()
    got, q0, a, _ = _run_sim(grads, momentum=lam, nesterov=nesterov)
    assert [(m.n, m.k, m.r) for m in a.matrices] == [(16, 12, 2), (8, 27, 2)]
    want = _reference(grads, q0, lam, nesterov)
    torch.testing.assert_close(got, want.unsqueeze(1).expand_as(got), rtol=1e-4, atol=1e-5)


def test_powersgd_exact_when_the_average_has_rank_r():
    # the average of matrices U_w V^T of rank r = 2 (common V) is transmitted exactly;
    # (rank-deficient averages are not: Gram-Schmidt then normalises rounding noise)
    g = torch.Generator().manual_seed(0)
    grads = torch.zeros(2, N, D)
    off = 0
    for sh in SHAPES:
        numel = math.prod(sh)
        if len(sh) >= 2:
            u = torch.randn(N, sh[0], RANK, generator=g)
            v = torch.randn(RANK, numel // sh[0], generator=g)
            grads[:, :, off : off + numel] = (u @ v).reshape(N, -1)
        else:
            grads[:, :, off : off + numel] = torch.randn(N, numel, generator=g)
        off += numel
    got, _, a, _ = _run_sim(grads, momentum=0.0)
    torch.testing.assert_close(got[0], grads[0].mean(0).expand(N, D), rtol=1e-4, atol=1e-4)
    # the local error is M_w minus the aggregate: it averages to zero over the workers
    assert float(a.state.error.mean(0).abs().max()) < 1e-4


def test_orthogonalize_gives_orthonormal_columns():
    P = torch.randn(3, 10, 4, generator=torch.Generator().manual_seed(1))
    Q = orthogonalize(P.clone())
    eye = torch.eye(4).expand(3, 4, 4)
    torch.testing.assert_close(Q.transpose(1, 2) @ Q, eye, rtol=0, atol=1e-5)
    Z = torch.zeros(1, 5, 2)
    assert torch.equal(orthogonalize(Z), torch.zeros(1, 5, 2))  # no NaN on zero columns


def test_bytes_per_step_equal_the_formula():
    grads = _grads()
    _, _, a, c = _run_sim(grads)
    U = 8 + 12
    P = 16 * 2 + 8 * 2
    Q = 12 * 2 + 27 * 2
    ring = lambda b: (2 * (N - 1) * b + N // 2) // N  # noqa: E731
    per_step = ring(4 * (U + P)) + ring(4 * Q)
    assert a.compressed_numel == U + P + Q
    for i in range(N):
        assert c.ledger.sent_by(i) == T * per_step


@pytest.mark.parametrize(
    "opts",
    [{}, {"approximator": "unbiased"}, {"approximator": "best", "iterations": 2},
     {"approximator": "best", "error_feedback": False, "nesterov": False}],
)
def test_state_save_restore_bit_identical(opts):
    assert_restore_bit_identical(
        lambda c: algorithms.build("powersgd", c, rank=RANK, **opts), _grads(), 2, layout=LAYOUT
    )


def test_without_warm_start_q_is_redrawn_identically_everywhere():
    grads = _grads()
    got1, _, _, _ = _run_sim(grads, warm_start=False, seed=4)
    got2, _, _, _ = _run_sim(grads, warm_start=False, seed=4)
    assert torch.equal(got1, got2)


def test_config_validation_messages():
    c = comm.SimulatedCommunicator(world_size=2)
    with pytest.raises(ValueError, match=r"unexpected keyword argument 'shapes'"):
        algorithms.build("powersgd", c, shapes=SHAPES)  # the shapes come from the layout
    with pytest.raises(ValueError, match=r"Arg `rank` must be >= 1, got 0"):
        algorithms.build("powersgd", c, rank=0)
    with pytest.raises(ValueError, match=r"Arg `momentum` must satisfy 0 <= momentum < 1, got 1.5"):
        algorithms.build("powersgd", c, momentum=1.5)
    with pytest.raises(ValueError, match=r"Arg `min_compression_rate` must be a finite number >= 0"):
        algorithms.build("powersgd", c, min_compression_rate=-1)
    with pytest.raises(TypeError, match=r"Arg `warm_start` must be a bool"):
        algorithms.build("powersgd", c, warm_start="yes")
    with pytest.raises(ValueError, match=r"Arg `approximator` must be one of power, unbiased, best, got 'svd'"):
        algorithms.build("powersgd", c, approximator="svd")
    with pytest.raises(ValueError, match=r"Arg `iterations` must be >= 1, got 0"):
        algorithms.build("powersgd", c, approximator="best", iterations=0)
    with pytest.raises(TypeError, match=r"Arg `iterations` must be an integer, got str '4'"):
        algorithms.build("powersgd", c, approximator="best", iterations="4")
    with pytest.raises(ValueError, match=r"Arg `iterations` applies to approximator 'best' only, got "
                       r"iterations=2 with approximator 'unbiased'"):
        algorithms.build("powersgd", c, approximator="unbiased", iterations=2)
    assert algorithms.build("powersgd", c, approximator="best").config.iterations == 4
    a = algorithms.build("powersgd", c)
    with pytest.raises(ValueError, match=rf"powersgd: the layout's tensors hold {D} values, the flat parameters 7"):
        a.setup(torch.zeros(2, 7), LAYOUT)


# ---------------------------------------------------------------- the other approximators
def _qn(rank=RANK):
    """sum_j k_j r_j over the compressed matrices of SHAPES."""
    out = 0
    for _, sh, numel in _blocks():
        if _compressed(sh, rank):
            k = numel // sh[0]
            out += k * min(sh[0], k, rank)
    return out


def _shared_normal(seed, step, numel):
    """The draw every worker makes at step t (counted from 1): i.i.d. N(0, 1) from a
    generator seeded with the shared key of (seed, t)."""
    g = torch.Generator().manual_seed(shared_key(seed, step, _Q_STREAM))
    return torch.randn(numel, generator=g)


def _reference_variant(grads, approximator, lam, *, iterations=1, seed=0, nesterov=True, ef=True):
    """Alg. 2 around the approximator, written densely on the workers' mean matrix.

    unbiased: U = Z / sqrt(r) (so E[U U^T] = I), Delta' = (Mbar U) U^T;
    best: Q = Z, then ``iterations`` times P_hat = qr(Mbar Q), Q = Mbar^T P_hat, and
    Delta' = P_hat Q^T (QR instead of Gram-Schmidt: the result does not depend on signs).
    """
    T_, n, d = grads.shape
    e = torch.zeros(n, d)
    mom = torch.zeros(d)
    outs = []
    for t in range(T_):
        z = _shared_normal(seed, t + 1, _qn())
        M = grads[t] + e if ef else grads[t].clone()
        delta = torch.empty(d)
        qoff = 0
        for off, sh, numel in _blocks():
            if not _compressed(sh):
                delta[off : off + numel] = M[:, off : off + numel].mean(0)
                continue
            nrow, k = sh[0], numel // sh[0]
            r = min(nrow, k, RANK)
            Mbar = M[:, off : off + numel].reshape(n, nrow, k).mean(0)
            Z = z[qoff : qoff + k * r].view(k, r)
            qoff += k * r
            if approximator == "unbiased":
                Uu = Z / math.sqrt(r)
                approx = (Mbar @ Uu) @ Uu.T
            else:
                Q = Z
                for _ in range(iterations):
                    P_hat, _ = torch.linalg.qr(Mbar @ Q)
                    Q = Mbar.T @ P_hat
                approx = P_hat @ Q.T
            delta[off : off + numel] = approx.reshape(-1)
        if ef:
            e = torch.zeros(n, d)
            for off, sh, numel in _blocks():
                if _compressed(sh):
                    e[:, off : off + numel] = M[:, off : off + numel] - delta[off : off + numel]
        mom = lam * mom + delta
        outs.append(delta + lam * mom if nesterov else mom)
    return torch.stack(outs)


@pytest.mark.parametrize(
    "approximator,iterations,lam,nesterov,ef",
    [
        ("unbiased", None, 0.0, True, True),
        ("unbiased", None, 0.9, True, True),
        ("unbiased", None, 0.9, False, False),
        ("best", 1, 0.0, True, True),
        ("best", 4, 0.9, True, True),
        ("best", 3, 0.9, False, False),
    ],
)
def test_variants_match_dense_reference(approximator, iterations, lam, nesterov, ef):
    grads = _grads()
    got, _, a, _ = _run_sim(grads, momentum=lam, nesterov=nesterov, error_feedback=ef, seed=7,
                            approximator=approximator, iterations=iterations)
    assert a.state.q.shape == (N, 0)  # nothing is carried over between steps
    want = _reference_variant(grads, approximator, lam, iterations=iterations or 1, seed=7,
                              nesterov=nesterov, ef=ef)
    torch.testing.assert_close(got, want.unsqueeze(1).expand_as(got), rtol=1e-4, atol=1e-5)


#: copies of SHAPES in the layout of the unbiasedness test: a step's shared draw is one
#: stream over all the matrices, so each copy gets its own U and one step gives COPIES
#: independent trials (a step of 50 copies costs a few times one of a single copy)
COPIES = 50


def _trials(approximator, trials, seed=0):
    """``trials`` independent decompressed aggregates C(M) of the same gradients, as
    rows of D values (no error feedback, no momentum, no warm start: each copy of
    SHAPES in each step is one draw), and the mean M they estimate."""
    g = torch.Generator().manual_seed(11)
    grads = torch.randn(N, D, generator=g) + torch.randn(1, D, generator=g)
    c = comm.SimulatedCommunicator(world_size=N)
    a = algorithms.build("powersgd", c, rank=RANK, momentum=0.0, error_feedback=False,
                         warm_start=False, seed=seed, approximator=approximator)
    a.setup(torch.zeros(N, COPIES * D), ParamLayout(tuple(SHAPES) * COPIES))
    steps = -(-trials // COPIES)
    outs = torch.empty(steps, COPIES, D, dtype=torch.float64)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matrices: more threads only contend (many times slower on a busy machine)
    try:
        for t in range(steps):
            G = grads.repeat(1, COPIES)
            a.reduce_gradients(G)
            outs[t] = G[0].double().view(COPIES, D)
    finally:
        torch.set_num_threads(threads)
    return outs.view(steps * COPIES, D)[:trials], grads.double().mean(0)


def _z_scores(outs, target):
    """(sample mean - target) / its standard error, per coordinate."""
    S = outs.shape[0]
    return (outs.mean(0) - target) / (outs.std(0) / math.sqrt(S))


def test_unbiased_approximator_is_unbiased():
    """E[C(M)] = M for the unbiased approximator (U = Z / sqrt(r), E[U U^T] = I).

    Statistic: over S = 4000 independent draws, each compressed coordinate's
    z = (sample mean - M) / (sample std / sqrt(S)); under unbiasedness z is
    t-distributed with 3999 degrees of freedom, about N(0, 1), and P(|z| >= 5) is
    5.7e-7, so over the 408 compressed coordinates a false failure has probability at
    most 2.3e-4 (union bound). Second check: the sample mean is within 10% of M in
    norm (its relative error is about sqrt(sum of variances / S) / |M| = 0.05 here, its
    square a sum of about 190 effective chi-square terms: twice that is far rarer than
    the first check's false alarm). Power: the same statistic on a biased
    scale (E = r M) exceeds 15 and on the biased PowerSGD approximator exceeds 20 (with
    400 draws): a biased approximator passes with negligible probability. The draws come
    50 to a step (:data:`COPIES`); their distribution, hence the test's, is that of
    4000 steps of one copy.
    """
    S = 4000
    outs, Mbar = _trials("unbiased", S)
    comp = torch.zeros(D, dtype=torch.bool)
    for off, sh, numel in _blocks():
        comp[off : off + numel] = _compressed(sh)
    assert int(comp.sum()) == 408
    # uncompressed values are the exact mean every time
    torch.testing.assert_close(outs[:, ~comp], Mbar[~comp].expand(S, -1), rtol=1e-5, atol=1e-6)
    # the copies of one step are distinct draws, not one draw repeated
    assert not torch.equal(outs[0, comp], outs[1, comp])
    z = _z_scores(outs[:, comp], Mbar[comp])
    assert float(z.abs().max()) < 5.0, float(z.abs().max())
    rel = float((outs[:, comp].mean(0) - Mbar[comp]).norm() / Mbar[comp].norm())
    assert rel < 0.1, rel
    # the test has power: a biased scale (U without 1/sqrt(r), E = r M) and the biased
    # PowerSGD approximator both fail it by far
    assert float(_z_scores(outs[:, comp] * RANK, Mbar[comp]).abs().max()) > 15
    powered, _ = _trials("power", 400)
    assert float(_z_scores(powered[:, comp], Mbar[comp]).abs().max()) > 20


def test_best_approaches_the_truncated_svd():
    # each matrix's mean has singular values 8, 4 then at most ~1: a clear gap after r = 2
    g = torch.Generator().manual_seed(3)
    grads = torch.zeros(1, N, D)
    for off, sh, numel in _blocks():
        if len(sh) >= 2:
            nrow, k = sh[0], numel // sh[0]
            L, _ = torch.linalg.qr(torch.randn(nrow, 2, generator=g))
            R, _ = torch.linalg.qr(torch.randn(k, 2, generator=g))
            low = L @ torch.diag(torch.tensor([8.0, 4.0])) @ R.T
            noise = 0.1 * torch.randn(N, nrow, k, generator=g)
            grads[0, :, off : off + numel] = (low + noise).reshape(N, -1)
        else:
            grads[0, :, off : off + numel] = torch.randn(N, numel, generator=g)
    Mbar = grads[0].mean(0)

    def svd_r(off, sh, numel):
        A = Mbar[off : off + numel].reshape(sh[0], -1).double()
        U_, S_, Vh = torch.linalg.svd(A, full_matrices=False)
        return (U_[:, :RANK] * S_[:RANK]) @ Vh[:RANK]

    def err(iterations):
        got, _, _, _ = _run_sim(grads, momentum=0.0, approximator="best", iterations=iterations)
        out = []
        for off, sh, numel in _blocks():
            if _compressed(sh):
                want = svd_r(off, sh, numel)
                have = got[0, 0, off : off + numel].reshape(sh[0], -1).double()
                out.append(float((have - want).norm() / want.norm()))
        return max(out)

    assert err(30) < 1e-5
    assert err(1) > 10 * err(30)  # one iteration from a random Q is not there yet


@pytest.mark.parametrize("approximator,iterations", [("power", None), ("unbiased", None), ("best", 3)])
def test_variant_bytes_per_step_equal_the_formula(approximator, iterations):
    grads = _grads()
    _, _, a, c = _run_sim(grads, approximator=approximator, iterations=iterations)
    U = 8 + 12
    P = 16 * 2 + 8 * 2
    Q = 12 * 2 + 27 * 2
    ring = lambda b: (2 * (N - 1) * b + N // 2) // N  # noqa: E731
    if approximator == "unbiased":  # U is drawn by every worker, never sent
        per_step, numel = ring(4 * (U + P)), U + P
    else:  # each round of subspace iteration all-reduces P, then Q
        rounds = iterations or 1
        per_step = ring(4 * (U + P)) + ring(4 * Q) + (rounds - 1) * (ring(4 * P) + ring(4 * Q))
        numel = U + rounds * (P + Q)
    assert a.compressed_numel == numel
    for i in range(N):
        assert c.ledger.sent_by(i) == T * per_step


# ---------------------------------------------------------------- real processes
def _dist_ours(n, **opts):
    import torch.distributed as dist

    rank = dist.get_rank()
    grads = _grads(n=n)
    c = comm.DistCommunicator(timeout=30)
    a = algorithms.build("powersgd", c, rank=RANK, **opts)
    a.setup(torch.zeros(1, D), LAYOUT)
    outs = []
    for t in range(T):
        G = grads[t, rank : rank + 1].clone()
        a.reduce_gradients(G)
        outs.append(G[0].clone())
    return torch.stack(outs), c.ledger.bytes_sent


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 4])
def test_real_processes_equal_simulation_to_rounding(n):
    results = run_world(n, _dist_ours, n, timeout=120)
    sim, _, _, c = _run_sim(_grads(n=n), n=n)
    for rank, (traj, sent) in enumerate(results):
        torch.testing.assert_close(traj, sim[:, rank], rtol=1e-5, atol=1e-5)
        assert sent == c.ledger.sent_by(rank)


@pytest.mark.multiprocess
@pytest.mark.parametrize("opts", [{"approximator": "unbiased"}, {"approximator": "best", "iterations": 3}])
def test_variants_real_processes_equal_simulation_to_rounding(opts):
    results = run_world(2, _dist_ours, 2, timeout=120, **opts)
    sim, _, _, c = _run_sim(_grads(n=2), n=2, **opts)
    for rank, (traj, sent) in enumerate(results):
        torch.testing.assert_close(traj, sim[:, rank], rtol=1e-5, atol=1e-5)
        assert sent == c.ledger.sent_by(rank)


class _Bucket:
    """Just what powerSGD_hook reads of a DDP GradBucket: one flat buffer and per-
    parameter views into it."""

    def __init__(self, flat: torch.Tensor, shapes) -> None:
        self._buf = flat
        self._shapes = shapes

    def buffer(self):
        return self._buf

    def index(self):
        return 0

    def is_last(self):
        return True

    def gradients(self):
        out, off = [], 0
        for sh in self._shapes:
            numel = math.prod(sh)
            out.append(self._buf[off : off + numel].view(sh))
            off += numel
        return out


def _hook_initial_q(seed, shapes, rank, rate=2.0):
    """The hook's first Q: drawn for the compressed matrices grouped by matrix shape
    (first-seen order), laid out here in parameter order."""
    rng = np.random.RandomState(seed)
    mats = []
    for i, sh in enumerate(shapes):
        if len(sh) < 2:
            continue
        n, k = sh[0], math.prod(sh[1:])
        r = min(n, k, rank)
        if (n + k) * r * rate < n * k:
            mats.append((i, (n, k), r))
    groups = {}
    for i, nk, r in mats:
        groups.setdefault(nk, []).append((i, r))
    drawn = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(rng.randint(1_000_000_000))
        for (n, k), members in groups.items():
            for i, r in members:
                drawn[i] = torch.randn(1, k, r).reshape(-1)
    return torch.cat([drawn[i] for i, _, _ in mats])


def _dist_crosscheck(steps, shapes, rank, seed):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph

    me = dist.get_rank()
    d = sum(math.prod(s) for s in shapes)
    g = torch.Generator().manual_seed(100)
    grads = torch.randn(steps, 1, d, generator=g) + 0.5 * torch.randn(
        steps, dist.get_world_size(), d, generator=g
    )
    st = ph.PowerSGDState(
        process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
        min_compression_rate=2, use_error_feedback=True, warm_start=True,
        orthogonalization_epsilon=0, random_seed=seed,
    )
    for _ in range(2):  # the hook's vanilla all-reduce warm-up iterations
        ph.powerSGD_hook(st, _Bucket(torch.zeros(d), shapes)).wait()
    c = comm.DistCommunicator(timeout=30)
    a = algorithms.build("powersgd", c, rank=rank, momentum=0.0)
    a.setup(torch.zeros(1, d), ParamLayout(tuple(shapes)))
    sd = a.state_dict()
    sd["q"] = _hook_initial_q(seed, shapes, rank).unsqueeze(0)
    a.load_state_dict(sd)
    ours, theirs = [], []
    for t in range(steps):
        G = grads[t, me : me + 1].clone()
        a.reduce_gradients(G)
        ours.append(G[0])
        theirs.append(ph.powerSGD_hook(st, _Bucket(grads[t, me].clone(), shapes)).wait().clone())
    return torch.stack(ours), torch.stack(theirs)


@pytest.mark.multiprocess
def test_crosscheck_against_torch_powersgd_hook():
    """Same gradients, rank, warm start and error feedback over several steps.

    Differences, each equal in exact arithmetic: the hook orthonormalises the reused Q
    before P = M Q (it spans the same columns, and Gram-Schmidt of P R^-1 with R upper
    triangular gives the same P_hat), sums P instead of averaging it (P_hat is scale
    free), and keeps an error for the uncompressed tensors too (local minus mean,
    whose mean over workers is 0). So the aggregates agree to rounding."""
    shapes = SHAPES + [(6, 4, 3, 3), (16, 12)]  # a repeated shape: the hook groups by shape
    results = run_world(2, _dist_crosscheck, 6, shapes, RANK, 3, timeout=120)
    for ours, theirs in results:
        rel = (ours - theirs).norm(dim=1) / theirs.norm(dim=1)
        assert float(rel.max()) < 1e-4, rel
    torch.testing.assert_close(results[0][0], results[1][0])
