"""gossip.ddp: the centralized algorithms as DDP communication hooks.

Each multi-process test starts one 2-rank gloo world and runs every case in it:

* a DDP model with our hook ends where the same algorithm run by GossipOptimizer
  (the library's own loop) ends, for every algorithm the hooks support;
* our PowerSGD hook agrees with torch's ``powerSGD_hook`` as closely as the two are
  defined to (see docs/centralized.md for the differences);
* with several buckets, the hook equals one algorithm per bucket's parameters written
  plainly, and a run resumed from ``state_dict`` into a fresh DDP model is
  bit-identical with the uninterrupted run.
"""

import math
import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gossip import algorithms, comm, ddp
from gossip.runtime import GossipOptimizer, MomentumConflict
from tests._dist import run_world

LR = 0.1
STEPS = 5  # one warm-up iteration, then four with the algorithm

#: (algorithm, options): every algorithm gossip.ddp supports
CASES = [
    ("allreduce", {}),
    ("efsgd", {"compressor": "quant:bits=8"}),
    ("efblocksgd", {}),
    ("efblocksgdm", {"momentum": 0.9}),
    ("signsgd", {}),
    ("signum", {}),
    ("powersgd", {"rank": 2}),
    ("efmomentum", {"compressor": "topk:p=0.25"}),
    ("sketched", {"p": 0.1}),
    ("truetopk", {"p": 0.1}),
    ("localtopk", {"p": 0.1}),
    ("demo", {"compression_chunk": 4, "compression_topk": 2}),
]


class Net(nn.Module):
    """A newcomer's own model."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.body = nn.Linear(8, hidden)
        self.head = nn.Linear(hidden, 3)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def _net(hidden: int = 16) -> Net:
    torch.manual_seed(0)
    return Net(hidden)


#: wide enough that one rank's 8-bit message to a peer spans several KiB chunks
WIDE = 600


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)


def _train_ddp(model, opt, steps, first=0):
    rank = torch.distributed.get_rank()
    for t in range(first, first + steps):
        x, y = _batch(rank, t)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# ------------------------------------------------------------------------ hook == our loop
def _hook_and_loop(cases):
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    for name, opts in cases:
        # a DDP script with the two lines
        net = _net()
        model = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=25)  # one bucket
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        state = ddp.hook_state(model, name, optimizer=opt, **opts)
        model.register_comm_hook(state, ddp.hook)
        _train_ddp(model, opt, 1)
        warm = state.ledger.bytes_sent
        _train_ddp(model, opt, STEPS - 1, first=1)

        # the same algorithm through GossipOptimizer: step 1 is the hook's full-precision
        # warm-up (a mean all-reduce), the algorithm runs from step 2 on
        ref = _net()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        x, y = _batch(rank, 0)
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())
        ref_opt.step()
        c = comm.DistCommunicator(timeout=60)
        gopt = GossipOptimizer(ref, ref_opt, algorithms.build(name, c, **opts))
        for t in range(1, STEPS):
            x, y = _batch(rank, t)
            gopt.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            gopt.step()
        out[name] = (_params(net), _params(ref), state.ledger.bytes_sent - warm, c.ledger.bytes_sent,
                     state.groups, state.iteration)
    return out


@pytest.mark.multiprocess
def test_hook_gives_what_our_loop_gives_for_every_supported_algorithm():
    assert {n for n, _ in CASES} == set(ddp.HOOK_ALGORITHMS)
    results = run_world(2, _hook_and_loop, CASES, timeout=180)
    for name, _ in CASES:
        for rank, res in enumerate(results):
            hooked, looped, hook_bytes, loop_bytes, groups, iteration = res[name]
            assert groups == [("body.weight", "body.bias", "head.weight", "head.bias")], (name, groups)
            assert iteration == STEPS
            # the same gradients through the same operations: equal bit for bit
            for a, b in zip(hooked, looped):
                assert torch.equal(a, b), (name, rank, float((a - b).abs().max()))
            assert hook_bytes == loop_bytes > 0, (name, hook_bytes, loop_bytes)
        # DDP keeps the replicas equal
        for a, b in zip(results[0][name][0], results[1][name][0]):
            assert torch.equal(a, b), name


# ------------------------------------------------------------------------ resume
def _payload_bytes(ledger) -> int:
    """Bytes sent less the one-off checks of message sizes, which a resumed process (a
    fresh communicator) makes again."""
    return ledger.bytes_sent - ledger.as_dict()["ops"]["control"]["sent"]


def _resume(cases):
    import torch.distributed as dist

    out = {}
    for name, opts in cases:
        def fresh(params=None):
            net = _net()
            if params is not None:
                with torch.no_grad():
                    for p, q in zip(net.parameters(), params):
                        p.copy_(q)
            # tiny buckets: several groups after DDP's rebuild
            model = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.0001)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            state = ddp.hook_state(model, name, optimizer=opt, **opts)
            model.register_comm_hook(state, ddp.hook)
            return net, model, opt, state

        net, model, opt, state = fresh()
        _train_ddp(model, opt, 6)
        straight, straight_bytes = _params(net), _payload_bytes(state.ledger)
        per_group = _per_group_reference(name, opts, state.groups, 6)

        net, model, opt, state = fresh()
        _train_ddp(model, opt, 3)
        saved = (_params(net), state.state_dict())
        # a new DDP model, as a restarted script builds it: its first iteration has one
        # bucket of everything, which then holds every saved group
        net, model, opt, state = fresh(saved[0])
        state.load_state_dict(saved[1])
        _train_ddp(model, opt, 3, first=3)
        out[name] = (straight, _params(net), straight_bytes, _payload_bytes(state.ledger), state.groups, per_group)
        dist.barrier()
    out["_checks"] = _state_checks()
    return out


def _state_checks():
    """What needs a process group: the momentum warning and load_state_dict's errors."""
    model = _net()
    found = {}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        state = ddp.hook_state(model, "powersgd")
    found["warning"] = [str(x.message) for x in w]
    for key, sd in (("other", ddp.hook_state(model, "efsgd").state_dict()), ("junk", {"x": 1})):
        try:
            state.load_state_dict(sd)
        except ValueError as e:
            found[key] = str(e)

    # one group saved from one bucket, resumed with small buckets that cut it apart
    def fresh(cap):
        model = nn.parallel.DistributedDataParallel(_net(), bucket_cap_mb=cap)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        state = ddp.hook_state(model, "efsgd", optimizer=opt)
        model.register_comm_hook(state, ddp.hook)
        return model, opt, state

    model, opt, state = fresh(25)
    _train_ddp(model, opt, 2)
    saved = state.state_dict()
    model, opt, state = fresh(0.0001)
    state.load_state_dict(saved)
    try:
        _train_ddp(model, opt, 2, first=2)
    except RuntimeError as e:
        found["cut"] = str(e)
    return found


