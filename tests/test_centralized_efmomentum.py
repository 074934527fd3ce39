"""efmomentum (Vogels et al. 2019, arXiv:1905.13727, Alg. 2 around the compressors of Table 4 / App. G) against a
plain dense reference, in process and in gloo worlds; bytes, restore, config, CLI."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from gossip import algorithms, comm
from gossip import compress as gc
from gossip.algorithms._common import node_keys
from gossip.algorithms.efmomentum import _BLOCK_STREAM
from tests._centralized import assert_restore_bit_identical, layout_of
from tests._dist import run_world

N, D, T = 4, 37, 5
OFFSETS = (0, 10, 12, 30)  # four "tensors" of 10, 2, 18 and 7 values
SIZES = (10, 2, 18, 7)
SEED = 3
SPECS = ["randomblock:k=4", "randomk:p=0.3", "sign", "topk:k=3", "identity"]


def _grads(n: int = N, d: int = D, t: int = T) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randn(t, 1, d, generator=g) + torch.randn(t, n, d, generator=g)


def _bounds(offsets):
    starts = list(offsets) if offsets else [0]
    return list(zip(starts, starts[1:] + [D]))


# ---------------------------------------------------------------- plain references
def _mask(spec: str, numel: int, key: int) -> torch.Tensor:
    """The coordinates a shared-seed sparsifier keeps for this key (the same random
    draws as the algorithm): the non-zeros of the decoded all-ones vector."""
    name, _, params = spec.partition(":")
    c = gc.build(spec)
    if params.startswith("k=") and int(params[2:]) > numel:
        c = gc.build(name, k=numel)
    k = torch.tensor([key], dtype=torch.int64)
    return c.decode(c.encode(torch.ones(1, numel), k), numel)[0] != 0


def _compress_ref(spec: str, x: torch.Tensor, t: int, offsets) -> torch.Tensor:
    """C(x) block by block, written out (Vogels et al. 2019, arXiv:1905.13727, G.1-G.4)."""
    name, _, params = spec.partition(":")
    out = torch.zeros_like(x)
    keys = node_keys(SEED, torch.arange(len(_bounds(offsets))), t, _BLOCK_STREAM)
    for b, (a, z) in enumerate(_bounds(offsets)):
        blk = x[a:z]
        if name == "identity":
            out[a:z] = blk
        elif name == "sign":  # G.3: ||M||_1 / (nm) sign(M), 0 counted as positive
            out[a:z] = (blk.double().abs().sum() / blk.numel() * torch.where(blk < 0, -1.0, 1.0)).float()
        elif name == "topk":  # G.4: the k largest |values|
            k = min(int(params[2:]), blk.numel())
            idx = torch.topk(blk.abs(), k).indices
            out[a + idx] = blk[idx]
        else:  # G.1 / G.2: the values at the shared positions, unscaled
            out[a:z] = torch.where(_mask(spec, z - a, int(keys[b])), blk, 0.0)
    return out


def _reference(grads, spec, lam, nesterov, offsets=OFFSETS):
    """Vogels et al. 2019 (arXiv:1905.13727) Alg. 2 written out worker by worker."""
    T_, n, d = grads.shape
    e = torch.zeros(n, d)
    mom = torch.zeros(d)  # replicated on every worker
    outs, errors = [], []
    for t in range(T_):
        delta = grads[t] + e  # line 7
        sent = torch.stack([_compress_ref(spec, delta[w], t + 1, offsets) for w in range(n)])
        e = delta - sent  # line 9
        agg = sent.mean(0)  # lines 10-11
        mom = lam * mom + agg  # line 12
        outs.append(agg + lam * mom if nesterov else mom)
        errors.append(e.clone())
    return torch.stack(outs), torch.stack(errors)


def _run_sim(spec, grads, n=N, offsets=OFFSETS, **opts):
    c = comm.SimulatedCommunicator(world_size=n)
    opts.setdefault("exchange", "allgather")  # Vogels et al. 2019 (arXiv:1905.13727) Alg. 2: no server compression
    a = algorithms.build("efmomentum", c, compressor=spec, seed=SEED, **opts)
    a.setup(torch.zeros(n, grads.shape[2]), layout_of(offsets, grads.shape[2]))
    outs, errors = [], []
    for t in range(grads.shape[0]):
        a.set_lr(0.1)
        G = grads[t].clone()
        a.reduce_gradients(G)
        outs.append(G.clone())
        errors.append(a.state.error.clone())
    return torch.stack(outs), torch.stack(errors), a, c


CASES = [(s, 0.9, True, OFFSETS) for s in SPECS] + [
    ("topk:k=3", 0.0, True, OFFSETS),
    ("randomblock:k=4", 0.9, False, OFFSETS),
    ("sign", 0.5, False, None),  # one block: the whole vector
    ("randomk:p=0.2", 0.9, True, None),
]


@pytest.mark.parametrize("spec,lam,nesterov,offsets", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_matches_dense_reference(spec, lam, nesterov, offsets):
    grads = _grads()
    got, errs, _, _ = _run_sim(spec, grads, offsets=offsets, momentum=lam, nesterov=nesterov)
    want, want_errs = _reference(grads, spec, lam, nesterov, offsets)
    torch.testing.assert_close(got, want.unsqueeze(1).expand_as(got), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(errs, want_errs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", ["randomblock:k=4", "randomk:p=0.3"])
def test_shared_positions_have_the_papers_shape(spec):
    # every worker keeps the same coordinates; Random Block keeps one run of k per tensor
    keys = node_keys(SEED, torch.arange(4), 1, _BLOCK_STREAM)
    counts = []
    for b, numel in enumerate(SIZES):
        m = _mask(spec, numel, int(keys[b]))
        idx = m.nonzero().squeeze(1)
        counts.append(idx.numel())
        if spec.startswith("randomblock"):
            assert torch.equal(idx, torch.arange(int(idx[0]), int(idx[0]) + idx.numel()))
    assert counts == ([4, 2, 4, 4] if spec.startswith("randomblock") else [3, 1, 5, 2])


@pytest.mark.parametrize("spec", SPECS)
def test_error_feedback_identity(spec):
    """sent + new error == to be sent (g + old error), with sent = C(to be sent); the
    aggregate is the mean of what the workers sent."""
    grads = _grads()
    _, errs, _, _ = _run_sim(spec, grads, momentum=0.0)
    outs, _, _, _ = _run_sim(spec, grads, momentum=0.0)
    old = torch.zeros(N, D)
    for t in range(T):
        to_send = grads[t] + old
        sent = to_send - errs[t]
        want = torch.stack([_compress_ref(spec, to_send[w], t + 1, OFFSETS) for w in range(N)])
        torch.testing.assert_close(sent, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sent + errs[t], to_send, rtol=0, atol=1e-6)
        torch.testing.assert_close(outs[t], sent.mean(0).expand(N, D), rtol=1e-5, atol=1e-5)
        old = errs[t]


@pytest.mark.parametrize("nesterov", [True, False])
def test_identity_is_momentum_sgd_on_the_average(nesterov):
    grads = _grads()
    lr = 0.05
    dirs, errs, _, _ = _run_sim("identity", grads, momentum=0.9, nesterov=nesterov)
    assert float(errs.abs().max()) == 0.0  # nothing is left behind
    x = torch.zeros(D, requires_grad=True)
    opt = torch.optim.SGD([x], lr=lr, momentum=0.9, nesterov=nesterov)
    ours = torch.zeros(D)
    for t in range(T):
        x.grad = grads[t].mean(0)
        opt.step()
        ours = ours - lr * dirs[t, 0]
        for w in range(N):
            assert torch.equal(dirs[t, w], dirs[t, 0])  # every worker, the same step
        torch.testing.assert_close(ours, x.detach(), rtol=1e-6, atol=1e-6)


def _ring(b: int, n: int = N) -> int:
    return (2 * (n - 1) * b + n // 2) // n


def _pad8(b: int) -> int:
    return (b + 7) // 8 * 8


# per block: randomblock k = 4 (2 for the 2-value tensor); randomk round(0.3 d_b) =
# 3, 1, 5, 2; sign: 32-byte header + fp32 scale + ceil(d_b/8) bytes of bits; topk
# k = 3 (2): 32 + 8 k
BYTES = {
    "randomblock:k=4": ("all_reduce", _ring(4 * (4 + 2 + 4 + 4))),
    "randomk:p=0.3": ("all_reduce", _ring(4 * (3 + 1 + 5 + 2))),
    "identity": ("all_reduce", _ring(4 * D)),
    "sign": ("all_gather", (N - 1) * sum(_pad8(32 + 4 + (s + 7) // 8) for s in SIZES)),
    "topk:k=3": ("all_gather", (N - 1) * sum(_pad8(32 + 8 * min(3, s)) for s in SIZES)),
}


@pytest.mark.parametrize("spec", SPECS)
def test_bytes_per_step_equal_the_formula(spec):
    op, per_step = BYTES[spec]
    _, _, a, c = _run_sim(spec, _grads())
    assert a.collective == op
    assert per_step == (_ring(a.message_nbytes) if op == "all_reduce" else (N - 1) * a.message_nbytes)
    for i in range(N):
        assert c.ledger.sent_by(i) == T * per_step
        assert c.ledger.received_by(i) == T * per_step
    ops = c.ledger.as_dict()["ops"]
    assert ops[op]["calls"] == T and sum(v["calls"] for v in ops.values()) == T


@pytest.mark.parametrize("spec", ["randomk:p=0.3", "topk:k=3"])
def test_state_save_restore_bit_identical(spec):
    assert_restore_bit_identical(
        lambda c: algorithms.build("efmomentum", c, compressor=spec, seed=SEED), _grads(), 2,
        layout=layout_of(OFFSETS, D),
    )


def test_config_validation_messages():
    c = comm.SimulatedCommunicator(world_size=2)
    with pytest.raises(ValueError, match=r"^Arg `compressor` of efmomentum must be one of randomblock, "
                       r"randomk, sign, topk \(Vogels et al. 2019, arXiv:1905.13727, G.1-G.4\) or identity, got 'quant:bits=4'$"):
        algorithms.build("efmomentum", c, compressor="quant:bits=4")
    with pytest.raises(TypeError, match=r"Arg `compressor` of efmomentum must be a compressor spec string"):
        algorithms.build("efmomentum", c, compressor=None)
    with pytest.raises(ValueError, match=r"unknown compressor 'nosuch'"):
        algorithms.build("efmomentum", c, compressor="nosuch")
    with pytest.raises(ValueError, match=r"topk: parameter `p` must be a number in \(0, 1\]"):
        algorithms.build("efmomentum", c, compressor="topk:p=2")
    with pytest.raises(ValueError, match=r"Arg `momentum` must satisfy 0 <= momentum < 1, got 1.0"):
        algorithms.build("efmomentum", c, momentum=1.0)
    with pytest.raises(TypeError, match=r"Arg `nesterov` must be a bool, got 'yes'"):
        algorithms.build("efmomentum", c, nesterov="yes")
    with pytest.raises(ValueError, match=r"Arg `seed` must be >= 0, got -1"):
        algorithms.build("efmomentum", c, seed=-1)
    with pytest.raises(ValueError, match=r"unexpected keyword argument 'offsets'"):
        algorithms.build("efmomentum", c, offsets=(0, 5, 5))  # the blocks come from the layout
    with pytest.raises(ValueError, match=r"efmomentum: .*accepted options: .*compressor"):
        algorithms.build("efmomentum", c, rank=2)
    a = algorithms.build("efmomentum", c)
    with pytest.raises(ValueError, match=r"efmomentum: the layout's tensors hold 12 values, the flat parameters 9"):
        a.setup(torch.zeros(2, 9), algorithms.ParamLayout(((3,), (9,))))
    with pytest.raises(RuntimeError, match=r"call setup\(\) before set_lr"):
        a.set_lr(0.1)
    a.setup(torch.zeros(2, 10))
    with pytest.raises(ValueError, match=r"Arg `lr` must be a positive finite number, got 0"):
        a.set_lr(0)
    # empty tensors of the layout make no block
    a.setup(torch.zeros(2, 7), algorithms.ParamLayout(((3,), (0,), (4,))))
    assert [(b.start, b.stop) for b in a.blocks] == [(0, 3), (3, 7)]


# ---------------------------------------------------------------- real processes
def _dist_worker(n):
    import torch.distributed as dist

    rank = dist.get_rank()
    grads = _grads(n=n)
    c = comm.DistCommunicator(timeout=30)
    out = []
    for spec in SPECS:
        a = algorithms.build("efmomentum", c, compressor=spec, seed=SEED, exchange="allgather")
        a.setup(torch.zeros(1, D), layout_of(OFFSETS, D))
        traj = []
        for t in range(T):
            G = grads[t, rank : rank + 1].clone()
            a.reduce_gradients(G)
            traj.append(G[0].clone())
        out.append(torch.stack(traj))
    return out, c.ledger.bytes_sent


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 4])
def test_real_processes_equal_simulation_and_reference(n):
    results = run_world(n, _dist_worker, n, timeout=120)
    grads = _grads(n=n)
    sent_sim = 0
    for k, spec in enumerate(SPECS):
        sim, _, a, c = _run_sim(spec, grads, n=n)
        want, _ = _reference(grads, spec, 0.9, True)
        sent_sim += c.ledger.sent_by(0)
        for rank, (trajs, _) in enumerate(results):
            if a.linear:  # gloo's ring sums in its own order
                torch.testing.assert_close(trajs[k], sim[:, rank], rtol=1e-6, atol=1e-6)
            else:  # the same payloads decoded and averaged the same way
                assert torch.equal(trajs[k], sim[:, rank]), (spec, rank)
            torch.testing.assert_close(trajs[k], want, rtol=1e-5, atol=1e-5)
    assert all(sent == sent_sim for _, sent in results)


# ---------------------------------------------------------------- the CLI
def _train(*args: str) -> tuple[int, str, str]:
    from gossip import train as gossip_train

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = gossip_train.main(list(args))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return rc, out.getvalue(), err.getvalue()


QUICK = ["--simulate", "2", "--algo", "efmomentum", "--data", "synthetic", "--epochs", "2",
         "--batch-size", "64", "--no-progress", "--max-steps", "4"]


@pytest.mark.parametrize("extra", [[], ["--compressor", "randomblock:p=0.05", "--momentum", "0.5"]])
def test_runs_from_the_cli(tmp_path, extra):
    out = tmp_path / "run"
    rc, stdout, stderr = _train(*QUICK, "--out", str(out), *extra)
    assert rc == 0, stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["algo"] == "efmomentum" and s["steps"] == 4
    assert 0 < s["bytes_sent_per_node_per_step"] < 0.5 * 4 * s["params"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["local_momentum"] == 0.0  # the algorithm owns its momentum
    assert cfg["compressor_spec"] == (extra[1] if extra else "topk")


def test_cli_rejects_other_compressors_in_one_line(tmp_path):
    rc, _, stderr = _train(*QUICK, "--out", str(tmp_path / "run"), "--compressor", "quant:bits=4")
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, stderr
    assert "efmomentum" in lines[0] and "randomblock, randomk, sign, topk" in lines[0]
