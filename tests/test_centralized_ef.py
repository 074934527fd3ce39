"""dist-EF-SGD family and the sign baselines (Zheng et al. 2019, arXiv:1905.10936) against plain dense references."""

from __future__ import annotations

import pytest
import torch

from gossip import algorithms, comm
from gossip import compress as gc
from gossip.algorithms._centralized import ErrorFeedback
from gossip.algorithms._common import node_keys, shared_key
from tests._centralized import assert_restore_bit_identical, layout_of, random_grads, reduce_step, run_reduce, sign_ref
from tests._dist import run_world

N, D, T = 4, 37, 6
OFFSETS = (0, 10, 12, 30)  # four "tensors" of 10, 2, 18 and 7 values
LAYOUT = layout_of(OFFSETS, D)
LRS = [0.1, 0.1, 0.05, 0.05, 0.2, 0.02]  # a changing step size exercises eta_{t-1}/eta_t


def _grads(n: int = N) -> torch.Tensor:
    return random_grads(n, D, T)


# ---------------------------------------------------------------- plain references
def _ef_reference(grads, lrs, mu, compress_worker, compress_server):
    """Zheng et al. 2019 (arXiv:1905.10936) Alg. 2 / 4 written out node by node; returns Delta~_t per step."""
    T_, n, d = grads.shape
    e = torch.zeros(n, d)
    es = torch.zeros(d)
    mom = torch.zeros(n, d)
    prev = 0.0
    outs = []
    for t in range(T_):
        ratio = prev / lrs[t]
        pushed = []
        for i in range(n):
            mom[i] = mu * mom[i] + grads[t, i]
            v = mu * mom[i] + grads[t, i] if mu > 0 else grads[t, i]
            p = v + ratio * e[i]
            delta = compress_worker(p, t + 1, i)
            e[i] = p - delta
            pushed.append(delta)
        pt = torch.stack(pushed).mean(0) + ratio * es
        dt = compress_server(pt, t + 1)
        es = pt - dt
        outs.append(dt)
        prev = lrs[t]
    return torch.stack(outs)


def _run_sim(name, opts, grads, lrs):
    opts = {"exchange": "allgather", **opts}  # the replicated server of the references here
    layout = opts.pop("layout", None)
    return run_reduce(name, opts, grads, lrs, layout)


def _keyed(spec, seed):
    """Worker and server compression through the library compressor with the keys the
    algorithm must use (the same random draws), one row at a time."""
    c = gc.build(spec)

    def worker(p, t, i):
        k = node_keys(seed, torch.tensor([i]), t, 0)
        return c.decode(c.encode(p.unsqueeze(0), k, tag=t), p.numel(), tag=t)[0]

    def server(p, t):
        k = torch.tensor([shared_key(seed, t, 1)], dtype=torch.int64)
        return c.decode(c.encode(p.unsqueeze(0), k, tag=t), p.numel(), tag=t)[0]

    return worker, server


EF_CASES = [
    ("efsgd", {}, 0.0, lambda p, t, i: sign_ref(p), lambda p, t: sign_ref(p)),
    ("efsgd", {"momentum": 0.5}, 0.5, lambda p, t, i: sign_ref(p), lambda p, t: sign_ref(p)),
    ("efblocksgd", {"layout": LAYOUT}, 0.0,
     lambda p, t, i: sign_ref(p, OFFSETS), lambda p, t: sign_ref(p, OFFSETS)),
    ("efblocksgdm", {"layout": LAYOUT, "momentum": 0.9}, 0.9,
     lambda p, t, i: sign_ref(p, OFFSETS), lambda p, t: sign_ref(p, OFFSETS)),
    ("efsgd", {"compressor": "identity"}, 0.0, lambda p, t, i: p, lambda p, t: p),
]


@pytest.mark.parametrize("name,opts,mu,cw,cs", EF_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(EF_CASES)])
def test_ef_family_matches_dense_reference(name, opts, mu, cw, cs):
    grads = _grads()
    got, _, _ = _run_sim(name, opts, grads, LRS)
    want = _ef_reference(grads, LRS, mu, cw, cs)
    torch.testing.assert_close(got, want.unsqueeze(1).expand_as(got), rtol=1e-5, atol=1e-5)


def test_efsgd_random_compressor_uses_node_and_shared_keys():
    grads = _grads()
    spec = "randomk:k=9"
    got, _, _ = _run_sim("efsgd", {"compressor": spec, "seed": 7}, grads, LRS)
    w, s = _keyed(spec, 7)
    want = _ef_reference(grads, LRS, 0.0, w, s)
    torch.testing.assert_close(got, want.unsqueeze(1).expand_as(got), rtol=1e-5, atol=1e-6)


def test_efsgd_identity_is_full_precision_sgd():
    grads = _grads()
    got, _, _ = _run_sim("efsgd", {"compressor": "identity"}, grads, LRS)
    torch.testing.assert_close(got, grads.mean(1, keepdim=True).expand_as(got), rtol=1e-6, atol=1e-6)


def _vote_reference(grads, beta):
    mom = torch.zeros(grads.shape[1:])
    outs = []
    for t in range(grads.shape[0]):
        if beta > 0:
            mom = beta * mom + (1 - beta) * grads[t]
            v = mom
        else:
            v = grads[t]
        signs = torch.where(v < 0, -1.0, 1.0)  # 0 counts as positive
        outs.append(torch.sign(signs.sum(0)))
    return torch.stack(outs)


