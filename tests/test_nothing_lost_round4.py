"""Nothing lost, nothing silently wrong, round 4: what a demanding user met.

- A resumed run's byte counts equal an uninterrupted run's: the payload size check is
  charged once per run, not once per process (every family under torchrun:
  tests/test_restarts.py).
- Refusals name their real cause: the option a resume changed and both its values (not
  two fingerprints), the context that does not fit the held-out text (not an option
  never set), one model object passed for every node (not "replaced").
- Every file of a run directory follows the umask, checkpoints and JSON files as the
  metrics files.
- A user's ordinary language model (``nn.Embedding``) trains on text: the up-front
  check and training both give it int64 token ids.
- The library starts every node from node 0's weights where they differ, as DDP does
  (in the simulation and under a real gloo world), and sends nothing where they do not.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import stat
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import topologies
from gossip import algorithms, checkpoint, comm
from gossip import train as gossip_train
from gossip.data import TOKEN_DTYPE, ShardLoader, build_dataset
from gossip.runtime import GossipOptimizer
from tests._dist import run_world


# ----------------------------------------------------------------------- byte counts
def _exchange_twice(c: comm.SimulatedCommunicator) -> None:
    c.neighbor_exchange(torch.zeros(c.world_size, 40, dtype=torch.uint8))
    c.neighbor_exchange(torch.zeros(c.world_size, 40, dtype=torch.uint8))


def test_the_size_check_is_charged_once_per_run_across_a_resume():
    ring = topologies.build("ring", 4)
    whole = comm.SimulatedCommunicator(ring)
    _exchange_twice(whole)
    _exchange_twice(whole)
    first = comm.SimulatedCommunicator(ring)
    _exchange_twice(first)
    resumed = comm.SimulatedCommunicator(ring)  # a new process: it checks the sizes again
    resumed.ledger.load_state_dict(first.ledger.state_dict())
    _exchange_twice(resumed)
    assert resumed.ledger.as_dict()["ops"] == whole.ledger.as_dict()["ops"]
    assert resumed.ledger.bytes_sent == whole.ledger.bytes_sent == 4 * 2 * (4 * 40 + 16)


# ----------------------------------------------------------------------- refusals that name their reason
def _main(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = gossip_train.main(list(args))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return rc, out.getvalue(), err.getvalue()


MULOCO = ["--simulate", "2", "--algo", "muloco", "--data", "synthetic", "--model", "logreg", "--no-progress"]


@pytest.mark.parametrize("before, after, said", [
    ([], ["--muon-precision", "float32"], "muon_precision (absent) != 'float32'"),
    (["--muon-precision", "bfloat16"], [], "muon_precision 'bfloat16' != (absent)"),
    (["--muon-precision", "bfloat16"], ["--muon-precision", "float32"], "muon_precision 'bfloat16' != 'float32'"),
])
def test_a_resume_with_another_option_names_it_and_both_values(tmp_path, before, after, said):
    out = tmp_path / "run"
    rc, _, err = _main(*MULOCO, *before, "--max-steps", "2", "--out", str(out))
    assert rc == 0, err
    rc, _, err = _main(*MULOCO, *after, "--max-steps", "4", "--resume", str(out))
    assert rc == 2
    line = err.strip()
    assert len(line.splitlines()) == 1 and line.endswith(f"was written with a different config: {said}"), line
    assert "fingerprint" not in line


def test_load_checkpoint_names_a_key_only_this_run_fingerprints(tmp_path):
    path = tmp_path / "ckpt-step1-rank0.pt"
    checkpoint.save_checkpoint(path, {"step": 1}, config={"lr": 0.1}, world_size=1)
    mine = {"lr": 0.1, "muon_precision": "float32"}
    with pytest.raises(checkpoint.CheckpointError, match=r"different config: muon_precision \(absent\) != 'float32'$"):
        checkpoint.load_checkpoint(path, expect_fingerprint=checkpoint.config_fingerprint(mine), expect_config=mine)


def test_a_context_too_long_for_the_default_held_out_text_names_the_context(tmp_path):
    rc, _, err = _main("--simulate", "3", "--data", "text", "--data-opt", "context=10000000", "--no-progress",
                       "--out", str(tmp_path / "run"))
    assert rc == 2
    assert err.strip() == (
        "gossip.train: error: --data text: context 10000000 is too long for the held-out text: one window takes "
        "context + 1 = 10000001 bytes and the held-out text is capped at 65536 bytes by default; give a context "
        "of at most 65535, or max_test_bytes >= 10000001")
    text = tmp_path / "a.txt"
    text.write_text("abc " * 50)
    with pytest.raises(ValueError, match=r"^max_test_bytes must be >= 17 \(context \+ 1: one held-out window of "
                                         r"context 16\), got 4$"):  # the user's own max_test_bytes: named
        build_dataset("text", data_dir=text, context=16, max_test_bytes=4)
    assert build_dataset("text", data_dir=text, context=16).corpus["test_bytes"] == 20  # the default: unchanged


def test_one_model_object_for_every_node_is_refused_as_such():
    c = comm.SimulatedCommunicator(topologies.build("ring", 4))
    model = nn.Linear(3, 2)
    opts = [torch.optim.SGD(model.parameters(), lr=0.1) for _ in range(4)]
    with pytest.raises(ValueError, match=r"^models 0 and 1 are one object \(the same nn.Module passed for two nodes\): "
                                         r"each node needs a model of its own; copy.deepcopy the model"):
        GossipOptimizer([model] * 4, opts, algorithms.build("allreduce", c))
    shared = [nn.Sequential(model) for _ in range(4)]  # four wrappers around one layer
    with pytest.raises(ValueError, match=r"^model 1's parameter '0.weight' is one tensor with model 0's '0.weight'"):
        GossipOptimizer(shared, [torch.optim.SGD(m.parameters(), lr=0.1) for m in shared],
                        algorithms.build("allreduce", c))
    models = [nn.Linear(3, 2) for _ in range(4)]
    with pytest.raises(ValueError, match=r"^optimizers 0 and 1 are one object"):
        GossipOptimizer(models, [torch.optim.SGD(models[0].parameters(), lr=0.1)] * 4, algorithms.build("allreduce", c))


# ----------------------------------------------------------------------- file modes
@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_every_run_file_follows_the_umask(tmp_path, umask):
    out = tmp_path / "run"
    before = os.umask(umask)
    try:
        rc, _, err = _main("--simulate", "3", "--data", "synthetic", "--model", "logreg", "--algo", "ecd",
                           "--no-progress", "--max-steps", "2", "--checkpoint-every", "1", "--out", str(out))
    finally:
        os.umask(before)
    assert rc == 0, err
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert {"config.json", "summary.json", "metrics-rank0.jsonl", "ckpt-step1-rank0.pt", "ckpt-step2-rank0.pt"} <= set(modes)
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)


# ----------------------------------------------------------------------- the user's language model
USER_LM = '''
import torch.nn.functional as F
from torch import nn


class TinyLM(nn.Module):
    """An ordinary next-byte model: an embedding, a one-hot skip, a linear head."""

    def __init__(self, vocab):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, 16), nn.Linear(16 + vocab, vocab)

    def forward(self, idx):
        return self.head(torch.cat([self.embed(idx), F.one_hot(idx, self.head.out_features).float()], -1))


import torch


def lm(input_shape, num_classes):
    return TinyLM(num_classes)
'''


def test_an_ordinary_embedding_model_of_the_user_trains_on_text(tmp_path, monkeypatch):
    """The up-front check and training give the model token ids of one dtype (int64, which
    nn.Embedding and F.one_hot take; the corpus stays bytes). The CLI's main() in this
    process, run from the user's directory with it on the path, as ``python -m`` puts it;
    D-PSGD, whose fp32 exchange compiles no compression kernel (the token ids do not
    depend on the algorithm)."""
    (tmp_path / "my_lm.py").write_text(USER_LM)
    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_lm", raising=False)  # this file's, not an earlier one
    try:
        rc, _, err = _main("--simulate", "3", "--algo", "dpsgd", "--data", "text", "--data-dir", "corpus.txt", "--data-opt", "context=16",
                           "--model", "my_lm:lm", "--batch-size", "4", "--max-steps", "3", "--no-progress",
                           "--out", "run")
    finally:
        sys.modules.pop("my_lm", None)
    assert rc == 0, err[-3000:]
    assert "Traceback" not in err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["model"] == "my_lm:lm" and math.isfinite(summary["final_test_bpb"])


def test_token_ids_reach_the_model_as_int64_and_the_data_set_keeps_its_bytes(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("abcdefgh" * 40)
    ds = build_dataset("text", data_dir=text, context=8)
    assert ds.x_train.dtype == torch.uint8  # the corpus as bytes, as before
    x, y = ShardLoader(ds.x_train, ds.y_train, torch.arange(ds.num_train), 2, seed=0, node=0).next_batch()
    assert x.dtype == TOKEN_DTYPE == torch.int64 and 0 <= int(x.min()) and int(x.max()) < 256
    assert y.dtype == torch.uint8
    floats = torch.randn(6, 3)  # a classification batch is served as it is
    assert ShardLoader(floats, torch.zeros(6, dtype=torch.int64), torch.arange(6), 2, seed=0, node=0).next_batch()[0].dtype \
        == torch.float32


# ----------------------------------------------------------------------- nodes start equal
class _Net(nn.Module):
    """A trainable layer, a frozen one and a BatchNorm (buffers): every kind of state."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.norm, self.frozen, self.out = nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.out(self.frozen(self.norm(self.inp(x))))


