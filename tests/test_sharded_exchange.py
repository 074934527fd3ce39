"""The sharded two-way compressed exchange: semantics, bytes at scale, real processes,
resume and bad input."""

from __future__ import annotations

import warnings

import pytest
import torch

from gossip import algorithms, comm
from gossip import compress as gc
from gossip.algorithms._sharded import ShardPlan
from tests._centralized import assert_restore_bit_identical, layout_of, random_grads, run_reduce, sign_ref
from tests._dist import run_world

N, D, T = 4, 37, 5
OFFSETS = (0, 10, 12, 30)
LAYOUT = layout_of(OFFSETS, D)
LRS = [0.1, 0.05, 0.05, 0.2, 0.02]
CNN1D = ((64, 1, 5), (64,), (64, 64, 5), (64,), (64, 64, 5), (64,), (128, 640), (128,), (10, 128), (10,))


def _grads(n: int = N) -> torch.Tensor:
    return random_grads(n, D, T)


def _shards(d: int, n: int) -> list[tuple[int, int]]:
    """Even cuts, the first d % n shards one value longer."""
    q, r = divmod(d, n)
    out, a = [], 0
    for j in range(n):
        b = a + q + (j < r)
        out.append((a, b))
        a = b
    return out


# ---------------------------------------------------------------- semantics
def test_sharded_efsgd_is_dist_ef_sgd_with_a_server_per_shard():
    """papers' Alg. 2 written out with the server's e~ split among the shard owners: every
    shard compressed on its own (one sign scale per shard, both ways)."""
    grads = _grads()
    got, alg, _ = run_reduce("efsgd", {}, grads, LRS)
    assert alg.exchange == "sharded" and alg.state.shards == N
    shards = _shards(D, N)
    e, es, prev, want = torch.zeros(N, D), torch.zeros(D), 0.0, []
    for t in range(T):
        ratio = prev / LRS[t]
        out = torch.empty(D)
        for a, b in shards:
            pushed = []
            for i in range(N):
                p = grads[t, i, a:b] + ratio * e[i, a:b]
                delta = sign_ref(p)
                e[i, a:b] = p - delta
                pushed.append(delta)
            pt = torch.stack(pushed).mean(0) + ratio * es[a:b]
            out[a:b] = sign_ref(pt)
            es[a:b] = pt - out[a:b]
        want.append(out)
        prev = LRS[t]
    torch.testing.assert_close(got, torch.stack(want).unsqueeze(1).expand_as(got), rtol=1e-5, atol=1e-5)


def test_sharded_blocksign_keeps_tensor_blocks_inside_each_shard():
    plan = ShardPlan(gc.build("blocksign", offsets=OFFSETS), D, N, algo="efblocksgd")
    # shards [0,10) [10,19) [19,28) [28,37): the tensor blocks that meet each, re-based
    assert plan.bounds == [(0, 10), (10, 19), (19, 28), (28, 37)]
    assert [c.spec for c in plan.compressors] == ["blocksign", "blocksign:offsets=0/2", "blocksign",
                                                  "blocksign:offsets=0/2"]
    # a fixed block size is never cut: shards hold whole blocks
    q = ShardPlan(gc.build("quant:bits=4,block=8"), 100, 3, algo="efsgd")
    assert q.bounds == [(0, 40), (40, 72), (72, 100)]


@pytest.mark.parametrize("n", [5, 4])
def test_sharded_majority_vote(n):
    """Odd n: the sign of the vote count; even n: a tie goes to the scale-weighted sum."""
    grads = _grads(n=n)
    got, _, _ = run_reduce("signsgd", {}, grads, LRS)
    votes = torch.where(grads < 0, -1.0, 1.0).sum(1)
    want = torch.empty_like(votes)
    for a, b in _shards(D, n):
        scale = grads[:, :, a:b].double().abs().mean(2, keepdim=True).float()  # per node and shard
        weighted = (scale * torch.where(grads[:, :, a:b] < 0, -1.0, 1.0)).sum(1)
        tie = torch.where(weighted < 0, -1.0, 1.0)
        want[:, a:b] = torch.where(votes[:, a:b] != 0, torch.sign(votes[:, a:b]), tie)
    assert torch.equal(got, want.unsqueeze(1).expand_as(got))


