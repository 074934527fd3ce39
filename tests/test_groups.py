"""Runs in groups (``--group-size``): the plan, the slices, sharded against unsharded,
the simulation against torchrun, the bytes by level, bad input."""

from __future__ import annotations

import json

import pytest
import torch

import topologies
from gossip import algorithms
from gossip.algorithms.base import ParamLayout
from gossip.comm import SimulatedCommunicator
from gossip.comm.base import ring_allreduce_bytes
from gossip.groups import GroupPlan, Grouped, slice_bounds, slice_layout
from gossip.train import assembly
from gossip.train.assembly import Env
from gossip.train.config import ConfigError, parse_args
from gossip.errors import RunError
from tests.test_train import torchrun

QUICK = ["--data", "synthetic", "--model", "logreg", "--epochs", "1", "--max-steps", "12", "--no-progress",
         "--device", "cpu"]


def test_plan_and_slices():
    p = GroupPlan(8, 4)
    assert p.groups == 2 and p.group_ranks(1) == [4, 5, 6, 7] and p.slice_ranks(1) == [1, 5]
    assert p.group_of(5) == 1 and p.member_of(5) == 1
    with pytest.raises(ValueError, match="does not divide the world size 8"):
        GroupPlan(8, 3)
    with pytest.raises(ValueError, match="larger than the world size 4"):
        GroupPlan(4, 8)
    assert slice_bounds(11, 2) == ((0, 6), (6, 5))
    lay = ParamLayout(((3, 3), (2,)), ("w", "b"))
    assert slice_layout(lay, 0, 6).shapes == ((6,),) and slice_layout(lay, 6, 5).names == ("w[6:9]", "b")
    assert slice_layout(lay, 6, 5).shapes == ((3,), (2,))


def _grouped(name, sharded, n=3, G=2, d=11, steps=5, **opts):
    topo = topologies.build("ring", n)
    host = SimulatedCommunicator(topo, world_size=n)
    inter = {j: SimulatedCommunicator(topo, world_size=n, ledger=host.ledger) for j in range(G if sharded else 1)}
    a = Grouped(lambda c: algorithms.build(name, c, **opts), host, inter=inter,
                intra=SimulatedCommunicator(world_size=G), group_size=G, sharded=sharded)
    g = torch.Generator().manual_seed(0)
    X = torch.randn(1, d, generator=g).repeat(n, 1)
    a.setup(X, ParamLayout(((3, 3), (2,))))
    for t in range(steps):
        U = 0.1 * torch.randn(n, d, generator=g)
        if a.acts_on == "gradient":
            a.reduce_gradients(U)
            X.add_(U)
        else:
            a.step(X, U)
        a.on_step_end(t + 1)
    return X


@pytest.mark.parametrize("name,opts", [("dpsgd", {}), ("diloco", {"local_steps": 2}), ("allreduce", {}),
                                       ("localsgd", {"local_steps": 2}), ("sgp", {})])
def test_sharded_equals_unsharded(name, opts):
    """An algorithm that treats coordinates one by one gives, sliced across the members,
    exactly what one member exchanging everything gives."""
    assert torch.equal(_grouped(name, True, **opts), _grouped(name, False, **opts))


def test_unsliceable_algorithm_refused_when_sharding_is_asked():
    with pytest.raises(ValueError, match="cannot be sliced"):
        _grouped("powersgd", True)


def _env(n, distributed, monkeypatch, local=None):
    if local is not None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    return Env(world_size=n, distributed=distributed, rank=0)


def test_default_group_size(monkeypatch):
    """Unset: 1 in the simulation and on one host (the flat demo stays flat); across
    hosts, the processes of one host."""
    cfg = parse_args(["--algo", "ecd", *QUICK])
    assert assembly.group_size(cfg, _env(4, True, monkeypatch, local=4)) == 1
    assert assembly.group_size(cfg, _env(8, True, monkeypatch, local=4)) == 4
    assert assembly.group_size(parse_args(["--simulate", "4", *QUICK]), _env(4, False, monkeypatch)) == 1
    with pytest.raises(RunError, match="splits a group across hosts of 4 processes"):
        assembly.group_size(parse_args(["--group-size", "8", "--algo", "ecd", *QUICK])
                            .replace(group_size=3), _env(12, True, monkeypatch, local=4))
    with pytest.raises(RunError, match="--group-size 3: group size 3 does not divide the world size 8"):
        assembly.group_size(parse_args(["--group-size", "3", *QUICK]), _env(8, True, monkeypatch, local=8))