def _net(seed: int) -> _Net:
    torch.manual_seed(seed)
    net = _Net()
    net.norm.running_mean.fill_(seed)  # buffers apart too
    return net


def _steps(models, opt, nodes, steps: int = 3) -> None:
    for _ in range(steps):
        opt.zero_grad()
        for node, model in zip(nodes, models):
            x = torch.randn(8, 3, generator=torch.Generator().manual_seed(100 * node + opt.steps))
            F.cross_entropy(model(x), (x[:, 0] > 0).long()).backward()  # each node's data differs
        opt.step()


def _state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_library_starts_every_simulated_node_from_node_0s_weights():
    c = comm.SimulatedCommunicator(topologies.build("ring", 4))
    models = [_net(seed) for seed in range(4)]  # built apart, as a user might
    first = _state(models[0])
    opt = GossipOptimizer(models, [torch.optim.SGD(m.parameters(), lr=0.1) for m in models],
                          algorithms.build("allreduce", c))
    assert opt.init_broadcast
    assert all(_equal_states(_state(m), first) for m in models)  # trainable, frozen and buffers
    assert c.ledger.setup_bytes_sent == c.ledger.as_dict()["ops"]["broadcast"]["sent"] > 0  # one-off, not step traffic
    _steps(models, opt, range(4))
    assert opt.consensus_distance() == 0.0  # all-reduce keeps them equal: it never agreed before

    alike = [_net(0) for _ in range(4)]
    c = comm.SimulatedCommunicator(topologies.build("ring", 4))
    opt = GossipOptimizer(alike, [torch.optim.SGD(m.parameters(), lr=0.1) for m in alike],
                          algorithms.build("allreduce", c))
    assert not opt.init_broadcast and c.ledger.bytes_sent == 0  # nothing sent where they start equal

    apart = [_net(seed) for seed in range(4)]
    mine = [_state(m) for m in apart]
    GossipOptimizer(apart, [torch.optim.SGD(m.parameters(), lr=0.1) for m in apart],
                    algorithms.build("dpsgd", comm.SimulatedCommunicator(topologies.build("ring", 4))), init_sync=False)
    assert all(_equal_states(_state(m), s) for m, s in zip(apart, mine))  # kept apart, as asked