# ---------------------------------------------------------------- bytes at scale
_CASES = [("efsgd", {"compressor": "quant:bits=8"}, "quant:bits=8"),
          ("efsgd", {"compressor": "sign"}, "sign"),
          ("signum", {}, "sign"),
          ("efblocksgd", {}, "blocksign"),
          ("diloco", {"compressor": "quant:bits=4", "local_steps": 10}, "quant:bits=4")]


@pytest.fixture
def eager_kernels():
    """One step at 64 nodes compresses 8 M values: compiling the kernels for it would cost
    more than running them."""
    old = gc.set_backend("eager")
    yield
    gc.set_backend(old)


@pytest.mark.parametrize("n", [4, 16, 64])
def test_bytes_per_node_per_step_stay_at_two_ring_legs(n, eager_kernels):
    """cnn1d (124,810 values): within 1.1x of 2 (n - 1) / n x the whole payload (x 1/H for
    diloco), read from the ledger (one step, or one round of H = 10 for diloco); both legs
    under their own kinds."""
    layout = algorithms.ParamLayout(CNN1D)
    d = layout.dim
    g = torch.Generator().manual_seed(0)
    for name, opts, spec in _CASES:
        c = comm.SimulatedCommunicator(world_size=n)
        alg = algorithms.build(name, c, **opts)
        X = torch.zeros(n, d)
        alg.setup(X, layout)
        steps = 10 if name == "diloco" else 1
        G = torch.randn(n, d, generator=g)
        for _ in range(steps):
            if name == "diloco":
                X += -0.01 * G
                alg.step(X, -0.01 * G)
            else:
                alg.set_lr(0.1)
                alg.reduce_gradients(G)
            c.ledger.step()
        payload = gc.build(spec, **({"offsets": layout.block_starts} if spec == "blocksign" else {})) \
            .payload_nbytes(d)
        bound = 2 * (n - 1) / n * payload / (10 if name == "diloco" else 1)
        ops = c.ledger.as_dict()["ops"]
        exchanged = ops["shard_push"]["sent"] + ops["shard_pull"]["sent"]
        # besides the two legs only the one-off check of the shard sizes: 16 bytes to each peer
        assert c.ledger.step_bytes_sent - exchanged == ops["control"]["sent"] == n * (n - 1) * 16
        per_node_step = exchanged / n / steps
        assert per_node_step <= 1.1 * bound, (name, spec, n, per_node_step / bound)
        assert per_node_step >= bound * 0.9, (name, spec, n, per_node_step / bound)
        assert ops["shard_push"]["sent"] > 0 and ops["shard_pull"]["sent"] > 0 and ops["all_gather"]["sent"] == 0
        del alg, c, X


# ---------------------------------------------------------------- real processes
_DIST = [("efsgd", {"compressor": "quant:bits=8", "seed": 5}, None),
         ("efblocksgdm", {}, LAYOUT),
         ("signum", {}, None),
         ("efsgd", {"compressor": "randk:p=0.3"}, None),
         ("efmomentum", {"compressor": "sign"}, LAYOUT),
         ("efmomentum", {"compressor": "topk:p=0.3"}, None)]


def _dist_worker(n):
    import torch.distributed as dist

    rank = dist.get_rank()
    grads = _grads(n=n)
    c = comm.DistCommunicator(timeout=60)
    out = []
    for k, (name, opts, layout) in enumerate(_DIST):
        alg = algorithms.build(name, c, **opts)
        alg.setup(torch.zeros(1, D), layout)
        traj = []
        for t in range(T):
            alg.set_lr(LRS[t])
            G = grads[t, rank: rank + 1].clone()
            if k == 0 and t % 2:  # the overlapped path (DDP hooks) computes the same
                pending = alg.reduce_gradients_start(G)
                pending.advance()
                pending.wait()
            else:
                alg.reduce_gradients(G)
            traj.append(G[0].clone())
        out.append(torch.stack(traj))
    # diloco: a quantized pseudo-gradient with the owners' second compression
    alg = algorithms.build("diloco", c, compressor="quant:bits=4", local_steps=2, error_feedback=True)
    X = torch.zeros(1, D)
    alg.setup(X, None)
    for t in range(T):
        U = -0.1 * grads[t, rank: rank + 1]
        X += U
        alg.step(X, U)
    out.append(X.clone())
    return out, c.ledger.bytes_sent