def _per_group_reference(name, opts, groups, steps):
    """The hook's per-bucket semantics written plainly: after one mean all-reduce, one
    algorithm per group (seeded seed + g) on the group's tensors in the model's order."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    net = _net()
    params = dict(net.named_parameters())
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    c = comm.DistCommunicator(timeout=60)
    algos = []
    for g, names in enumerate(groups):
        a = algorithms.build(name, c, **{**opts, "seed": g})
        layout = algorithms.ParamLayout.from_shapes([params[n].shape for n in names], names)
        a.setup(torch.zeros(1, layout.dim), layout)
        algos.append(a)
    for t in range(steps):
        x, y = _batch(rank, t)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        for names, a in zip(groups, algos):
            G = torch.cat([params[n].grad.reshape(-1) for n in names]).view(1, -1)
            if t == 0:
                dist.all_reduce(G)
                G.div_(world)
            else:
                a.set_lr(LR)
                a.reduce_gradients(G)
            off = 0
            for n in names:
                k = params[n].numel()
                params[n].grad.copy_(G[0, off:off + k].view_as(params[n]))
                off += k
        opt.step()
    return _params(net)


@pytest.mark.multiprocess
def test_several_buckets_and_resume_through_state_dict_are_bit_identical():
    """Also the state's errors and the momentum warning, which need a process group."""
    cases = [("efsgd", {"compressor": "quant:bits=4"}), ("powersgd", {"rank": 1}), ("sketched", {"p": 0.2})]
    results = run_world(2, _resume, cases, timeout=180)
    checks = results[0]["_checks"]
    assert any("applies its own momentum" in w and "optimizer=" in w for w in checks["warning"]), checks
    assert re.fullmatch(r"gossip.ddp: the state is efsgd's, this hook runs powersgd", checks.get("other", "")), checks
    assert re.match(r"gossip.ddp: load_state_dict expects a HookState.state_dict\(\)", checks.get("junk", "")), checks
    assert re.fullmatch(r"gossip.ddp: bucket \d+ \(2 tensors\) cuts across the groups set up on earlier buckets; "
                        r"DDP's buckets changed .*bucket_cap_mb than the checkpoint's\?\)", checks.get("cut", "")), checks
    for name, _ in cases:
        for res in results:
            straight, resumed, b1, b2, groups, per_group = res[name]
            assert len(groups) >= 2, (name, groups)  # several buckets, one group each
            for a, b in zip(straight, per_group):
                assert torch.equal(a, b), (name, "per-group reference")
            assert sorted(n for g in groups for n in g) == sorted(
                ["body.weight", "body.bias", "head.weight", "head.bias"])
            for a, b in zip(straight, resumed):
                assert torch.equal(a, b), name
            assert b1 == b2, name