def _start_ranks() -> list[tuple]:
    return [_start(seed_of_rank) for seed_of_rank in (True, False)]  # one world for both cases


def _start(seed_of_rank: bool) -> tuple:
    import torch.distributed as dist

    rank = dist.get_rank()
    c = comm.DistCommunicator(None)
    model = _net(rank if seed_of_rank else 0)
    first = _state(model)
    opt = GossipOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), algorithms.build("allreduce", c))
    synced = _state(model)
    _steps([model], opt, [rank])
    weights = {k: p.detach().clone() for k, p in model.named_parameters()}  # BatchNorm's statistics stay each rank's
    return first, synced, weights, opt.init_broadcast, c.ledger.setup_bytes_sent, c.ledger.calls["broadcast"]


@pytest.mark.multiprocess
def test_the_library_starts_every_rank_from_rank_0s_weights():
    (apart0, alike0), (apart1, alike1) = run_world(2, _start_ranks)
    (first0, synced0, end0, b0, setup0, calls0), (first1, synced1, end1, b1, setup1, _) = apart0, apart1
    assert not _equal_states(first0, first1)
    assert b0 and b1 and _equal_states(synced0, first0) and _equal_states(synced1, first0)  # rank 0's, as DDP
    assert setup0 > 0 and setup1 == 0 and calls0 == 2  # rank 0 sent them (flat weights, the rest): setup traffic
    assert _equal_states(end0, end1)  # and all-reduce keeps the ranks equal
    (_, _, e0, b0, setup0, calls0), (_, _, e1, b1, setup1, calls1) = alike0, alike1
    assert not b0 and not b1 and _equal_states(e0, e1)
    assert setup0 == setup1 == calls0 == calls1 == 0  # started equal: nothing but the digests, unrecorded