@pytest.mark.multiprocess
def test_four_processes_equal_the_simulation_bit_for_bit():
    n = 4
    results = run_world(n, _dist_worker, n, timeout=120)
    grads = _grads(n=n)
    c = comm.SimulatedCommunicator(world_size=n)
    sims = [run_reduce(name, opts, grads, LRS, layout, c)[0] for name, opts, layout in _DIST]
    alg = algorithms.build("diloco", c, compressor="quant:bits=4", local_steps=2, error_feedback=True)
    X = torch.zeros(n, D)
    alg.setup(X, None)
    for t in range(T):
        U = -0.1 * grads[t]
        X += U
        alg.step(X, U)
    for rank, (trajs, sent) in enumerate(results):
        for k, (name, _, _) in enumerate(_DIST):
            assert torch.equal(trajs[k], sims[k][:, rank]), (name, rank)
        assert torch.equal(trajs[-1], X[rank: rank + 1]), ("diloco", rank)
        assert sent == c.ledger.sent_by(rank), rank


def _out_of_step_worker():
    import time

    import torch.distributed as dist

    rank = dist.get_rank()
    alone = dist.new_group([rank], use_local_synchronization=True)
    try:
        comm.DistCommunicator(timeout=60, pull_group=alone)
        refused = ""
    except ValueError as e:
        refused = str(e)
    pulls = dist.new_group([0, 1], use_local_synchronization=True)
    c = comm.DistCommunicator(timeout=60, pull_group=pulls)
    grads = _grads(n=2)
    algs = [algorithms.build("efsgd", c, compressor="quant:bits=8") for _ in range(2)]
    for a in algs:
        a.setup(torch.zeros(1, D), LAYOUT)
    out = []
    for t in range(T):
        Gs = [grads[t, rank: rank + 1].clone(), 2 * grads[t, rank: rank + 1]]
        for a in algs:
            a.set_lr(LRS[t])
        first = algs[0].reduce_gradients_start(Gs[0])
        if rank == 0:  # the first exchange's pull before the second's push; rank 1 the other way round
            while not first.ready():
                time.sleep(0.001)
            first.advance()
        second = algs[1].reduce_gradients_start(Gs[1])
        for p in (first, second):
            p.advance()
        out.append(torch.cat([first.wait()[0], second.wait()[0]]))
    return torch.stack(out), refused


@pytest.mark.multiprocess
def test_pulls_in_a_group_of_their_own_may_go_out_of_step():
    """With the communicator's ``pull_group``, one rank posts an exchange's pull as soon
    as its push has arrived, before the next exchange's push, while its peer posts them
    the other way round (what a DDP hook does when a push arrives early on one rank):
    the same bits as the simulation. A pull group over other ranks is refused."""
    results = run_world(2, _out_of_step_worker, timeout=120)
    grads = _grads(n=2)
    want = [run_reduce("efsgd", {"compressor": "quant:bits=8"}, g, LRS, LAYOUT)[0] for g in (grads, 2 * grads)]
    for rank, (got, refused) in enumerate(results):
        assert torch.equal(got, torch.cat([want[0][:, rank], want[1][:, rank]], dim=1)), rank
        assert refused.startswith("DistCommunicator: `pull_group` must hold the same ranks as `group`"), refused


# ---------------------------------------------------------------- resume
@pytest.mark.parametrize("name,opts", [("efsgd", {"compressor": "quant:bits=8"}), ("signum", {}),
                                       ("efblocksgdm", {}), ("efmomentum", {"compressor": "topk:p=0.3"})])