# ------------------------------------------------------------------------ chunked exchanges
def _chunked(exchanges):
    import torch.distributed as dist

    posted = {"n": 0}

    def counting(fn):
        def post(*args, **kwargs):
            posted["n"] += 1
            return fn(*args, **kwargs)
        return post

    out = {}
    for exchange in exchanges:
        for chunk_kb in (None, 1, "auto"):
            posted["n"] = 0
            net = _net(WIDE)
            model = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.0001)  # a bucket per tensor
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
            state = ddp.hook_state(model, "efsgd", optimizer=opt, compressor="quant:bits=8", exchange=exchange,
                                   chunk_kb=chunk_kb)
            model.register_comm_hook(state, ddp.hook)
            patched = {k: getattr(dist, k) for k in ("all_to_all_single", "all_gather", "all_gather_into_tensor")}
            try:
                for k, fn in patched.items():
                    setattr(dist, k, counting(fn))
                _train_ddp(model, opt, STEPS)
            finally:
                for k, fn in patched.items():
                    setattr(dist, k, fn)
            out[exchange, chunk_kb] = (_params(net), state.ledger.bytes_sent, len(state.groups),
                                       state.comm.chunk_bytes, posted["n"])
    return out


@pytest.mark.multiprocess
def test_chunked_exchanges_give_the_bits_and_bytes_of_whole_ones():
    """chunk_kb=1 cuts every message into 1 KiB collectives (3 ranks: uneven shards,
    and the sharded exchange's pulls in their own group); the parameters and the
    ledger's bytes are those of the whole messages."""
    results = run_world(3, _chunked, ["sharded", "allgather"], timeout=180)
    for exchange in ("sharded", "allgather"):
        # "auto" measured the link once; every rank cuts its messages alike
        auto = {res[exchange, "auto"][3] for res in results}
        assert len(auto) == 1 and min(auto) >= 64 * 1024 and min(auto) % 1024 == 0, auto
    for res in results:
        for exchange in ("sharded", "allgather"):
            whole, chunked = res[exchange, None], res[exchange, 1]
            assert chunked[3] == 1024 and whole[3] is None
            for a, b in zip(whole[0], res[exchange, "auto"][0]):
                assert torch.equal(a, b), (exchange, "auto")
            assert whole[2] >= 2, whole[2]  # several buckets, each its own group
            for a, b in zip(whole[0], chunked[0]):
                assert torch.equal(a, b), exchange
            assert whole[1] == chunked[1], exchange
            assert chunked[4] > whole[4], (exchange, whole[4], chunked[4])  # more collectives: chunks
        # the run trained: the parameters moved from their initial values
        assert not torch.equal(_net(WIDE).head.weight, res["sharded", 1][0][2])


def test_auto_chunks_are_four_bandwidth_delay_products_and_at_least_64_kib():
    from gossip.comm.distributed import auto_chunk_bytes

    assert auto_chunk_bytes(12.5e6, 2e-4) == 64 * 1024  # 100 Mbit/s, 0.2 ms: the floor
    assert auto_chunk_bytes(12.5e6, 0.02) == 1_000_000 // 1024 * 1024  # 100 Mbit/s, 20 ms: 1 MB
    assert auto_chunk_bytes(1.25e9, 1e-4) == 500_000 // 1024 * 1024  # 10 Gbit/s, 0.1 ms
    assert auto_chunk_bytes(0.0, 0.0) == 64 * 1024


# ------------------------------------------------------------------------ torch's powerSGD_hook
def _hook_initial_q(seed, shapes, rank, rate=2.0):
    """torch's hook's first Q for a bucket whose tensors have ``shapes`` (bucket order):
    drawn for the compressed matrices grouped by shape, first-seen order. Returns
    {position in the bucket: Q (k * r values)}."""
    rng = np.random.RandomState(seed)
    groups = {}
    for i, sh in enumerate(shapes):
        if len(sh) < 2:
            continue
        n, k = sh[0], math.prod(sh[1:])
        r = min(n, k, rank)
        if (n + k) * r * rate < n * k:
            groups.setdefault((n, k), []).append((i, r))
    drawn = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(rng.randint(1_000_000_000))
        for (n, k), members in groups.items():
            for i, r in members:
                drawn[i] = torch.randn(1, k, r).reshape(-1)
    return drawn


