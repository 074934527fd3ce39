"""Communicating less often: localsgd, slowmo, diloco, dpsgd's local_steps, and the
local optimizer (--optimizer sgd/adamw) with the momentum-ownership rule.

Reductions to the algorithms they generalise (on the in-process simulation, through
GossipOptimizer as a user calls it), bytes against the ledger, resume in the middle of
a round, torchrun against the simulation, and the refused combinations.
"""

from __future__ import annotations

import json
import math
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import topologies
from gossip.algorithms._sharded import ShardPlan
from gossip import algorithms, checkpoint, comm, compress
from gossip.train.config import ConfigError, TrainConfig
from gossip.runtime import GossipOptimizer, MomentumConflict
from tests.conftest import torchrun_jobs
from tests.test_train import QUICK, _one_error_line, final_params, train, why

FEATURES, CLASSES = 6, 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(FEATURES, 8)
        self.b = nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def run(name: str, steps: int, *, nodes: int = 4, lr: float = 0.1, adamw: bool = False, **opts):
    """Final (nodes, d) parameters and the ledger of ``steps`` plain-SGD steps."""
    topo = topologies.build("ring", nodes) if algorithms.is_decentralized(name) else None
    c = comm.SimulatedCommunicator(topo, world_size=nodes)
    models = []
    for _ in range(nodes):
        torch.manual_seed(0)
        models.append(Net())
    if adamw:
        opts_ = [torch.optim.AdamW(m.parameters(), lr=lr) for m in models]
    else:
        opts_ = [torch.optim.SGD(m.parameters(), lr=lr) for m in models]
    opt = GossipOptimizer(models, opts_, algorithms.build(name, c, **opts))
    train_steps(opt, torch.Generator().manual_seed(1), steps)
    return opt.flat.data.clone(), c.ledger.as_dict(), opt


def train_steps(opt: GossipOptimizer, gen: torch.Generator, steps: int) -> None:
    """``steps`` steps of ``opt``: every node a batch of 16 random examples from ``gen``,
    in node order (a resumed run that skips ``k`` steps draws ``k`` steps first)."""
    for _ in range(steps):
        opt.zero_grad()
        for m in opt.models:
            x = torch.randn(16, FEATURES, generator=gen)
            y = torch.randint(0, CLASSES, (16,), generator=gen)
            F.cross_entropy(m(x), y).backward()
        opt.step()


# ---------------------------------------------------------------------------- reductions
def test_localsgd_with_one_local_step_is_allreduce():
    ref, _, _ = run("allreduce", 12)
    got, _, _ = run("localsgd", 12, local_steps=1)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_slowmo_with_alpha_1_beta_0_is_localsgd():
    ref, _, _ = run("localsgd", 12, local_steps=3)
    got, _, _ = run("slowmo", 12, local_steps=3, slow_lr=1.0, slow_momentum=0.0)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    other, _, _ = run("slowmo", 12, local_steps=3)  # beta = 0.7 does move elsewhere
    assert (other - ref).abs().max() > 1e-3


def test_diloco_h1_sgd_outer_lr_1_no_momentum_is_allreduce():
    ref, _, _ = run("allreduce", 12)
    got, _, _ = run("diloco", 12, local_steps=1, outer_lr=1.0, outer_momentum=0.0)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_diloco_outer_step_is_nesterov_sgd_on_the_pseudo_gradient():
    """One round by hand: torch.optim.SGD(lr=0.7, momentum=0.9, nesterov=True) from theta
    on the outer gradient Delta = theta - mean_i x_i."""
    H = 3
    local, _, _ = run("localsgd", H, local_steps=10**6)  # the same H inner steps, never averaged
    got, _, opt = run("diloco", H, local_steps=H)
    torch.manual_seed(0)
    theta = torch.nn.utils.parameters_to_vector(Net().parameters()).detach()
    delta = theta - local.mean(0)
    p = torch.nn.Parameter(theta.clone())
    p.grad = delta
    torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True).step()
    torch.testing.assert_close(got, p.detach().expand_as(got), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.algorithm.state.momentum[0], delta, rtol=1e-5, atol=1e-6)
    assert torch.equal(opt.algorithm.state.start, got)  # the next round starts here


def test_dpsgd_local_steps_gossips_every_h_steps():
    ref, led1, _ = run("dpsgd", 8)
    same, _, _ = run("dpsgd", 8, local_steps=1)
    assert torch.equal(ref, same)  # H = 1 is D-PSGD exactly
    got, led4, _ = run("dpsgd", 8, local_steps=4)
    assert led4["ops"]["exchange"]["sent"] == led1["ops"]["exchange"]["sent"] // 4  # 2 exchanges, not 8
    assert not torch.allclose(got, ref)
    with pytest.raises(ValueError, match=r"Arg `local_steps` must be .*>= 1.*got 0"):
        algorithms.DPSGDConfig(local_steps=0)