@pytest.mark.parametrize("args,match", [
    (["--simulate", "4", "--group-size", "3"], "--group-size 3 does not divide the world size 4"),
    (["--simulate", "4", "--group-size", "8"], "--group-size 8 is larger than the world size 4"),
    (["--simulate", "4", "--group-size", "0"], "--group-size must be a positive integer"),
])
def test_bad_group_size(args, match):
    with pytest.raises(ConfigError, match=match):
        parse_args([*args, *QUICK])


def _sim(tmp_path, name, *args, quick=QUICK):
    from gossip.train import main

    out = tmp_path / name
    assert main([*args, *quick, "--out", str(out)]) == 0
    return json.loads((out / "summary.json").read_text())


def test_group_size_one_is_the_flat_run(tmp_path):
    a = _sim(tmp_path, "flat", "--simulate", "4", "--algo", "ecd", "--bits", "8")
    b = _sim(tmp_path, "g1", "--simulate", "4", "--algo", "ecd", "--bits", "8", "--group-size", "1")
    assert a["final_train_loss"] == b["final_train_loss"] and a["final_test_loss"] == b["final_test_loss"]
    assert "bytes_by_level" not in b


#: algorithm, its flags, whether it is sliced across the members
CASES = [("diloco", ["--algo-opt", "local_steps=4"], True), ("ecd", ["--bits", "8"], True),
         ("sparseloco", ["--algo-opt", "local_steps=4"], False), ("efsgd", [], True)]