def _against_torch(steps, rank, seed):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph

    me = dist.get_rank()
    net_t, net_o = _net(), _net()
    theirs = nn.parallel.DistributedDataParallel(net_t)
    ours = nn.parallel.DistributedDataParallel(net_o)
    opt_t = torch.optim.SGD(theirs.parameters(), lr=LR)
    opt_o = torch.optim.SGD(ours.parameters(), lr=LR)
    pst = ph.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                           min_compression_rate=2, use_error_feedback=True, warm_start=True,
                           orthogonalization_epsilon=0, random_seed=seed)
    state = ddp.hook_state(ours, "powersgd", optimizer=opt_o, rank=rank, momentum=0.0, warmup_steps=2)
    ours.register_comm_hook(state, ddp.hook)
    names = {id(p): n for n, p in net_t.named_parameters()}
    order: list[str] = []

    def spy(s, bucket):  # the bucket's tensor order, which fixes the hook's first Q
        order[:] = [names[id(p)] for p in bucket.parameters()]
        return ph.powerSGD_hook(s, bucket)

    theirs.register_comm_hook(pst, spy)
    diffs = []
    for t in range(steps):
        x, y = _batch(me, t)
        for model, opt in ((theirs, opt_t), (ours, opt_o)):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        if t == 1:
            # our group's first Q set to the hook's first draw, through load_state_dict
            bucket_names = list(order)  # DDP's rebuilt bucket, in the order gradients became ready
            shapes = dict((n, tuple(p.shape)) for n, p in net_t.named_parameters())
            drawn = _hook_initial_q(seed, [shapes[n] for n in bucket_names], rank)
            model_names = [n for n, _ in net_o.named_parameters()]
            q = torch.cat([drawn[bucket_names.index(n)] for n in model_names if bucket_names.index(n) in drawn])
            d = sum(p.numel() for p in net_o.parameters())
            sd = state.state_dict()
            sd["groups"] = [{"names": model_names, "state": {
                "t": 1, "lr": LR, "error": torch.zeros(1, d), "momentum": torch.zeros(0), "q": q.view(1, -1)}}]
            state.load_state_dict(sd)
        if t >= 1:
            a = torch.cat([p.detach().reshape(-1) for p in net_t.parameters()])
            b = torch.cat([p.detach().reshape(-1) for p in net_o.parameters()])
            diffs.append(float((a - b).norm() / a.norm()))
    return diffs, state.groups, order


@pytest.mark.multiprocess
def test_powersgd_hook_agrees_with_torchs_powersgd_hook():
    """Same model, data, rank, warm start, error feedback and first Q; two full-precision
    warm-up iterations in both. Their differences are identities in exact arithmetic
    (docs/centralized.md), so the parameters agree to rounding."""
    results = run_world(2, _against_torch, 6, 1, 3, timeout=180)
    for diffs, groups, order in results:
        assert len(groups) == 1 and sorted(order) == sorted(groups[0])
        assert max(diffs) < 1e-5, diffs


# ------------------------------------------------------------------------ bad input
def test_bad_input_gets_one_line():
    """Checked before the process group is touched: no world needed."""
    model = _net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cases = [
        (dict(algorithm="dcd"), ValueError, r"'dcd' acts on the models.*DDP hooks exist for allreduce, efsgd"),
        (dict(algorithm="nope"), ValueError, r"'nope' is not an algorithm; DDP hooks exist for"),
        (dict(algorithm="efsgd", merge="layer"), ValueError, r"`merge` \(MergeComp\).*not a DDP hook"),
        (dict(algorithm="efsgd", compressor="quant:bits=99"), ValueError, r"`bits` must be an integer in 1..16"),
        (dict(algorithm="powersgd", rnak=2), ValueError, r"unexpected keyword.*rnak.*accepted options: rank"),
        (dict(algorithm="efsgd", warmup_steps=0), ValueError, r"`warmup_steps` must be an int >= 1.*got 0"),
        (dict(algorithm="efsgd", chunk_kb=0), ValueError,
         r"`chunk_kb` must be 'auto', None \(whole exchanges\) or an int >= 1, got 0"),
        (dict(algorithm="efsgd", chunk_kb="64"), ValueError, r"`chunk_kb` must be 'auto'.*got '64'"),
        (dict(algorithm="powersgd", optimizer=sgd), MomentumConflict,
         r"powersgd applies its own momentum.*SGD has momentum 0.9"),
        (dict(algorithm="efsgd"), RuntimeError, r"no process group; call .*init_process_group\(\) first"),
    ]
    for kwargs, kind, pattern in cases:
        with pytest.raises(kind, match=pattern) as info:
            ddp.hook_state(model, **kwargs)
        assert "\n" not in str(info.value), str(info.value)
