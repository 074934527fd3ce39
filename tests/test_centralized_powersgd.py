"""PowerSGD (papers/001): dense reference, linearity, bytes, restore, gloo worlds, and
a cross-check against PyTorch's own ``powerSGD_hook``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gossip import algorithms, comm
from gossip.algorithms.powersgd import orthogonalize
from tests._dist import run_world

# a linear layer, a conv weight (out, in, kh, kw), a bias, and a matrix too small to gain
SHAPES = [(16, 12), (8, 3, 3, 3), (8,), (3, 4)]
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
    a = algorithms.build("powersgd", c, shapes=SHAPES, rank=RANK, **opts)
    a.setup(torch.zeros(n, D))
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


def test_state_save_restore_bit_identical():
    grads = _grads()
    c = comm.SimulatedCommunicator(world_size=N)
    a = algorithms.build("powersgd", c, shapes=SHAPES, rank=RANK)
    a.setup(torch.zeros(N, D))
    for t in range(2):
        a.reduce_gradients(grads[t].clone())
    sd = a.state_dict()
    cont = []
    for t in range(2, T):
        G = grads[t].clone()
        a.reduce_gradients(G)
        cont.append(G)
    b = algorithms.build("powersgd", comm.SimulatedCommunicator(world_size=N), shapes=SHAPES, rank=RANK)
    b.setup(torch.zeros(N, D))
    b.load_state_dict(sd)
    for t in range(2, T):
        G = grads[t].clone()
        b.reduce_gradients(G)
        assert torch.equal(G, cont[t - 2])


def test_without_warm_start_q_is_redrawn_identically_everywhere():
    grads = _grads()
    got1, _, _, _ = _run_sim(grads, warm_start=False, seed=4)
    got2, _, _, _ = _run_sim(grads, warm_start=False, seed=4)
    assert torch.equal(got1, got2)


def test_config_validation_messages():
    c = comm.SimulatedCommunicator(world_size=2)
    with pytest.raises(ValueError, match=r"Arg `shapes` of powersgd is required"):
        algorithms.build("powersgd", c)
    with pytest.raises(ValueError, match=r"Arg `rank` must be >= 1, got 0"):
        algorithms.build("powersgd", c, shapes=SHAPES, rank=0)
    with pytest.raises(ValueError, match=r"Arg `momentum` must satisfy 0 <= momentum < 1, got 1.5"):
        algorithms.build("powersgd", c, shapes=SHAPES, momentum=1.5)
    with pytest.raises(ValueError, match=r"Arg `min_compression_rate` must be a finite number >= 0"):
        algorithms.build("powersgd", c, shapes=SHAPES, min_compression_rate=-1)
    with pytest.raises(TypeError, match=r"Arg `warm_start` must be a bool"):
        algorithms.build("powersgd", c, shapes=SHAPES, warm_start="yes")
    a = algorithms.build("powersgd", c, shapes=SHAPES)
    with pytest.raises(ValueError, match=rf"the parameter shapes hold {D} values, the flat buffer has 7"):
        a.setup(torch.zeros(2, 7))


# ---------------------------------------------------------------- real processes
def _dist_ours(n):
    import torch.distributed as dist

    rank = dist.get_rank()
    grads = _grads(n=n)
    c = comm.DistCommunicator(timeout=30)
    a = algorithms.build("powersgd", c, shapes=SHAPES, rank=RANK)
    a.setup(torch.zeros(1, D))
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
    a = algorithms.build("powersgd", c, shapes=shapes, rank=rank, momentum=0.0)
    a.setup(torch.zeros(1, d))
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