@pytest.mark.parametrize("algo,flags,sharded", CASES)
def test_bytes_by_level(tmp_path, algo, flags, sharded):
    """Between groups a rank sends 1/G of what a node of the flat run of N/G nodes sends
    (the group's slices, one per member; unsharded, member 0 sends it all); inside the
    group, a full-precision all-reduce of the gradient every step, plus the all-gather
    of the slices (unsharded: the broadcast of member 0's result) on the steps that
    exchange between the groups: every step for ecd and efsgd, every 4th (3 of the
    12) for diloco and sparseloco, whose local steps every member takes whole."""
    G, N = 2, 6  # 3 groups: a ring for ecd
    wide = ["--data-opt", "num_features=1024"]  # payloads well above their headers
    grouped = _sim(tmp_path, "g", "--simulate", str(N), "--group-size", str(G), "--algo", algo, *flags, *wide)
    flat = _sim(tmp_path, "f", "--simulate", str(N // G), "--algo", algo, *flags, *wide)
    d, lv = grouped["params"], grouped["bytes_by_level"]
    assert grouped["sharded"] is sharded and grouped["group_size"] == G
    share = 4 * max(n for _, n in slice_bounds(d, G)) * (G - 1) if sharded else 4 * d * (G - 1) / G
    exchanges = 3 / 12 if "local_steps=4" in flags else 1.0
    assert lv["intra"] == pytest.approx(ring_allreduce_bytes(4 * d, G) + exchanges * share)
    # the slices' own headers and the per-slice size checks are the only extra bytes
    assert lv["inter"] * G == pytest.approx(flat["bytes_sent_per_node_per_step"], rel=0.15)
    assert grouped["bytes_sent_per_node_per_step"] == pytest.approx(lv["intra"] + lv["inter"])


#: the four algorithms of the ranks-against-simulation check (4 ranks as 2 groups of 2, 8 steps)
WORLD_CASES = {"diloco": ["--algo-opt", "local_steps=4"], "ecd": ["--bits", "8", "--topology", "complete"],
               "sparseloco": ["--algo-opt", "local_steps=4"], "efsgd": []}
WORLD_QUICK = ["--data", "synthetic", "--model", "logreg", "--epochs", "1", "--max-steps", "8", "--no-progress",
               "--device", "cpu"]


def _ranks_run_all(root: str) -> list[int]:
    """One rank of a 4-process world: ``gossip.train`` in groups of 2 for each algorithm
    of WORLD_CASES in turn, each in a process group of its own (a run ends by tearing
    its group down; the next one starts from a fresh FileStore)."""
    import os

    import torch.distributed as dist

    from gossip.train import main

    codes = []
    for k, (algo, flags) in enumerate(WORLD_CASES.items()):
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.FileStore(os.path.join(root, f"store-{k}"), 4),
                                    rank=int(os.environ["RANK"]), world_size=4)
        codes.append(main(["--group-size", "2", "--algo", algo, *flags, *WORLD_QUICK,
                           "--out", os.path.join(root, algo)]))
    return codes


def _ranks_init_groups() -> dict:
    """One rank of a 4-process world: what init_groups(2) made, and its refusals."""
    import torch.distributed as dist

    from gossip.groups import init_groups

    g = init_groups(2)
    out = {"group": g.group, "member": g.member, "group_ranks": dist.get_process_group_ranks(g.group_pg),
           "inter_ranks": dist.get_process_group_ranks(g.inter_pg)}
    # the members of a group hold one model; a sliced all-reduce between the groups
    algo = g.algorithm("allreduce", timeout=30)
    X = torch.full((1, 5), float(g.group))  # group k's model: all k
    algo.setup(X.clone())
    algo.reduce_gradients(X)
    out["reduced"] = X.tolist()
    out["sharded"], out["slices"] = algo.sharded, sorted(algo.inners)
    try:
        init_groups(3)
    except ValueError as e:
        out["refused"] = str(e)
    return out


def test_init_groups_under_a_real_world():
    """init_groups(2) on 4 ranks: groups {0,1} and {2,3}; member j of every group forms
    the inter-group communicator of slice j; the algorithm it builds runs sliced (each
    member its own slice) and leaves every rank the mean over the groups."""
    from tests._dist import run_world

    got = run_world(4, _ranks_init_groups, timeout=120)
    for r, g in enumerate(got):
        assert (g["group"], g["member"]) == (r // 2, r % 2)
        assert g["group_ranks"] == [2 * (r // 2), 2 * (r // 2) + 1] and g["inter_ranks"] == [r % 2, r % 2 + 2]
        assert g["sharded"] is True and g["slices"] == [r % 2]
        assert g["reduced"] == [[0.5] * 5]  # the mean of group 0's 0 and group 1's 1, every slice gathered
        assert g["refused"] == "group size 3 does not divide the world size 4 (accepted: a divisor of 4: 1, 2, 4)"
    with pytest.raises(RuntimeError, match="init_groups: no process group"):
        __import__("gossip.groups", fromlist=["init_groups"]).init_groups(2)


def _flat_bytes(name: str, opts: dict, d: int, steps: int, n: int = 2) -> float:
    """Bytes one node of a flat ``n``-node run of ``name`` sends per step on a vector
    of ``d`` values: the algorithm alone, on the simulated communicator."""
    decentralized = algorithms.is_decentralized(name)
    comm = SimulatedCommunicator(topologies.build("complete", n) if decentralized else None, world_size=n)
    a = algorithms.build(name, comm, **opts)
    g = torch.Generator().manual_seed(0)
    X = torch.randn(1, d, generator=g).repeat(n, 1)
    a.setup(X)
    for t in range(steps):
        U = 0.01 * torch.randn(n, d, generator=g)
        if a.acts_on == "gradient":
            a.reduce_gradients(U)
        else:
            a.step(X, U)
        a.on_step_end(t + 1)
    return comm.ledger.step_bytes_sent / (steps * n)


def test_ranks_match_simulation(tmp_path):
    """4 real processes as 2 groups of 2 end where ``--simulate 4 --group-size 2`` does
    (1e-3 relative) for diloco, ecd --bits 8, sparseloco and efsgd, with the same bytes
    by level, and each sends between groups what it should per rank per step:

    - diloco (local_steps=4, fp32): member j all-reduces its 165-value slice with the
      other group every 4th step: ``ring_allreduce_bytes(4 x 165, 2) / 4`` = 165;
    - ecd --bits 8: member j sends its slice's 8-bit message to the other group every
      step: one ``quant:bits=8`` payload of 165 values, plus the 16-byte payload size
      check once per run (each member's, in the simulation as on the ranks);
    - efsgd: member j runs dist-EF-SGD's two-way exchange on its slice: what a node of a
      flat 2-node efsgd sends on 165 values;
    - sparseloco (unsliceable): member 0 sends what a node of the flat 2-node run sends,
      member 1 nothing: half of it per rank.
    """
    from gossip import compress
    from tests._dist import run_world

    root = tmp_path / "ranks"
    root.mkdir()
    codes = run_world(4, _ranks_run_all, str(root), timeout=240, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0",
                                                                      "LOCAL_WORLD_SIZE": "4"})
    assert codes == [[0] * len(WORLD_CASES)] * 4
    d, steps = 330, 8  # logreg on the synthetic data: 10 x 32 weights and 10 biases
    for algo, flags in WORLD_CASES.items():
        sim = _sim(tmp_path, "sim-" + algo, "--simulate", "4", "--group-size", "2", "--algo", algo, *flags,
                   quick=WORLD_QUICK)
        ranks = json.loads((root / algo / "summary.json").read_text())
        assert sim["params"] == ranks["params"] == d and sim["steps"] == ranks["steps"] == steps
        for key in ("final_train_loss", "final_test_loss"):
            assert ranks[key] == pytest.approx(sim[key], rel=1e-3), (algo, key)
        for level in ("intra", "inter"):
            assert ranks["bytes_by_level"][level] == pytest.approx(sim["bytes_by_level"][level], rel=1e-9), algo
        inter = ranks["bytes_by_level"]["inter"]
        if algo == "diloco":
            assert inter == ring_allreduce_bytes(4 * 165, 2) / 4 == 165
        elif algo == "ecd":
            assert inter == compress.build("quant:bits=8").payload_nbytes(165) + 16 / steps
        elif algo == "efsgd":
            assert inter == pytest.approx(_flat_bytes("efsgd", {}, 165, steps))
        else:
            flat = _sim(tmp_path, "flat-" + algo, "--simulate", "2", "--algo", algo, *flags, quick=WORLD_QUICK)
            assert ranks["sharded"] is False and inter == flat["bytes_sent_per_node_per_step"] / 2


def test_torchrun_matches_simulation(tmp_path):
    """``torchrun --nproc_per_node 4 --group-size 2`` ends where ``--simulate 4
    --group-size 2`` does (1e-3 relative), with the same bytes by level."""
    args = ["--group-size", "2", "--algo", "diloco", "--algo-opt", "local_steps=4", *QUICK]
    sim = _sim(tmp_path, "sim", "--simulate", "4", *args[:-len(QUICK)])
    out = tmp_path / "tr"
    r = torchrun(4, *args, "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    tr = json.loads((out / "summary.json").read_text())
    assert tr["final_train_loss"] == pytest.approx(sim["final_train_loss"], rel=1e-3)
    assert tr["final_test_loss"] == pytest.approx(sim["final_test_loss"], rel=1e-3)
    assert tr["bytes_by_level"]["inter"] == pytest.approx(sim["bytes_by_level"]["inter"], rel=1e-6)
    assert tr["bytes_by_level"]["intra"] == pytest.approx(sim["bytes_by_level"]["intra"], rel=1e-6)
    assert "(intra " in r.stdout + r.stderr


@pytest.mark.parametrize("algo,flags", [("diloco", ["--algo-opt", "local_steps=4"]),
                                        ("sparseloco", ["--algo-opt", "local_steps=4"])])
def test_resume_in_groups_is_bit_identical(tmp_path, algo, flags):
    """A run in groups stopped at step 6 (mid-round: the slices' local steps and their
    step count in the checkpoint) and resumed to step 12 ends with exactly the state of
    an uninterrupted 12-step run, sliced (diloco) and unsliced (sparseloco), and with
    its bytes by level (the intra-group ledger is in the checkpoint too)."""
    from gossip import checkpoint
    from gossip.train import main
    from tests.test_restarts import _same

    quick = [a for a in WORLD_QUICK if a not in ("--max-steps", "8")]
    args = ["--simulate", "4", "--group-size", "2", "--algo", algo, *flags, *quick, "--checkpoint-every", "6"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert main([*args, "--max-steps", "12", "--out", str(whole)]) == 0
    assert main([*args, "--max-steps", "6", "--out", str(cut)]) == 0
    assert main([*args, "--max-steps", "12", "--resume", str(cut)]) == 0
    a, b = (sorted(d.glob("ckpt-step12-*.pt")) for d in (whole, cut))
    assert a and [p.name for p in a] == [p.name for p in b]
    for pa, pb in zip(a, b):
        sa, sb = checkpoint.load_checkpoint(pa), checkpoint.load_checkpoint(pb)
        assert _same(sa["optimizer"], sb["optimizer"]), pa.name
    ra, rb = (json.loads((d / "summary.json").read_text()) for d in (whole, cut))
    assert ra["final_test_loss"] == rb["final_test_loss"] and ra["bytes_by_level"] == rb["bytes_by_level"]
