"""Sketched-SGD (Ivkin et al. 2019, arXiv:1903.04488) and the true/local top-k baselines: dense reference,
Count Sketch recovery, bytes, restore, config checks, gloo world."""

from __future__ import annotations

import math

import pytest
import torch

from gossip import algorithms, comm
from gossip.algorithms import ParamLayout
from gossip.algorithms._common import shared_key
from gossip.algorithms.sketched import CountSketch
from tests._centralized import assert_restore_bit_identical
from tests._dist import run_world

SHAPES = [(12, 10), (6, 3, 2, 2), (6,)]  # two compressed tensors and a bias
LAYOUT = ParamLayout(tuple(SHAPES))
D = sum(math.prod(s) for s in SHAPES)
NC = 12 * 10 + 6 * 12  # compressed coordinates
BIAS = list(range(NC, D))
N, T, K, MU = 3, 5, 6, 0.9
ROWS, COLS, P = 5, 40, 3


def _grads(n=N, t=T):
    g = torch.Generator().manual_seed(7)
    base = torch.randn(t, 1, D, generator=g, dtype=torch.float64)
    return base + 0.5 * torch.randn(t, n, D, generator=g, dtype=torch.float64)


def _hashes(seed=0):
    g = torch.Generator().manual_seed(shared_key(seed, 0, 3) & 0x7FFFFFFFFFFFFFFF)
    buckets = torch.randint(COLS, (ROWS, NC), generator=g)
    signs = torch.randint(2, (ROWS, NC), generator=g) * 2 - 1
    return buckets, signs


def _top(values, count):
    """indices of the `count` largest values (no ties in these tests)."""
    return sorted(range(len(values)), key=lambda i: -values[i])[:count]


def _reference(grads, algo):
    """Ivkin et al. 2019 (arXiv:1903.04488) Alg. 3 per node, written plainly with python loops."""
    T_, n, d = grads.shape
    u = torch.zeros(n, d, dtype=torch.float64)
    v = torch.zeros(n, d, dtype=torch.float64)
    buckets, signs = _hashes()
    outs = []
    for t in range(T_):
        u = MU * u + grads[t]
        for c in range(NC):
            v[:, c] += u[:, c]
        out = torch.zeros(d, dtype=torch.float64)
        for b in BIAS:
            out[b] = u[:, b].mean()
        masked = [set() for _ in range(n)]
        if algo == "truetopk":
            mean = [float(v[:, c].mean()) for c in range(NC)]
            sel = _top([abs(x) for x in mean], K)
            for c in sel:
                out[c] = mean[c]
            masked = [set(sel)] * n
        elif algo == "localtopk":
            for w in range(n):
                own = _top([abs(float(v[w, c])) for c in range(NC)], K)
                for c in own:
                    out[c] += v[w, c].float().double() / n  # fp32 on the wire
                masked[w] = set(own)
        else:  # sketched
            S = torch.zeros(ROWS, COLS, dtype=torch.float64)
            for w in range(n):
                for j in range(ROWS):
                    for c in range(NC):
                        S[j, buckets[j, c]] += signs[j, c] * v[w, c] / n
            est = [float(torch.tensor([signs[j, c] * S[j, buckets[j, c]] for j in range(ROWS)]).median())
                   for c in range(NC)]
            l2 = float((S ** 2).sum(1).median())
            heavy = [e * e >= l2 / (P * K) for e in est]
            cand = sorted(range(NC), key=lambda c: (not heavy[c], -abs(est[c])))[: P * K]
            exact = {c: float(v[:, c].mean()) for c in cand}
            sel = sorted(cand, key=lambda c: -abs(exact[c]))[:K]
            for c in sel:
                out[c] = exact[c]
            masked = [set(sel)] * n
        for w in range(n):
            for c in masked[w]:
                u[w, c] = 0.0
                v[w, c] = 0.0
        outs.append(out)
    return torch.stack(outs)


def _build(name, c, **opts):
    extra = dict(rows=ROWS, cols=COLS, candidates=P) if name == "sketched" else {}
    return algorithms.build(name, c, k=K, momentum=MU, **extra, **opts)


def _run_sim(name, grads, n=N):
    c = comm.SimulatedCommunicator(world_size=n)
    a = _build(name, c)
    a.setup(torch.zeros(n, D, dtype=grads.dtype), LAYOUT)
    outs = []
    for t in range(grads.shape[0]):
        a.set_lr(0.1)
        G = grads[t].clone()
        a.reduce_gradients(G)
        outs.append(G.clone())
    return torch.stack(outs), a, c


@pytest.mark.parametrize("name", ["sketched", "truetopk", "localtopk"])
def test_matches_dense_reference(name):
    grads = _grads()
    got, a, _ = _run_sim(name, grads)
    want = _reference(grads, name)
    torch.testing.assert_close(got, want.unsqueeze(1).expand_as(got), rtol=1e-9, atol=1e-12)
    if name != "localtopk":
        assert int((got[-1, 0, :NC] != 0).sum()) == K


def test_count_sketch_is_linear_and_recovers_planted_heavy_hitters():
    d, k, found = 5000, 8, 0
    for trial in range(20):
        g = torch.Generator().manual_seed(100 + trial)
        cs = CountSketch(d, 5, 20 * k, key=trial)
        x = torch.randn(2, d, generator=g, dtype=torch.float64) * 0.05
        planted = torch.randperm(d, generator=g)[:k]
        x[0, planted] += 4.0 * (torch.randint(2, (k,), generator=g) * 2 - 1)
        S = cs.sketch(x)
        torch.testing.assert_close(S.sum(0, keepdim=True), cs.sketch(x.sum(0, keepdim=True)))
        cand = cs.heavymix(S[:1], 2 * k)[0]
        found += set(planted.tolist()) <= set(cand.tolist())
    assert found >= 19, found