@pytest.mark.parametrize("name,beta", [("signsgd", 0.0), ("signum", 0.9), ("signum", 0.5)])
def test_majority_vote_matches_reference(name, beta):
    grads = _grads(n=5)  # odd: no ties
    opts = {} if name == "signsgd" else {"momentum": beta}
    got, _, _ = _run_sim(name, opts, grads, LRS)
    want = _vote_reference(grads, beta)
    torch.testing.assert_close(got, want.unsqueeze(1).expand_as(got), rtol=1e-6, atol=1e-6)


def test_error_feedback_identity_sent_plus_error_is_input():
    c = gc.build("blocksign", offsets=OFFSETS)
    ef = ErrorFeedback(c)
    g = torch.Generator().manual_seed(1)
    X, mem = torch.randn(3, D, generator=g), torch.randn(3, D, generator=g)
    before = mem.clone()
    P, payload, sent = ef(X, mem, rescale=0.5, keys=torch.zeros(3, dtype=torch.int64), tag=1)
    torch.testing.assert_close(P, X + 0.5 * before)
    torch.testing.assert_close(sent + mem, P, rtol=0, atol=1e-6)
    assert payload.shape == (3, c.payload_nbytes(D))
    # rescale 0 (eta_{-1} = 0) ignores the old memory entirely
    P0, _, sent0 = ef(X, mem, rescale=0.0, keys=torch.zeros(3, dtype=torch.int64), tag=1)
    assert torch.equal(P0, X)
    torch.testing.assert_close(sent0 + mem, X, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name,opts,spec", [
    ("efsgd", {}, "sign"),
    ("efblocksgd", {"layout": LAYOUT}, "blocksign:offsets=0/10/12/30"),
    ("efsgd", {"compressor": "topk:k=5"}, "topk:k=5"),
    ("signum", {}, "sign"),
])
def test_bytes_per_step_equal_the_formula(name, opts, spec):
    grads = _grads()
    _, alg, c = _run_sim(name, opts, grads, LRS)
    nbytes = gc.build(spec).payload_nbytes(D)
    per_step = (N - 1) * nbytes  # ring all-gather of one payload per worker
    for i in range(N):
        assert c.ledger.sent_by(i) == T * per_step
        assert c.ledger.received_by(i) == T * per_step


@pytest.mark.parametrize("name,opts", [
    ("efblocksgdm", {"layout": LAYOUT}),
    ("efsgd", {"compressor": "randomk:k=9", "seed": 3}),
    ("signum", {}),
])
def test_state_save_restore_bit_identical(name, opts):
    opts = {"exchange": "allgather", **opts}
    layout = opts.pop("layout", None)
    assert_restore_bit_identical(lambda c: algorithms.build(name, c, **opts), _grads(), 3, LRS, layout)


def test_config_validation_messages():
    c = comm.SimulatedCommunicator(world_size=2)
    with pytest.raises(ValueError, match=r"Arg `momentum` must satisfy 0 <= momentum < 1, got 1.0"):
        algorithms.build("efsgd", c, momentum=1.0)
    with pytest.raises(ValueError, match=r"Arg `momentum` must satisfy 0 < momentum < 1, got 0"):
        algorithms.build("efblocksgdm", c, momentum=0)
    with pytest.raises(ValueError, match=r"unexpected keyword argument 'offsets'; accepted options: momentum, seed, exchange"):
        algorithms.build("efblocksgd", c, offsets=(0, 5, 5))  # the blocks come from the layout
    with pytest.raises(TypeError, match=r"Arg `compressor` of efsgd must be a compressor spec string"):
        algorithms.build("efsgd", c, compressor=3)
    with pytest.raises(ValueError, match=r"unknown|nosuch"):
        algorithms.build("efsgd", c, compressor="nosuch")
    with pytest.raises(ValueError, match=r"accepted options: .*momentum"):
        algorithms.build("signum", c, beta=0.9)
    a = algorithms.build("efsgd", c)
    a.setup(torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"Arg `lr` must be a positive finite number, got 0"):
        a.set_lr(0)
    # empty tensors of the layout make no block
    b = algorithms.build("efblocksgd", c)
    b.setup(torch.zeros(2, 7), algorithms.ParamLayout(((3,), (0,), (4,))))
    assert b.compressor.spec == "blocksign:offsets=0/3"


# ---------------------------------------------------------------- real processes
_DIST_CASES = [
    ("efsgd", {}),
    ("efblocksgd", {"layout": LAYOUT}),
    ("efblocksgdm", {"layout": LAYOUT}),
    ("efsgd", {"compressor": "randomk:k=9", "seed": 2}),
    ("signsgd", {}),
    ("signum", {}),
]


def _dist_worker(n):
    import torch.distributed as dist

    rank = dist.get_rank()
    grads = _grads(n=n)
    c = comm.DistCommunicator(timeout=30)
    out = []
    for name, opts in _DIST_CASES:
        opts = {"exchange": "allgather", **opts}  # the sharded exchange: tests/test_sharded_exchange.py
        layout = opts.pop("layout", None)
        alg = algorithms.build(name, c, **opts)
        alg.setup(torch.zeros(1, D), layout)
        out.append(torch.stack([reduce_step(alg, grads[t, rank: rank + 1], LRS[t])[0] for t in range(T)]))
    return out, c.ledger.bytes_sent


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 4])
def test_real_processes_equal_simulation(n):
    results = run_world(n, _dist_worker, n, timeout=120)
    grads = _grads(n=n)
    sent_sim = 0
    for k, (name, opts) in enumerate(_DIST_CASES):
        sim, _, c = _run_sim(name, opts, grads, LRS)
        sent_sim += c.ledger.sent_by(0)
        for rank, (trajs, _) in enumerate(results):
            assert torch.equal(trajs[k], sim[:, rank]), (name, rank)
    assert all(sent == sent_sim for _, sent in results)