# ---------------------------------------------------------------------------- bytes
def _ring(nbytes: int, n: int) -> int:
    return int(2 * (n - 1) * nbytes / n + 0.5)


@pytest.mark.parametrize("n", [2, 4])
def test_bytes_per_round_are_one_allreduce_of_the_model(n):
    d = sum(p.numel() for p in Net().parameters())
    for name, opts in (("localsgd", {}), ("slowmo", {}), ("diloco", {}), ("diloco", {"fragments": 3})):
        _, led, _ = run(name, 12, nodes=n, local_steps=4, **opts)
        sent = led["bytes"]["sent"] / n  # per node, 3 rounds
        if opts:  # three all-reduces of a fragment each, rounded per call
            assert abs(sent - 3 * _ring(4 * d, n)) <= 3 * 3, (name, opts, sent)
        else:
            assert sent == 3 * _ring(4 * d, n), (name, sent)


def test_diloco_4bit_pseudo_gradients_send_an_eighth_plus_headers():
    d = sum(p.numel() for p in Net().parameters())
    _, full, _ = run("diloco", 8, nodes=2, local_steps=4)
    _, q4, opt = run("diloco", 8, nodes=2, local_steps=4, compressor="quant:bits=4", error_feedback=True,
                     exchange="allgather")
    payload = compress.build("quant:bits=4").payload_nbytes(d)
    assert q4["bytes"]["sent"] / 2 == 2 * payload  # one all-gathered payload per round, 2 rounds
    assert full["bytes"]["sent"] / 2 == 2 * 4 * d
    # the default sharded exchange: per round each node pushes the other's shard and pulls its own
    # back to the other, one shard message (16-byte header) each way, plus the 16-byte check of the
    # shard sizes the first time
    _, q4s, opts = run("diloco", 8, nodes=2, local_steps=4, compressor="quant:bits=4", error_feedback=True)
    plan = opts.algorithm.plans[0]
    assert opts.algorithm.collective == "sharded" and q4s["bytes"]["sent"] / 2 == 2 * plan.total_nbytes + 16
    # an eighth of the fp32 all-reduce (4-bit codes, d / 2 bytes), plus the 32-byte header and the
    # two fp32 scalars of the quantizer (lo, step), padded to 8 bytes
    assert payload == 8 * math.ceil((32 + 8 + math.ceil(4 * d / 8)) / 8)
    assert opt.algorithm.wire_format().to_dict() == {"label": "quant:bits=4", "bits_per_coord": 4.0}
    assert opt.algorithm.collective == "all_gather" and opt.algorithm.state.error.abs().sum() > 0


def test_diloco_linear_compressor_all_reduces_its_kept_values():
    d = sum(p.numel() for p in Net().parameters())
    _, led, opt = run("diloco", 4, nodes=4, local_steps=4, compressor="randomk:p=0.5")
    assert opt.algorithm.collective == "all_reduce"
    k = compress.build("randomk:p=0.5").count(d)
    assert led["bytes"]["sent"] / 4 == _ring(4 * k, 4)