def test_resume_is_bit_identical(name, opts):
    assert_restore_bit_identical(lambda c: algorithms.build(name, c, **opts), _grads(), 2, LRS, LAYOUT)


def test_resume_on_another_world_size_is_refused_naming_both():
    _, alg, _ = run_reduce("efsgd", {}, _grads(), LRS)
    other = algorithms.build("efsgd", comm.SimulatedCommunicator(world_size=8))
    other.setup(torch.zeros(8, D))
    sd = alg.state_dict()
    sd["error"] = torch.zeros(8, D)  # the per-node memories would be refused anyway; the shards first
    with pytest.raises(ValueError, match=r"^efsgd: the server state is sharded over 4 nodes, this run has 8"):
        other.load_state_dict(sd)


def test_a_state_from_before_the_sharded_exchange_resumes_all_gathered():
    """An old state (no `exchange`, no `shards`) all-gathered: the run continues exactly as
    the replicated server would; asking for exchange=sharded with it is refused."""
    grads = _grads()
    ref, old, _ = run_reduce("efsgd", {"exchange": "allgather", "compressor": "quant:bits=4"}, grads, LRS)
    c = comm.SimulatedCommunicator(world_size=N)
    old = algorithms.build("efsgd", c, exchange="allgather", compressor="quant:bits=4")
    old.setup(torch.zeros(N, D))
    for t in range(2):
        old.set_lr(LRS[t])
        old.reduce_gradients(grads[t].clone())
    sd = {k: v for k, v in old.state_dict().items() if k not in ("exchange", "shards")}
    new = algorithms.build("efsgd", comm.SimulatedCommunicator(world_size=N), compressor="quant:bits=4")
    new.setup(torch.zeros(N, D))
    new.load_state_dict(sd)
    assert new.exchange == "allgather" and new.state_dict()["exchange"] == "allgather"
    for t in range(2, T):
        new.set_lr(LRS[t])
        G = grads[t].clone()
        new.reduce_gradients(G)
        assert torch.equal(G, ref[t])
    forced = algorithms.build("efsgd", comm.SimulatedCommunicator(world_size=N), exchange="sharded",
                              compressor="quant:bits=4")
    forced.setup(torch.zeros(N, D))
    with pytest.raises(ValueError, match=r"written before the sharded exchange existed"):
        forced.load_state_dict(sd)


# ---------------------------------------------------------------- bad input
def test_what_cannot_be_sharded_is_refused_in_one_line():
    c = comm.SimulatedCommunicator(world_size=N)
    a = algorithms.build("efsgd", c, compressor="topk:k=5", exchange="sharded")
    with pytest.raises(ValueError, match=r"^efsgd: exchange=sharded: topk:k=5 keeps a count of k=5 values, "
                                         r"which does not carry over to shards; give the fraction p= instead, "
                                         r"or use exchange=allgather$"):
        a.setup(torch.zeros(N, D))
    b = algorithms.build("diloco", c, compressor="quant:bits=8,block=16", exchange="sharded")
    with pytest.raises(ValueError, match=r"^diloco: exchange=sharded: quant:bits=8,block=16 has 3 block\(s\) of "
                                         r"16 values over the 37 values, fewer than the 4 nodes"):
        b.setup(torch.zeros(N, D))
    with pytest.raises(ValueError, match=r"fewer.*|needs at least as many values as nodes"):
        algorithms.build("signum", c, exchange="sharded").setup(torch.zeros(N, 3))
    with pytest.raises(ValueError, match=r"^Arg `exchange` of efsgd must be one of sharded, allgather"):
        algorithms.build("efsgd", c, exchange="ring")
    # by default such a compressor all-gathers, and says so once
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        d = algorithms.build("efsgd", c, compressor="topk:k=5")
        d.setup(torch.zeros(N, D))
    assert d.exchange == "allgather" and any("all-gathers its payloads" in str(x.message) for x in w)
