"""MergeComp (Wang et al. 2021, arXiv:2103.15195): grouped error-feedback compression against plain references,
overlap with backward in real gloo worlds, the search, checkpoints and the CLI."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from torch import nn

from gossip import algorithms, comm
from gossip import compress as gc
from gossip.algorithms._common import node_keys, shared_key
from gossip.runtime import GossipOptimizer
from gossip.algorithms import ParamLayout
from gossip.algorithms.mergecomp import MergeComp, MergeCompConfig
from gossip.schedule import Partition
from tests._dist import run_world
from tests.test_train import QUICK, _one_error_line, final_params, train

SHAPES = ((6, 4), (6,), (5, 6), (5,), (3, 5), (3,))
D = sum(math.prod(s) for s in SHAPES)
N, T = 4, 6
LRS = [0.1, 0.1, 0.05, 0.05, 0.2, 0.02]
SPECS = ["sign", "topk:p=0.2", "quant:bits=4", "randomk:p=0.3", "qsgd:levels=4", "fp16", "blocksign"]


def _grads(n=N, t=T, d=D, seed=3):
    return torch.randn(t, n, d, generator=torch.Generator().manual_seed(seed))


def _build(spec, merge="layer", n=N, mu=0.0, shapes=SHAPES, **kw):
    c = comm.SimulatedCommunicator(world_size=n)
    alg = MergeComp(MergeCompConfig(compressor=spec, merge=merge, momentum=mu, **kw), c)
    alg.setup(torch.zeros(n, sum(math.prod(s) for s in shapes)), ParamLayout(tuple(shapes)))
    return alg, c


def _run(alg, grads, lrs=LRS, partitions=None):
    outs = []
    for t in range(grads.shape[0]):
        if partitions is not None and partitions[t] is not None:
            alg.set_partition(partitions[t])
        alg.set_lr(lrs[t])
        G = grads[t].clone()
        alg.reduce_gradients(G)
        outs.append(G.clone())
    return torch.stack(outs)


# ---------------------------------------------------------------- plain reference
def _tensor_ranges(shapes):
    out, o = [], 0
    for s in shapes:
        out.append((o, o + math.prod(s)))
        o += math.prod(s)
    return out


def _reference(grads, lrs, mu, spec, orders, partitions, shapes=SHAPES, seed=0):
    """dist-EF-SGD group by group, written out node by node. ``orders[t]``: the tensors
    in backward order at step t; ``partitions[t]``: the group sizes. The memories live
    in parameter order, so a change of order or partition cannot lose them."""
    T_, n, d = grads.shape
    ranges = _tensor_ranges(shapes)
    e, es, mom = torch.zeros(n, d), torch.zeros(d), torch.zeros(n, d)
    prev, outs = 0.0, []
    for t in range(T_):
        ratio = prev / lrs[t]
        tag = t + 1
        out = torch.zeros(d)
        order, sizes = orders[t], partitions[t]
        first = 0
        for k, size in enumerate(sizes):
            tensors = order[first : first + size]
            first += size
            idx = torch.cat([torch.arange(*ranges[j]) for j in tensors])
            if spec == "blocksign":  # one block per tensor of the group
                offs, o = [], 0
                for j in tensors:
                    offs.append(o)
                    o += ranges[j][1] - ranges[j][0]
                comp = gc.build("blocksign", offsets=tuple(offs))
            else:
                comp = gc.build(spec)
            x = idx.numel()
            pushed = []
            for i in range(n):
                g = grads[t, i, idx]
                if mu > 0:
                    mom[i, idx] = mu * mom[i, idx] + g
                    v = g + mu * mom[i, idx]
                else:
                    v = g
                p = v + ratio * e[i, idx] if ratio != 0 else v.clone()
                key = node_keys(seed, torch.tensor([i]), t + 1, 2 * k)
                delta = comp.decode(comp.encode(p[None], key, tag=tag), x, tag=tag)[0]
                e[i, idx] = p - delta
                pushed.append(delta)
            pt = torch.stack(pushed).mean(0)
            pt = pt + ratio * es[idx] if ratio != 0 else pt
            skey = torch.tensor([shared_key(seed, t + 1, 2 * k + 1)])
            dt = comp.decode(comp.encode(pt[None], skey, tag=tag), x, tag=tag)[0]
            es[idx] = pt - dt
            out[idx] = dt
        outs.append(out.expand(n, d).clone())
        prev = lrs[t]
    return torch.stack(outs)


# ---------------------------------------------------------------- in-process
@pytest.mark.parametrize("spec", [s for s in SPECS if s != "blocksign"] + ["identity"])
@pytest.mark.parametrize("mu", [0.0, 0.5])
def test_whole_model_is_exactly_efsgd(spec, mu):
    grads = _grads()
    alg, _ = _build(spec, "whole", mu=mu)
    ref_alg = algorithms.build("efsgd", comm.SimulatedCommunicator(world_size=N), compressor=spec, momentum=mu,
                               exchange="allgather")  # MergeComp keeps the replicated server
    ref_alg.setup(torch.zeros(N, D))
    ref = _run(ref_alg, grads)
    assert torch.equal(_run(alg, grads), ref)


def test_blocksign_whole_model_is_exactly_efblocksgd():
    grads = _grads()
    alg, _ = _build("blocksign", "whole", mu=0.9)
    ref_alg = algorithms.build("efblocksgdm", comm.SimulatedCommunicator(world_size=N), momentum=0.9,
                               exchange="allgather")
    ref_alg.setup(torch.zeros(N, D), ParamLayout(SHAPES))  # one block per tensor
    assert torch.equal(_run(alg, grads), _run(ref_alg, grads))


@pytest.mark.parametrize("spec", ["identity", "fp16"])
def test_linear_compressors_give_the_same_result_with_any_partition(spec):
    grads = _grads()
    whole = _run(_build(spec, "whole", mu=0.5)[0], grads)
    for merge, parts in [("layer", None), ("layer", [(2, 4)] + [None] * 5), ("layer", [(1, 2, 3), None, (6,), None, (3, 3), None])]:
        got = _run(_build(spec, merge, mu=0.5)[0], grads, partitions=parts)
        assert torch.equal(got, whole), (merge, parts)


@pytest.mark.parametrize("spec", SPECS)
def test_groups_match_the_plain_reference_and_memories_survive_repartitioning(spec):
    grads = _grads()
    n_t = len(SHAPES)
    rev = tuple(reversed(range(n_t)))  # the simulation's backward order
    parts = [(1,) * n_t, None, None, (2, 4), None, (1, 1, 4)]
    sizes = [(1,) * n_t] * 3 + [(2, 4)] * 2 + [(1, 1, 4)]
    alg, _ = _build(spec, "layer", mu=0.5)
    got = _run(alg, grads, partitions=parts)
    ref = _reference(grads, LRS, 0.5, spec, [rev] * T, sizes)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_state_save_and_restore_is_bit_identical():
    grads = _grads(t=8)
    lrs = LRS + [0.1, 0.1]
    a, _ = _build("quant:bits=4", "layer", mu=0.5)
    _run(a, grads[:4], lrs[:4], partitions=[None, (2, 4), None, None])
    sd = a.state_dict()
    rest = _run(a, grads[4:], lrs[4:])
    b, _ = _build("quant:bits=4", "layer", mu=0.5)
    b.load_state_dict(sd)
    assert b.partition == Partition((2, 4))
    assert torch.equal(_run(b, grads[4:], lrs[4:]), rest)
    assert sd["sizes"] == (2, 4)  # the checkpoint holds the partition


def test_bytes_are_the_group_payloads():
    """Each group's payload goes to the N - 1 other workers (all-gather); fewer groups
    carry fewer headers for the same values."""
    comp = gc.build("topk:p=0.2")
    for merge, sizes in [("layer", [math.prod(s) for s in SHAPES]), ("whole", [D])]:
        alg, c = _build("topk:p=0.2", merge)
        _run(alg, _grads(t=1), [0.1])
        want = (N - 1) * sum(comp.payload_nbytes(x) for x in sizes)
        assert c.ledger.as_dict()["bytes"]["sent"] == N * want
        assert c.ledger.as_dict()["ops"]["all_gather"]["calls"] == len(sizes)
    # identity is all-reduced: 2 (N - 1) / N of 4 bytes per value
    alg, c = _build("identity", "layer")
    _run(alg, _grads(t=1), [0.1])
    assert c.ledger.as_dict()["ops"]["all_reduce"]["calls"] == len(SHAPES)
    assert c.ledger.as_dict()["bytes"]["sent"] == N * sum(
        (2 * (N - 1) * 4 * math.prod(s) + N // 2) // N for s in SHAPES
    )


@pytest.mark.parametrize("kw,needle", [
    ({"merge": "0"}, "layer, whole, auto"),
    ({"merge": "lots"}, "layer, whole, auto"),
    ({"merge": 7}, "only 6 parameter tensors"),
    ({"compressor": "blocksign:block=4"}, "blocksign"),
    ({"alpha": 1.0}, "alpha"),
    ({"max_groups": 0}, "max_groups"),
    ({"trial_steps": 0}, "trial_steps"),
])
def test_config_errors(kw, needle):
    with pytest.raises((ValueError, TypeError), match=needle):
        MergeComp(MergeCompConfig(**kw), comm.SimulatedCommunicator(world_size=1)).setup(
            torch.zeros(1, D), ParamLayout(SHAPES))


def test_auto_needs_one_node_per_process():
    with pytest.raises(ValueError, match="torchrun"):
        _build("sign", "auto", n=2)


# ---------------------------------------------------------------- real worlds
class _MLP(nn.Module):
    def __init__(self, width=16, depth=3):
        super().__init__()
        dims = [8] + [width] * depth + [4]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x):
        for i, lin in enumerate(self.layers):
            x = lin(x)
            if i + 1 < len(self.layers):
                x = torch.relu(x)
        return x


def _world_train(spec, merge, steps, parts, width=16, depth=3, batch=32, keep=False, **kw):
    """Train a small MLP with hooks; return what each step produced."""
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _MLP(width, depth)
    c = comm.DistCommunicator(timeout=60)
    alg = MergeComp(MergeCompConfig(compressor=spec, merge=merge, momentum=0.5, **kw), c)
    alg.keep_timeline = keep
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gopt = GossipOptimizer(model, opt, alg)
    g = torch.Generator().manual_seed(10 + rank)
    raw, reduced, orders, sizes, timelines = [], [], [], [], []
    for t in range(steps):
        if parts is not None and parts[t] is not None:
            alg.set_partition(parts[t])
        orders.append(alg.state.order)
        sizes.append(alg.state.sizes)
        alg.set_lr(0.05)
        gopt.zero_grad()
        x = torch.randn(batch, 8, generator=g)
        y = torch.randint(0, 4, (batch,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        raw.append(gopt.flat.gather_grads()[0].clone())
        G = gopt.flat.gather_grads()
        alg.reduce_gradients(G)  # what GossipOptimizer.step does, with G kept
        gopt.flat.scatter_grads(G)
        opt.step()
        reduced.append(G[0].clone())
        timelines.append(list(alg.last_timeline))
    return {
        "raw": torch.stack(raw), "reduced": torch.stack(reduced), "orders": orders, "sizes": sizes,
        "timelines": timelines, "params": gopt.flat.data[0].clone(), "report": alg.report(),
        "shapes": gopt.layout.shapes, "state_sizes": alg.state.sizes, "phase": alg.state.phase,
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", ["quant:bits=4", "topk:p=0.3"])
def test_world_with_hooks_matches_the_reference(spec):
    """Groups launched from the backward hooks of real processes (gloo) give what the
    plain reference gives with the same gradients, order and partitions."""
    n_t = 8
    parts = [None, None, (3, 5), None, (1, 2, 5)]
    res = run_world(2, _world_train, spec, "layer", 5, parts, timeout=120)
    a, b = res
    assert torch.equal(a["params"], b["params"]) and a["orders"] == b["orders"]
    # the order learnt from the hooks is backward order: last layer first
    assert a["orders"][0] == tuple(reversed(range(n_t)))
    learnt = a["orders"][1]
    assert sorted(learnt) == list(range(n_t))
    grads = torch.stack([a["raw"], b["raw"]], dim=1)
    ref = _reference(grads, [0.05] * 5, 0.5, spec, a["orders"], a["sizes"], shapes=a["shapes"])
    torch.testing.assert_close(a["reduced"], ref[:, 0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(b["reduced"], ref[:, 1], rtol=1e-6, atol=1e-6)


@pytest.mark.multiprocess
def test_communication_overlaps_backward():
    """Timestamps, not sleeps: with one group per tensor the first group (the last
    layer's bias) is encoded and its collective posted while backward is still
    producing gradients, and every group is in flight before the step begins."""
    res = run_world(2, _world_train, "sign", "layer", 4, None, 384, 4, 256, True, timeout=120)
    for r in res:
        tl = r["timelines"][-1]
        grads = [tm for ev, _, tm in tl if ev == "grad"]
        launches = {k: tm for ev, k, tm in tl if ev == "launch"}
        step = [tm for ev, _, tm in tl if ev == "step"]
        assert len(grads) == 10 and len(launches) == 10 and len(step) == 1
        backward_end = max(grads)
        # posted during backward: all but the last group before the last gradient
        assert launches[0] < backward_end
        assert sum(tm < backward_end for tm in launches.values()) == 9, tl
        assert max(launches.values()) < step[0]
        # group k leaves right after its own gradient, not at the end
        grad_at = {k: tm for ev, k, tm in tl if ev == "grad"}
        assert all(grad_at[k] <= launches[k] < grad_at.get(k + 1, float("inf")) for k in range(10)), tl


@pytest.mark.multiprocess
def test_auto_search_decides_the_same_partition_on_every_rank():
    res = run_world(2, _world_train, "topk:p=0.1", "auto", 11, None, timeout=120,
                    profile_steps=2, trial_steps=2)
    a, b = res
    assert a["phase"] == b["phase"] == "done"
    assert a["state_sizes"] == b["state_sizes"] and sum(a["state_sizes"]) == 8
    assert torch.equal(a["params"], b["params"])
    rep = a["report"]
    assert rep["model"]["g"]["per_value"] >= 0 and rep["model"]["h"]["base"] >= 0
    assert set(rep["candidates"]) == {"1", "2"}
    for cand in rep["candidates"].values():
        assert cand["predicted_s"] > 0 and cand["measured_s"] > 0
    assert any("chosen" in line for line in rep["log"])
    # steps: 1 to learn the order, 2 profiled layer-wise, then the candidates y = 1, 2
    # interleaved: a warm-up round and 2 timed rounds
    assert a["sizes"][1:3] == [(1,) * 8] * 2
    assert [len(s) for s in a["sizes"][3:9]] == [1, 2] * 3


# ---------------------------------------------------------------- the CLI
MC = ["--algo", "efsgd", "--compressor", "topk:p=0.05", "--model", "mlp", *QUICK]


def test_cli_resume_keeps_the_chosen_partition(tmp_path):
    """auto decides at step 16 (1 + 5 profiled + 2 candidates x (1 + 4) trial steps); a
    run resumed from its step-18 checkpoint ends bit-identical to the uninterrupted run."""
    full = tmp_path / "full"
    args = ["--simulate", "1", *MC, "--merge", "auto", "--max-steps", "22", "--checkpoint-every", "18"]
    r = train(*args, "--out", str(full))
    assert r.returncode == 0, r.stderr
    assert "mergecomp: partition" in r.stdout and "cost model" in r.stdout
    s = json.loads((full / "summary.json").read_text())
    assert s["merge"]["phase"] == "done" and sum(s["merge"]["sizes"]) == 6
    part = tmp_path / "part"
    shutil.copytree(full, part)
    for f in part.glob("ckpt-step22-*"):
        f.unlink()
    r = train(*args, "--resume", str(part))
    assert r.returncode == 0, r.stderr
    assert "restored from the checkpoint" in r.stdout
    assert torch.equal(final_params(full), final_params(part))
    assert json.loads((part / "summary.json").read_text())["merge"]["sizes"] == s["merge"]["sizes"]


@pytest.mark.parametrize("merge", ["layer", "whole"])
def test_cli_fixed_partitions_in_simulation(tmp_path, merge):
    r = train("--simulate", "2", *MC, "--merge", merge, "--max-steps", "4", "--out", str(tmp_path / merge))
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / merge / "summary.json").read_text())
    assert s["merge"]["groups"] == (6 if merge == "layer" else 1)


@pytest.mark.parametrize("args,needles", [
    (["--merge", "0"], ["--merge", "layer, whole, auto"]),
    (["--merge", "everything"], ["--merge", "layer, whole, auto"]),
    (["--merge", "99"], ["--merge 99", "only 6 parameter tensors"]),
    (["--merge", "auto", "--simulate", "2"], ["torchrun"]),
    (["--merge", "layer", "--merge-alpha", "2"], ["--merge-alpha"]),
    (["--merge", "layer", "--merge-max-groups", "0"], ["--merge-max-groups"]),
])
def test_cli_bad_merge_values(args, needles):
    base = ["--simulate", "1", *MC] if "--simulate" not in args else MC
    _one_error_line(train(*base, *args), *needles)


def test_cli_merge_needs_an_error_feedback_algorithm():
    _one_error_line(train("--simulate", "2", "--algo", "dcd", "--merge", "layer", *QUICK), "--merge", "efsgd")