def test_diloco_fragments_sync_at_staggered_steps():
    """H = 6, F = 3: fragment f synchronises after steps t = 2 (f + 1) mod 6."""
    c = comm.SimulatedCommunicator(world_size=2)
    algo = algorithms.build("diloco", c, local_steps=6, fragments=3)
    algo.setup(torch.zeros(2, 30), algorithms.ParamLayout.from_shapes([(10,), (10,), (10,)]))
    assert algo.offsets() == [2, 4, 0] and algo.fragments == [(0, 10), (10, 20), (20, 30)]
    synced = []
    for t in range(1, 13):
        before = algo.state.start.clone()
        algo.set_lr(0.1)
        algo.step(torch.zeros(2, 30) + t, torch.ones(2, 30))
        changed = sorted({int(i) // 10 for i in torch.nonzero((algo.state.start != before)[0]).flatten()})
        synced.append((t, changed))
    assert [s for s in synced if s[1]] == [(2, [0]), (4, [1]), (6, [2]), (8, [0]), (10, [1]), (12, [2])]
    assert algo.report()["fragments"][0] == {"start": 0, "stop": 10, "sync_step_mod_h": 2}


# ---------------------------------------------------------------------------- the overlapped outer step
def _eager_reference(X, A, H, steps, lr_out, mu):
    """The eager updates of Kale et al. (arXiv:2502.12996) written plainly: node i's outer
    step at the end of round k uses Delta^{k-1} + (Delta_i^k - Delta_i^{k-1}) / n, the
    mean of round k-1 arriving only then; Nesterov from each node's own theta."""
    n = X.shape[0]
    x, theta, b = X.clone(), X.clone(), torch.zeros_like(X)
    last, prev_mean = torch.zeros_like(X), torch.zeros(1, X.shape[1])
    for t in range(1, steps + 1):
        x = x + -0.1 * (x - A)
        if t % H == 0:
            fresh = theta - x
            est = prev_mean + (fresh - last) / n
            prev_mean, last = fresh.sum(0, keepdim=True) / n, fresh
            b = mu * b + est
            x = theta - lr_out * (est + mu * b)
            theta = x.clone()
    return x


@pytest.mark.parametrize("mu", [0.0, 0.9])
def test_diloco_outer_delay_is_the_eager_update(mu):
    n, H, steps = 3, 3, 13  # rounds end at 3, 6, 9, 12; round 4's exchange is in flight at the end
    g = torch.Generator().manual_seed(5)
    X, A = torch.randn(n, 7, generator=g), torch.randn(n, 7, generator=g)
    algo = algorithms.build("diloco", comm.SimulatedCommunicator(world_size=n), local_steps=H, outer_lr=0.7,
                            outer_momentum=mu, outer_delay=1)
    Y = X.clone()
    algo.setup(Y)
    for _ in range(steps):
        algo.set_lr(0.1)
        algo.step(Y, -0.1 * (Y - A))
    torch.testing.assert_close(Y, _eager_reference(X, A, H, steps, 0.7, mu), rtol=1e-6, atol=1e-7)
    assert (Y[0] - Y[1]).abs().max() > 1e-4  # each node stepped on its own estimate
    sync = algorithms.build("diloco", comm.SimulatedCommunicator(world_size=n), local_steps=H, outer_lr=0.7,
                            outer_momentum=mu)
    Z = X.clone()
    sync.setup(Z)
    for _ in range(steps):
        sync.set_lr(0.1)
        sync.step(Z, -0.1 * (Z - A))
    assert (Z - Y).abs().max() > 1e-3  # the delay does change the trajectory


@pytest.mark.parametrize("steps", [12, 13])
def test_diloco_outer_delay_finish_applies_the_exchange_in_flight(steps):
    """At the schedule's end the last round's exchange is in flight and each node has
    applied only its own share of its mean. ``finish`` applies the rest: without outer
    momentum the replicas' theta then agree, and the inner steps taken since the round's
    end are kept. ``finish(final=False)`` (a run stopped to be resumed) changes nothing."""
    n, H = 3, 3
    g = torch.Generator().manual_seed(5)
    X, A = torch.randn(1, 7, generator=g).expand(n, -1).clone(), torch.randn(n, 7, generator=g)  # one start
    algo = algorithms.build("diloco", comm.SimulatedCommunicator(world_size=n), local_steps=H, outer_lr=0.7,
                            outer_momentum=0.0, outer_delay=1)
    Y = X.clone()
    algo.setup(Y)
    for _ in range(steps):
        algo.set_lr(0.1)
        algo.step(Y, -0.1 * (Y - A))
    before, theta = Y.clone(), algo.state.start.clone()
    assert (theta[0] - theta[1]).abs().max() > 1e-4  # each node's own share applied ahead of the mean
    algo.finish(Y, final=False)
    assert torch.equal(Y, before) and algo.state.in_flight == (0,)
    algo.finish(Y)
    assert algo.state.in_flight == () and not algo.state.last_delta.any()
    torch.testing.assert_close(algo.state.start, algo.state.start[:1].expand(n, -1), rtol=0, atol=1e-6)
    torch.testing.assert_close(Y - algo.state.start, before - theta, rtol=0, atol=1e-6)  # inner steps kept
    algo.finish(Y)  # nothing left in flight: a second call is a no-op
    torch.testing.assert_close(Y - algo.state.start, before - theta, rtol=0, atol=1e-6)


def test_diloco_outer_delay_on_one_node_is_diloco():
    """With n = 1 the eager estimate Delta^{k-1} + (Delta^k - Delta^{k-1}) is the fresh
    pseudo-gradient: the overlapped outer step is the synchronous one."""
    g = torch.Generator().manual_seed(2)
    X, A = torch.randn(1, 6, generator=g), torch.randn(1, 6, generator=g)
    out = []
    for delay in (0, 1):
        algo = algorithms.build("diloco", comm.SimulatedCommunicator(world_size=1), local_steps=2, outer_delay=delay)
        Y = X.clone()
        algo.setup(Y)
        for _ in range(9):
            algo.set_lr(0.1)
            algo.step(Y, -0.1 * (Y - A))
        out.append(Y)
    torch.testing.assert_close(out[1], out[0], rtol=1e-6, atol=1e-7)


class _Clocked(comm.SimulatedCommunicator):
    """The simulation, noting at which algorithm step each all-reduce is posted and waited."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.now, self.log = 0, []

    def all_reduce_async(self, X, op="sum", *, record=True):
        done, posted, log, me = super().all_reduce_async(X, op, record=record), self.now, self.log, self

        class Later:
            def wait(self):
                log.append((posted, me.now))
                return done.wait()

        return Later()


def test_diloco_outer_delay_waits_each_exchange_one_round_later():
    c = _Clocked(world_size=2)
    algo = algorithms.build("diloco", c, local_steps=4, outer_delay=1)
    Y = torch.zeros(2, 5)
    algo.setup(Y)
    for t in range(1, 17):
        c.now = t
        algo.set_lr(0.1)
        algo.step(Y, torch.full_like(Y, 0.01))
    assert c.log == [(4, 8), (8, 12), (12, 16)]  # round 4's, posted at step 16, still in flight
    assert algo.report()["outer_delay"] == 1
    c0 = _Clocked(world_size=2)
    sync = algorithms.build("diloco", c0, local_steps=4)
    sync.setup(torch.zeros(2, 5))
    for t in range(1, 9):
        c0.now = t
        sync.set_lr(0.1)
        sync.step(torch.zeros(2, 5), torch.full((2, 5), 0.01))
    assert c0.log == [(4, 4), (8, 8)] and sync.report() is None


def test_outer_delay_refusals_are_one_line():
    for bad in (2, -1, True, 0.5, "1"):
        with pytest.raises(ValueError, match=r"Arg `outer_delay` must be 0 \(synchronous outer step\) or 1 .*got"):
            algorithms.DiLoCoConfig(outer_delay=bad)
    with pytest.raises(ValueError, match=r"`outer_delay`.*`fragment_sync_delay` \(1.*give one of them"):
        algorithms.DiLoCoConfig(outer_delay=1, fragments=2, local_steps=8, fragment_sync_delay=1)
    assert algorithms.make_config("muloco", outer_delay=1).outer_delay == 1
    with pytest.raises(ValueError, match=r"Arg `outer_delay` must be 0 for sparseloco, got 1: its paper has no "
                                         r"delayed outer step"):
        algorithms.make_config("sparseloco", outer_delay=1)


def test_diloco_outer_delay_state_round_trip_carries_the_exchange_in_flight():
    """A state_dict taken with round 2's exchange in flight (step 10, H = 4) restores into
    a fresh optimizer that ends where the uninterrupted run ends, bit for bit."""
    opts = dict(local_steps=4, compressor="quant:bits=4", error_feedback=True, outer_delay=1)
    full, _, _ = run("diloco", 14, adamw=True, lr=0.01, **opts)
    _, _, opt = run("diloco", 10, adamw=True, lr=0.01, **opts)
    sd = opt.state_dict()
    assert {"in_flight", "pending", "last_delta"} <= set(sd["algorithm"]) and sd["algorithm"]["in_flight"] == (0,)
    _, _, fresh = run("diloco", 0, adamw=True, lr=0.01, **opts)
    fresh.load_state_dict(sd)
    gen = torch.Generator().manual_seed(1)
    for _ in range(10 * 4):
        torch.randn(16, FEATURES, generator=gen), torch.randint(0, CLASSES, (16,), generator=gen)
    train_steps(fresh, gen, 4)
    assert torch.equal(fresh.flat.data, full)


def test_bad_options_are_one_line():
    with pytest.raises(ValueError, match=r"Arg `fragments` must be <= local_steps \(4\).*got 5"):
        algorithms.DiLoCoConfig(local_steps=4, fragments=5)
    with pytest.raises(ValueError, match=r"Arg `outer_momentum` must satisfy 0 <= outer_momentum < 1, got 1.0"):
        algorithms.DiLoCoConfig(outer_momentum=1.0)
    with pytest.raises(ValueError, match=r"Arg `slow_lr` must be a finite number > 0, got 0.0"):
        algorithms.SlowMoConfig(slow_lr=0.0)
    with pytest.raises(ValueError, match=r"Arg `outer_lr` must be a finite number > 0, got -1"):
        algorithms.DiLoCoConfig(outer_lr=-1)
    with pytest.raises(ValueError, match=r"Arg `local_steps` must be >= 1, got 0"):
        algorithms.LocalSGDConfig(local_steps=0)
    with pytest.raises(TypeError, match=r"Arg `error_feedback` must be a bool, got 'yes'"):
        algorithms.DiLoCoConfig(error_feedback="yes")
    with pytest.raises(ValueError, match=r"unknown compressor 'zip'; available: .*quant"):
        algorithms.DiLoCoConfig(compressor="zip")
    c = comm.SimulatedCommunicator(world_size=2)
    with pytest.raises(ValueError, match=r"diloco: `fragments` 3 exceeds the model's 2 non-empty tensors"):
        algorithms.build("diloco", c, fragments=3, local_steps=4).setup(
            torch.zeros(2, 4), algorithms.ParamLayout.from_shapes([(2,), (2,)]))


def test_state_round_trip_mid_round_is_bit_identical():
    """state_dict in the middle of a round (with the inner AdamW) continues exactly."""
    opts = dict(local_steps=4, compressor="quant:bits=4", error_feedback=True, fragments=2)
    full, _, _ = run("diloco", 10, adamw=True, lr=0.01, **opts)
    _, _, opt = run("diloco", 6, adamw=True, lr=0.01, **opts)
    sd = opt.state_dict()
    assert set(sd["algorithm"]) == {"t", "start", "momentum", "error", "server_error", "exchange", "shards"}
    assert sd["algorithm"]["t"] == 6 and sd["algorithm"]["exchange"] == "sharded"
    assert "exp_avg" in sd["optimizers"][0]["state"][0]
    # a fresh optimizer restored from it, then the last 4 steps with the same batches
    _, _, fresh = run("diloco", 0, adamw=True, lr=0.01, **opts)
    fresh.load_state_dict(sd)
    gen = torch.Generator().manual_seed(1)
    for _ in range(6 * 4):  # the batches the first 6 steps drew
        torch.randn(16, FEATURES, generator=gen), torch.randint(0, CLASSES, (16,), generator=gen)
    train_steps(fresh, gen, 4)
    assert torch.equal(fresh.flat.data, full)


# ---------------------------------------------------------------------------- the local optimizer
def test_optimizer_defaults_and_refusals():
    cfg = TrainConfig.from_flat(algo="diloco", simulate=2)
    assert cfg.local_optimizer == "adamw" and cfg.learning_rate == 0.001 and cfg.betas == (0.9, 0.999)
    cfg = TrainConfig.from_flat(algo="diloco", optimizer="sgd", simulate=2)
    assert cfg.local_optimizer == "sgd" and cfg.learning_rate == 0.05 and cfg.betas is None
    cfg = TrainConfig.from_flat(algo="allreduce", optimizer="adamw", beta1=0.8, lr=0.003)
    assert cfg.betas == (0.8, 0.999) and cfg.local_momentum == 0.0 and cfg.to_dict()["lr"] == 0.003
    d = TrainConfig.from_flat(algo="ecd", simulate=2).to_dict()
    assert d["lr"] == 0.05 and d["local_optimizer"] == "sgd" and d["betas"] is None
    with pytest.raises(ConfigError, match=r"--optimizer must be one of sgd, adamw, muon, got 'adam'"):
        TrainConfig.from_flat(optimizer="adam")
    with pytest.raises(ConfigError, match=r"--beta1 must be in \[0, 1\), got 1.0"):
        TrainConfig.from_flat(optimizer="adamw", beta1=1.0)


def test_optimizer_from_a_toml_file(tmp_path):
    from gossip.train.config import parse_args

    f = tmp_path / "run.toml"
    f.write_text('algo = "localsgd"\n[optim]\noptimizer = "adamw"\nbeta1 = 0.8\nweight-decay = 0.1\n'
                 '[algorithm.options]\nlocal_steps = 5\n')
    cfg = parse_args(["--config", str(f)])
    assert cfg.local_optimizer == "adamw" and cfg.betas == (0.8, 0.999) and cfg.optim.weight_decay == 0.1
    assert dict(cfg.algorithm.options) == {"local_steps": 5}
    with pytest.raises(ConfigError, match=r"--beta1/--beta2 are AdamW's"):
        parse_args(["--config", str(f), "--optimizer", "sgd"])  # the file's beta1 with the flag's SGD


@pytest.mark.parametrize("args,needles", [
    # an algorithm that owns momentum, with AdamW's beta1 > 0: they would compound
    (["--algo", "powersgd", "--optimizer", "adamw"], ["powersgd applies its own momentum", "beta1", "--beta1 0"]),
    (["--algo", "efmomentum", "--optimizer", "adamw"], ["efmomentum applies its own momentum", "--beta1 0"]),
    # SGD's momentum flag with AdamW, AdamW's betas with SGD
    (["--algo", "diloco", "--momentum", "0.9"], ["--momentum is the SGD optimizer's", "--beta1"]),
    (["--algo", "localsgd", "--beta2", "0.99"], ["--beta1/--beta2 are AdamW's", "--optimizer adamw"]),
    (["--algo", "dpsgd", "--optimizer", "muon", "--momentum", "0.5"], ["--momentum: --optimizer muon keeps",
                                                                       "--optimizer sgd"]),
    (["--algo", "dpsgd", "--optimizer", "adam"], ["--optimizer", "invalid choice"]),
    (["--algo", "diloco", "--algo-opt", "fragments=9", "--algo-opt", "local_steps=4"], ["fragments", "<= local_steps"]),
])
def test_refused_combinations_are_one_line(args, needles):
    _one_error_line(train("--simulate", "2", "--data", "synthetic", "--no-progress", *args), *needles)


def test_resume_refuses_another_local_optimizer(tmp_path):
    common = ["--simulate", "2", "--algo", "localsgd", "--max-steps", "4", *QUICK]
    assert train(*common, "--out", str(tmp_path / "r")).returncode == 0
    r = train(*common, "--optimizer", "adamw", "--max-steps", "6", "--resume", str(tmp_path / "r"))
    _one_error_line(r, "different config", "local_optimizer 'sgd' != 'adamw'")


def test_owner_with_adamw_beta1_0_trains(tmp_path):
    r = train("--simulate", "2", "--algo", "powersgd", "--optimizer", "adamw", "--beta1", "0", "--lr", "0.003",
              "--max-steps", "3", "--out", str(tmp_path / "r"), *QUICK)
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------------------- the CLI
RESUME_ARGS = {
    "slowmo": ["--algo", "slowmo", "--algo-opt", "local_steps=4", "--lr", "0.1"],
    "diloco": ["--algo", "diloco", "--compressor", "quant:bits=4", "--algo-opt", "error_feedback=true",
               "--algo-opt", "fragments=2", "--algo-opt", "local_steps=6", "--lr", "0.01"],
    # the overlapped outer step: every checkpoint falls with an exchange in flight
    "diloco-eager": ["--algo", "diloco", "--algo-opt", "outer_delay=1", "--algo-opt", "local_steps=4",
                     "--lr", "0.01"],
}


@pytest.mark.parametrize("name", list(RESUME_ARGS))
def test_resume_mid_round_is_bit_identical(tmp_path, name):
    """Checkpoints at steps 5, 10, 15 fall inside rounds of 4 and 6 steps; the resumed run
    ends where the uninterrupted one does, bit for bit (diloco's inner AdamW included)."""
    common = ["--simulate", "3", *RESUME_ARGS[name], *QUICK]
    full, part = tmp_path / "full", tmp_path / "part"
    assert train(*common, "--out", str(full)).returncode == 0
    r = train(*common, "--out", str(part), "--max-steps", "17", "--checkpoint-every", "5")
    assert r.returncode == 0, r.stderr
    ck = checkpoint.load_checkpoint(part / "ckpt-step15-rank0.pt")["optimizer"]
    assert ck["algorithm"]["t"] == 15 and ck["algorithm"]["start"].shape == ck["params"].shape
    r = train(*common, "--resume", str(part))
    assert r.returncode == 0, r.stderr
    assert torch.equal(final_params(full), final_params(part))
    cfg = json.loads((full / "config.json").read_text())
    assert cfg["local_optimizer"] == ("adamw" if name.startswith("diloco") else "sgd")


def test_diloco_outer_delay_run_ends_on_every_round_mean(tmp_path):
    """The trainer applies the last round's exchange at the schedule's end only: the
    finished run's checkpoint has nothing in flight and, without outer momentum, every
    node's theta alike; a run stopped by ``--max-steps`` keeps its exchange in flight
    (for a bit-identical resume)."""
    common = ["--simulate", "3", "--algo", "diloco", "--algo-opt", "outer_delay=1", "--algo-opt", "local_steps=4",
              "--algo-opt", "outer_momentum=0", "--lr", "0.01", *QUICK]
    full, part = tmp_path / "full", tmp_path / "part"
    r = train(*common, "--out", str(full))
    assert r.returncode == 0, r.stderr
    r = train(*common, "--out", str(part), "--max-steps", "9")
    assert r.returncode == 0, r.stderr
    steps = json.loads((full / "summary.json").read_text())["steps"]
    assert steps > 9
    end = checkpoint.load_checkpoint(full / f"ckpt-step{steps}-rank0.pt")["optimizer"]["algorithm"]
    assert tuple(end["in_flight"]) == () and not end["last_delta"].any()
    torch.testing.assert_close(end["start"], end["start"][:1].expand_as(end["start"]), rtol=0, atol=1e-6)
    stop = checkpoint.load_checkpoint(part / "ckpt-step9-rank0.pt")["optimizer"]["algorithm"]
    assert tuple(stop["in_flight"]) == (0,) and stop["last_delta"].any()


def test_simulation_with_8_nodes(tmp_path):
    d = None
    for name, extra in (("localsgd", []), ("slowmo", []), ("diloco", ["--bits", "4"]),
                        ("dpsgd", ["--algo-opt", "local_steps=4"])):
        out = tmp_path / name
        r = train("--simulate", "8", "--algo", name, "--algo-opt", "local_steps=4", *extra,
                  "--out", str(out), "--max-steps", "8", *QUICK)
        assert r.returncode == 0, r.stderr
        s = json.loads((out / "summary.json").read_text())
        d = s["params"]
        assert s["world_size"] == 8 and s["steps"] == 8
        per_round = s["bytes_sent_per_node_per_step"] * 4
        if name in ("localsgd", "slowmo"):
            assert per_round == _ring(4 * d, 8)
            assert s["consensus_distance"] == pytest.approx(0.0, abs=1e-12)  # step 8 ends a round
        elif name == "diloco":
            # sharded: 2 (n - 1) / n of the shard messages, plus the one 16-byte check of
            # the shard sizes (to 7 peers, over the run's 2 rounds)
            plan = ShardPlan(compress.build("quant:bits=4"), d, 8, algo="diloco")
            assert per_round == 2 * 7 * plan.total_nbytes / 8 + 7 * 16 / 2
        else:  # ring: one fp32 payload to each of two neighbours at steps 4 and 8, one size check each
            assert s["bytes_sent_per_node_total"] == 2 * 2 * compress.build("identity").payload_nbytes(d) + 2 * 16


WORLD_CASES = [
    ("localsgd", {"local_steps": 3}),
    ("slowmo", {"local_steps": 3}),
    ("diloco", {"local_steps": 4, "compressor": "quant:bits=4", "error_feedback": True, "fragments": 2}),
    ("dpsgd", {"local_steps": 2}),
    ("choco", {"local_steps": 2, "compressor": "topk:p=0.2"}),
]
STEPS, D = 9, 41


def _problem(n: int):
    g = torch.Generator().manual_seed(11)
    return torch.randn(n, D, generator=g), torch.randn(D, generator=g)


def _trajectory(c, X, A):
    """Every case on communicator ``c``: x <- step with u = -0.1 (x - a_node) after set_lr(0.1)."""
    out = {}
    layout = algorithms.ParamLayout.from_shapes([(20,), (21,)])
    for name, opts in WORLD_CASES:
        alg = algorithms.build(name, c, **opts)
        Y = X.clone()
        alg.setup(Y, layout)
        rows = []
        for _ in range(STEPS):
            alg.set_lr(0.1)
            alg.step(Y, -0.1 * (Y - A))
            rows.append(Y.clone())
        out[name] = torch.stack(rows, dim=1)
    return out, c.ledger.bytes_sent


def _rank():
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    A, x1 = _problem(n)
    c = comm.DistCommunicator(topologies.build("complete", n), timeout=30)
    traj, sent = _trajectory(c, x1.unsqueeze(0), A[rank : rank + 1])
    return {k: v[0] for k, v in traj.items()}, sent


@pytest.mark.multiprocess
def test_two_real_processes_equal_the_simulation_for_every_algorithm():
    """Each algorithm on 2 real processes (gloo) is its 2-node simulation bit for bit (a sum
    of two values is the same in either order, so the all-reduce is exact here), bytes too."""
    from tests._dist import run_world

    results = run_world(2, _rank, timeout=120)
    A, x1 = _problem(2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks
    try:
        sim, _ = _trajectory(comm.SimulatedCommunicator(topologies.build("complete", 2)), x1.repeat(2, 1), A)
    finally:
        torch.set_num_threads(threads)
    for rank, (traj, sent) in enumerate(results):
        for name, _ in WORLD_CASES:
            assert torch.equal(traj[name], sim[name][rank]), (name, rank)
    assert results[0][1] == results[1][1] > 0


#: the CLI flags of each torchrun test below (10 steps: rounds of 4 end at steps 4 and 8
#: and the run stops mid-round)
TORCHRUN_CASES = {
    # streaming DiLoCo with 4-bit pseudo-gradients and error feedback, inner AdamW
    "diloco": ["--algo", "diloco", "--bits", "4", "--algo-opt", "error_feedback=true", "--algo-opt", "fragments=2",
               "--algo-opt", "local_steps=4"],
    "localsgd": ["--algo", "localsgd", "--algo-opt", "local_steps=4"],
    "slowmo": ["--algo", "slowmo", "--algo-opt", "local_steps=4", "--algo-opt", "slow_momentum=0.5"],
    # the gossip variant (dpsgd's is in test_two_real_processes_equal_the_simulation_for_every_algorithm)
    "choco-local": ["--algo", "choco", "--topology", "complete", "--compressor", "topk:p=0.1",
                    "--algo-opt", "local_steps=4"],
    # overlapped SGP on its default graph (one-peer exponential): messages in flight at the end
    "sgp-overlap": ["--algo", "sgp", "--algo-opt", "overlap=1"],
    # DiLoCo's overlapped outer step, 4-bit sharded exchange: each round's exchange is waited
    # one round later (rounds of 3 end at steps 3, 6, 9: the last one in flight at the end)
    "diloco-eager": ["--algo", "diloco", "--bits", "4", "--algo-opt", "error_feedback=true",
                     "--algo-opt", "local_steps=3", "--algo-opt", "outer_delay=1"],
}


def _torchrun_args(case: str) -> list[str]:
    return [*TORCHRUN_CASES[case], "--max-steps", "10", *QUICK]


@pytest.fixture(scope="module")
def torchrun_cases(tmp_path_factory):
    """Every case of :data:`TORCHRUN_CASES` under ONE torchrun launch of 2 ranks (one
    thread each): each rank runs the CLI's main() once per case, as ``python -m
    gossip.train`` does, so torchrun and torch start once for all of them."""
    root = tmp_path_factory.mktemp("torchrun-cases")
    jobs = [(case, [*_torchrun_args(case), "--out", str(root / case / "dist")]) for case in TORCHRUN_CASES]
    r, codes = torchrun_jobs(2, jobs, timeout=420, cwd=root)
    return root, r, codes


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(TORCHRUN_CASES))
def test_torchrun_equals_the_simulation(torchrun_cases, case):
    """The CLI under torchrun, 2 ranks, ends where the 2-node simulation ends, bit for
    bit, with the same bytes."""
    root, r, codes = torchrun_cases
    assert codes[case] == [0, 0], why(r)
    args = _torchrun_args(case)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the twin in this process, with the ranks' thread count
    try:
        r = train("--simulate", "2", "--simulate-mode", "loop", *args, "--out", str(root / case / "sim"))
    finally:
        torch.set_num_threads(threads)
    assert r.returncode == 0, r.stderr
    assert torch.equal(final_params(root / case / "dist"), final_params(root / case / "sim"))
    a = json.loads((root / case / "dist" / "summary.json").read_text())
    b = json.loads((root / case / "sim" / "summary.json").read_text())
    assert a["bytes_sent_per_node_total"] == b["bytes_sent_per_node_total"] > 0


# ---------------------------------------------------------------------------- the eager study, tiny
def test_diloco_eager_experiment_smoke(tmp_path, capsys):
    """experiments/diloco_eager.py end to end on 2 nodes and a few steps (two rounds of 2,
    so the eager run waits one exchange and leaves one in flight): rows, verdict, table."""
    from experiments import _provenance, diloco_eager, render

    res = tmp_path / "res.json"
    assert diloco_eager.main(["--nodes", "2", "--epochs", "1", "--max-steps", "4", "--data", "synthetic",
                              "--local-steps", "2", "--seeds", "0", "--methods", "diloco,diloco-eager", "--out", str(tmp_path), "--results", str(res)]) == 0
    results, prov = _provenance.read(res)
    assert "python -m experiments.diloco_eager --nodes 2" in prov["command"]
    assert prov["sources"] == diloco_eager.SOURCES and len(prov["configs"]) == 2
    assert [(r["method"], r["seed"], r["steps"]) for r in results["rows"]] == [("diloco", 0, 4),
                                                                               ("diloco-eager", 0, 4)]
    (v,) = results["verdicts"]
    assert v["eager"] == "diloco-eager" and v["target"] in ("met", "not met")
    table = (tmp_path / "results.md").read_text()
    assert table == render.TABLES["diloco_eager"].render(results) + "\n"
    assert "| diloco-eager vs diloco |" in table
    with pytest.raises(SystemExit) as e:
        diloco_eager.main(["--seeds", "x", "--out", str(tmp_path / "no")])
    assert e.value.code == 2 and "--seeds: expected comma-separated integers >= 0, got 'x'" in capsys.readouterr().err