@pytest.mark.parametrize("name", ["sketched", "truetopk", "localtopk"])
def test_bytes_per_step_equal_the_formula(name):
    grads = _grads().float()
    _, a, c = _run_sim(name, grads)
    U = len(BIAS)
    ring = lambda b: (2 * (N - 1) * b + N // 2) // N  # noqa: E731
    if name == "sketched":
        per_step = 4 * (ROWS * COLS + P * K + K + 2 * U)  # Ivkin et al. 2019 (arXiv:1903.04488): |S| + P k + k
        assert a.values_per_step == ROWS * COLS + P * K + K + 2 * U
    elif name == "truetopk":
        per_step = ring(4 * D)
    else:
        per_step = (N - 1) * 8 * K + ring(4 * U)
    for i in range(N):
        assert c.ledger.sent_by(i) == T * per_step


def test_sketched_without_biases_counts_exactly_s_plus_pk_plus_k():
    c = comm.SimulatedCommunicator(world_size=2)
    a = algorithms.build("sketched", c, k=4, rows=3, cols=16, candidates=2)
    a.setup(torch.zeros(2, 100))
    a.reduce_gradients(torch.randn(2, 100))
    assert c.ledger.sent_by(0) == 4 * (3 * 16 + 2 * 4 + 4)


@pytest.mark.parametrize("name", ["sketched", "truetopk", "localtopk"])
def test_state_save_restore_bit_identical(name):
    assert_restore_bit_identical(lambda c: _build(name, c), _grads().float(), 2, layout=LAYOUT)


def test_config_validation_messages():
    c = comm.SimulatedCommunicator(world_size=2)
    with pytest.raises(ValueError, match=r"sketched: give `k` or `p`, not both"):
        algorithms.build("sketched", c, k=3, p=0.1)
    with pytest.raises(ValueError, match=r"Arg `k` must be >= 1, got 0"):
        algorithms.build("truetopk", c, k=0)
    with pytest.raises(ValueError, match=r"Arg `p` of localtopk must be a number in \(0, 1\], got 2"):
        algorithms.build("localtopk", c, p=2)
    with pytest.raises(ValueError, match=r"Arg `rows` must be >= 1, got 0"):
        algorithms.build("sketched", c, rows=0)
    with pytest.raises(ValueError, match=r"Arg `momentum` must satisfy 0 <= momentum < 1, got 1"):
        algorithms.build("sketched", c, momentum=1)
    with pytest.raises(ValueError, match=r"unexpected keyword argument 'shapes'"):
        algorithms.build("sketched", c, shapes=[])  # the shapes come from the layout
    a = algorithms.build("sketched", c)
    with pytest.raises(ValueError, match=rf"sketched: the layout's tensors hold {D} values, the flat parameters 7"):
        a.setup(torch.zeros(2, 7), LAYOUT)
    with pytest.raises(ValueError, match=r"no tensor to compress"):
        algorithms.build("sketched", c).setup(torch.zeros(2, 7), ParamLayout(((7,),)))


# ---------------------------------------------------------------- real processes
def _dist_run(name):
    import torch.distributed as dist

    rank = dist.get_rank()
    grads = _grads(n=dist.get_world_size())
    c = comm.DistCommunicator(timeout=30)
    a = _build(name, c)
    a.setup(torch.zeros(1, D, dtype=torch.float64), LAYOUT)
    outs = []
    for t in range(T):
        G = grads[t, rank : rank + 1].clone()
        a.reduce_gradients(G)
        outs.append(G[0].clone())
    return torch.stack(outs), c.ledger.bytes_sent


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["sketched", "truetopk", "localtopk"])
def test_world_2_gloo_equals_simulation(name):
    results = run_world(2, _dist_run, name, timeout=120)
    sim, _, c = _run_sim(name, _grads(n=2), n=2)
    for rank, (traj, sent) in enumerate(results):
        torch.testing.assert_close(traj, sim[:, rank], rtol=1e-9, atol=1e-12)
        assert sent == c.ledger.sent_by(rank)


def test_heavymix_of_the_same_merged_sketch_is_computed_once_and_equals_every_rows_own():
    """After round 1 every hosted node holds the same merged sketch: the candidates are
    found once for all of them, the same as each node's own; rows that differ are each
    searched on their own."""
    from gossip.algorithms.sketched import _once_per_distinct_row

    cs = CountSketch(NC, ROWS, COLS, key=11)
    g = torch.Generator().manual_seed(3)
    S = cs.sketch(torch.randn(1, NC, generator=g)).expand(4, -1).contiguous()
    seen = []

    def heavymix(rows):
        seen.append(rows.shape[0])
        return cs.heavymix(rows, P * K)

    once = _once_per_distinct_row(heavymix, S)
    assert seen == [1]
    assert torch.equal(once, cs.heavymix(S, P * K))
    assert all(torch.equal(once[i], cs.heavymix(S[i:i + 1], P * K)[0]) for i in range(4))
    S[2, 0] += 1.0  # one row differs: every row is searched
    seen.clear()
    assert torch.equal(_once_per_distinct_row(heavymix, S), cs.heavymix(S, P * K))
    assert seen == [4]
