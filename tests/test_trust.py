"""Training among untrusted nodes: attacks, robust aggregation, ClippedGossip (gossip.robust),
their flags, and the run's record of them. In-process and small: the accuracy study is
experiments/studies/trust.toml."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gossip import robust
from gossip.comm import SimulatedCommunicator
from tests.conftest import REPO


# ------------------------------------------------------------------ specs and the draw
@pytest.mark.parametrize("spec, match", [
    ("foo", "unknown attack 'foo'; accepted: signflip, scaled"),
    ("scaled:f=2", "bad parameter 'f=2'; its parameters: factor"),
    ("gaussian:sigma=x", "sigma must be a number"),
    ("lazy:every=0", "every must be an integer >= 1"),
    ("", "spec string"),
])
def test_bad_attack_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        robust.parse_attack(spec)


@pytest.mark.parametrize("spec, match", [
    ("trimmed", "needs f="), ("cclip:tau=-1", "tau must be > 0"),
    ("krum", "unknown aggregator 'krum'; accepted: mean, median, trimmed, cclip"),
])
def test_bad_aggregator_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        robust.parse_aggregator(spec)


def test_attackers_are_a_seeded_draw_below_half():
    a = robust.choose_attackers(8, 3, seed=5)
    assert a == robust.choose_attackers(8, 3, seed=5) and len(set(a)) == 3 and all(0 <= i < 8 for i in a)
    assert any(robust.choose_attackers(8, 3, seed=s) != a for s in range(6))
    with pytest.raises(ValueError, match=r"fewer than half the nodes \(K < n/2, here K <= 3\)"):
        robust.choose_attackers(8, 4, seed=0)


# ------------------------------------------------------------------ attacks
def _msgs(n=6, d=5, seed=0):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("spec", ["signflip", "scaled:factor=3", "ipm:eps=0.5", "alie", "gaussian:sigma=2"])
def test_attacks_rewrite_only_the_attackers_rows(spec):
    M = _msgs()
    before = M.clone()
    adv = robust.Adversary(robust.parse_attack(spec), (1, 4), n=6, seed=3)
    out = adv.craft(M, torch.arange(6), step=7)
    assert torch.equal(M, before)  # the honest messages (a node's own model) are left alone
    honest = [0, 2, 3, 5]
    assert torch.equal(out[honest], M[honest])
    H = M[honest]
    want = {"signflip": -M[[1, 4]], "scaled:factor=3": 3 * M[[1, 4]],
            "ipm:eps=0.5": (-0.5 * H.mean(0)).expand(2, -1),
            "alie": (H.mean(0) - robust.alie_z(6, 2) * H.std(0)).expand(2, -1)}.get(spec)
    if want is not None:
        torch.testing.assert_close(out[[1, 4]], want)
    else:  # gaussian: honest plus noise of the stated scale, the same for the same (seed, node, step)
        assert torch.equal(out, adv.craft(M, torch.arange(6), step=7))
        assert not torch.equal(out[[1, 4]], M[[1, 4]])


def test_alie_z_is_the_papers():
    # n = 50, m = 12 (ALIE, arXiv:1902.06156): s = 26 - 12 = 14, Phi^-1(24 / 38) = 0.3360
    assert robust.alie_z(50, 12) == pytest.approx(0.3360, abs=1e-4)


def test_omniscient_attacks_need_every_honest_message():
    adv = robust.Adversary(robust.parse_attack("alie"), (0,), n=4)
    with pytest.raises(ValueError, match="omniscient .* --simulate N"):
        adv.craft(_msgs(1, 3), torch.tensor([0]), step=1)


def test_lazy_repeats_a_stale_message():
    adv = robust.Adversary(robust.parse_attack("lazy:every=3"), (0,), n=3)
    sent = [adv.craft(torch.full((3, 2), float(t)), torch.arange(3), step=t)[0, 0].item() for t in range(1, 8)]
    assert sent == [1.0, 1.0, 3.0, 3.0, 3.0, 6.0, 6.0]


@pytest.mark.parametrize("robust_rule", [None, "clippedgossip"])
def test_a_gossip_attack_counts_exchanges_not_local_steps(robust_rule):
    """With local_steps H > 1 the attackers' clock is the exchange's index, as for the
    periodic methods: lazy:every=E refreshes every E exchanges, whatever H."""
    import topologies
    from gossip import algorithms

    n, d = 4, 3
    algo = algorithms.build("dpsgd", SimulatedCommunicator(topologies.build("ring", n)), local_steps=3,
                            **({} if robust_rule is None else {"robust": robust_rule}))
    adv = robust.Adversary(robust.parse_attack("lazy:every=2"), (1,), n)
    clock, craft = [], adv.craft
    adv.craft = lambda M, nodes, step, **kw: clock.append(step) or craft(M, nodes, step, **kw)
    algo.set_adversary(adv)
    X = _msgs(n, d)
    algo.setup(X)
    for _ in range(12):
        algo.step(X, 0.01 * torch.ones(n, d))
    assert clock == [1, 2, 3, 4]  # steps 3, 6, 9 and 12 (counted from 1) exchange


def test_labelflip_flips_only_the_attackers_labels():
    adv = robust.Adversary(robust.parse_attack("labelflip"), (1,), n=3)
    y = torch.tensor([[0, 9], [2, 3], [4, 5]])
    assert torch.equal(adv.flip_labels(y, torch.arange(3), 10), torch.tensor([[0, 9], [7, 6], [4, 5]]))
    assert torch.equal(adv.flip_labels(torch.tensor([2, 3]), torch.tensor([1]), 10), torch.tensor([7, 6]))
    assert adv.craft(_msgs(3), torch.arange(3), 1) is not None and not adv.crafts_messages


# ------------------------------------------------------------------ aggregators
def test_median_and_trimmed_mean_are_coordinatewise():
    Q = torch.tensor([[1.0, 10.0], [2.0, -50.0], [3.0, 20.0], [100.0, 30.0]])
    torch.testing.assert_close(robust.parse_aggregator("median")(Q), torch.tensor([2.5, 15.0]))
    torch.testing.assert_close(robust.parse_aggregator("trimmed:f=1")(Q), torch.tensor([2.5, 15.0]))
    torch.testing.assert_close(robust.parse_aggregator("trimmed:f=0")(Q), Q.mean(0))
    with pytest.raises(ValueError, match="f must be an integer with 0 <= f < n/2"):
        robust.parse_aggregator("trimmed:f=2").check_nodes(4)


def test_centered_clipping_bounds_one_outlier():
    agg = robust.parse_aggregator("cclip:tau=1")
    Q = torch.zeros(8, 3)
    Q[0] = 1e6
    v = agg(Q, 0)  # from the centre 0: the outlier moves the aggregate by at most tau / n
    assert float(v.norm()) == pytest.approx(1 / 8)
    Q2 = torch.full((8, 3), 0.1)
    v2 = agg(Q2, 0)  # the honest ones within tau of the last aggregate are averaged as they are
    torch.testing.assert_close(v2, torch.full((3,), 0.1))


def test_centered_clippings_adaptive_radius_is_the_median_distance():
    """Without tau, the radius is the median of the senders' distances to the centre:
    attackers fewer than half cannot widen it, and it scales with the messages (a
    fixed radius passes a whole attack while every message is short)."""
    agg = robust.parse_aggregator("cclip")
    assert agg.adaptive and agg.spec == "cclip:iters=1,beta=0"
    assert not robust.parse_aggregator("cclip:tau=2").adaptive
    honest = torch.eye(8)[:5] * torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0]])  # distances 1..5 from 0
    Q = torch.cat([honest, torch.full((3, 8), 1e6)])  # three of eight attack, far away
    v = agg(Q, 0)
    # the lower median of the distances [1, 2, 3, 4, 5, big x 3] is 4: the attackers add 3 x 4 / 8 at most
    tau = 4.0
    want = (honest * torch.clamp(tau / honest.norm(dim=1, keepdim=True), max=1.0)).sum(0) / 8
    want += 3 * tau / 8 * torch.ones(8) / 8 ** 0.5
    torch.testing.assert_close(v, want)
    small = robust.parse_aggregator("cclip")(Q * 1e-3, 0)  # scale-free: the same rule at any scale
    torch.testing.assert_close(small, v * 1e-3)
    fixed = robust.parse_aggregator("cclip:tau=4")(Q * 1e-3, 0)  # a fixed radius passes the short attack whole
    assert float(fixed.norm()) > 100 * float(small.norm())


def test_centered_clipping_radius_is_the_whole_messages_in_the_sharded_layout():
    """cclip's tau bounds a sender's clipped difference over the whole message: a shard
    of L of d values is clipped to tau sqrt(L/d), so an outlier moves the all-gathered
    aggregate by tau/n, as the whole-vector rule does, not by sqrt(n) tau/n."""
    from gossip import algorithms

    agg = robust.parse_aggregator("cclip:tau=2")
    assert agg.radius(4) == 2.0  # no dim: each call sees a whole message
    agg.dim = 16
    assert agg.radius(4) == pytest.approx(1.0) and agg.radius(16) == 2.0
    n, d = 4, 16
    G = torch.zeros(n, d)
    G[1] = 1e6 * torch.linspace(1, 2, d)  # one outlier, its shards of unequal length
    comm = SimulatedCommunicator(None, world_size=n)
    algo = algorithms.build("allreduce", comm, aggregator="cclip:tau=1")
    algo.setup(torch.zeros(n, d))
    algo.reduce_gradients(G)
    whole = robust.parse_aggregator("cclip:tau=1")(torch.zeros(n, d) + G, 0)
    # the shards' radii add up (in squares) to tau: the aggregate is 1/n long, as the whole rule's
    assert float(G[0].norm()) == pytest.approx(1 / n) == pytest.approx(float(whole.norm()))


@pytest.mark.parametrize("iters, adaptive", [(1, False), (3, False), (3, True)])
def test_centered_clipping_in_the_sharded_layout_is_the_whole_message_rule(iters, adaptive):
    """Each sender's difference is clipped by its distance over the whole message, though
    no owner holds one: a sender whose difference lies in one shard is clipped as the
    whole-vector rule clips it (not to that shard's share of the radius), over rounds
    that start from the last aggregate; the distances cost 4n(n-1) bytes per node per
    iteration more than the shards' exchange."""
    from gossip.algorithms._robust import ShardedRule

    n, d, tau = 4, 16, 2.0
    spec = f"cclip:iters={iters}" if adaptive else f"cclip:tau={tau:g},iters={iters}"
    M = 0.1 * _msgs(n, d, seed=5)
    M[2, :4] += 1.5  # within the radius as a whole, 3x its shard's share tau * sqrt(4/16)
    M[0] += 10.0  # outside it
    whole = robust.parse_aggregator(spec)
    comm = SimulatedCommunicator(None, world_size=n)
    center = torch.zeros(d)
    rule = ShardedRule.even(robust.parse_aggregator(spec), d, n, what="t", center=center)
    for k in range(2):
        before = comm.ledger.sent_by(0)
        out = rule.exchange(comm, M + k)
        torch.testing.assert_close(out, whole(M + k, 0))
        torch.testing.assert_close(center, out)
        mean_exchange = 2 * (n - 1) * 4 * (d // n)  # push and pull of 4-value shards
        if k:  # (the first exchange also checks the split sizes, once)
            assert comm.ledger.sent_by(0) - before == mean_exchange + 4 * n * (n - 1) * iters
    local, whole = ShardedRule.even(robust.parse_aggregator(spec), d, n, what="t"), robust.parse_aggregator(spec)
    for k in range(2):
        torch.testing.assert_close(local.local(M + k), whole(M + k, 0))
    per_shard = robust.parse_aggregator(spec)
    per_shard.dim = d  # the compressed owners' rule: each shard to its share
    assert not torch.allclose(torch.cat([per_shard(M[:, a:a + 4], a // 4) for a in range(0, d, 4)]),
                              whole(M, 0), atol=1e-3)


# ------------------------------------------------------------------ ClippedGossip
def test_clipped_mix_is_the_papers_update():
    Y = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 3.0]])
    index = torch.tensor([[1, 2]])
    weights = torch.tensor([[0.25, 0.25]], dtype=torch.float64)
    # fixed radius 2: (1, 0) passes, (0, 3) becomes (0, 2)
    out, taus = robust.clipped_mix(Y[:1], Y, index, weights, torch.tensor([2]), robust.ClippedGossipSpec(tau=2.0))
    torch.testing.assert_close(out[0], torch.tensor([0.25, 0.5]))
    # adaptive (b = 1): the farthest neighbour is clipped to the next one's distance, 1
    out, taus = robust.clipped_mix(Y[:1], Y, index, weights, torch.tensor([2]), robust.parse_robust("clippedgossip"))
    torch.testing.assert_close(out[0], torch.tensor([0.25, 0.25]))
    assert float(taus[0]) == pytest.approx(1.0)


# ------------------------------------------------------------------ the algorithms
def test_allreduce_robust_rules_run_sharded_with_a_ring_all_reduces_bytes():
    from gossip import algorithms

    n, d = 4, 10
    G = _msgs(n, d, seed=1)
    out = {}
    for spec in ("mean", "median", "trimmed:f=1"):
        comm = SimulatedCommunicator(None, world_size=n)
        algo = algorithms.build("allreduce", comm, aggregator=spec)
        algo.setup(torch.zeros(n, d))
        algo.reduce_gradients(G.clone())  # the first exchange also agrees on the split sizes, once
        before = comm.ledger.bytes_sent
        X = G.clone()
        algo.reduce_gradients(X)
        out[spec] = X
        assert torch.equal(X, X[:1].expand_as(X))  # every node takes the same direction
        # each node pushes (n - 1) of its n shards and pulls (n - 1) aggregates: 2 (n - 1)/n x 4d,
        # as a ring all-reduce of fp32 values
        assert comm.ledger.bytes_sent - before == n * 2 * (n - 1) * 4 * d // n
    torch.testing.assert_close(out["mean"][0], G.mean(0))
    torch.testing.assert_close(out["median"][0], G.sort(0).values[1:3].mean(0))
    torch.testing.assert_close(out["trimmed:f=1"][0], G.sort(0).values[1:3].mean(0))


def test_clippedgossip_without_attackers_and_a_wide_radius_is_dpsgd_of_the_half_steps():
    import topologies
    from gossip import algorithms

    n, d = 6, 4
    X0, U = _msgs(n, d, seed=2), 0.1 * _msgs(n, d, seed=3)
    topo = topologies.build("ring", n)
    W = torch.tensor(topo.matrix if not hasattr(topo.matrix, "toarray") else topo.matrix.toarray(),
                        dtype=torch.float32)
    algo = algorithms.build("dpsgd", SimulatedCommunicator(topo), robust="clippedgossip:tau=1e9")
    X = X0.clone()
    algo.setup(X)
    algo.step(X, U)
    torch.testing.assert_close(X, W @ (X0 + U))


# ------------------------------------------------------------------ the run
def _train(*argv: str) -> int:
    from gossip import train

    return train.main(list(argv))


QUICK = ["--data", "synthetic", "--model", "mlp", "--epochs", "1", "--max-steps", "2", "--batch-size", "64",
         "--no-progress", "--no-node-eval"]


@pytest.mark.parametrize("argv, match", [
    (["--algo", "allreduce", "--simulate", "8", "--byzantine", "4", "--attack", "signflip"],
     r"--byzantine 4 of --simulate 8 nodes: the attackers must be fewer than half the nodes \(K <= 3\)"),
    (["--algo", "allreduce", "--byzantine", "1", "--attack", "nope"], "--attack: unknown attack 'nope'"),
    (["--algo", "allreduce", "--byzantine", "1"], "needs --attack NAME"),
    (["--algo", "dcd", "--robust", "clippedgossip"], "--algo dcd: its neighbours' replicas add up every message"),
    (["--algo", "dpsgd", "--aggregator", "median"], "--algo dpsgd is decentralized: use --robust clippedgossip"),
    (["--algo", "ecd", "--byzantine", "1", "--attack", "signflip"], "accepted: --algo allreduce, dpsgd"),
    (["--algo", "allreduce", "--byzantine", "1", "--attack", "alie"], "omniscient .* --simulate N only"),
    (["--algo", "allreduce", "--simulate", "8", "--aggregator", "trimmed:f=4"], "f must be an integer with 0 <= f < n/2"),
])
def test_bad_trust_flags_get_one_line(argv, match, capsys, tmp_path):
    rc = _train(*argv, *QUICK, "--out", str(tmp_path / "r"))
    err = capsys.readouterr().err.strip()
    assert rc != 0 and len(err.splitlines()) == 1, err
    assert __import__("re").search(match, err), err


def test_a_run_with_an_attacker_records_it(tmp_path, capsys):
    out = tmp_path / "r"
    assert _train("--algo", "dpsgd", "--simulate", "6", "--byzantine", "2", "--attack", "ipm:eps=0.5",
                  "--robust", "clippedgossip", "--seed", "3", *QUICK, "--out", str(out)) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["trust"] == {"attack": "ipm:eps=0.5", "attackers": list(robust.choose_attackers(6, 2, 3)),
                          "aggregator": None, "robust": "clippedgossip"}
    assert math.isfinite(s["final_test_acc"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["byzantine"] == 2 and cfg["attack"] == "ipm:eps=0.5"


def test_the_trust_study_smoke(tmp_path, capsys):
    """experiments/studies/trust.toml at a tiny size: a clean run and a defended run under
    attack, each a row with its tags, the attacker recorded, the docs' table drawn."""
    from experiments import _provenance, render, study

    res_path = tmp_path / "res.json"
    assert study.main(["--nodes", "4", "--epochs", "1", "--max-steps", "1",
                       "--runs", "allreduce-s0,allreduce-signflip-cclip-s0", "--out", str(tmp_path / "runs"),
                       "--results", str(res_path)], name="trust") == 0
    res, prov = _provenance.read(res_path)
    assert [(r["method"], r["attack"], r["defence"]) for r in res["rows"]] == [
        ("allreduce", "none", "none"), ("allreduce", "signflip", "cclip")]
    assert "experiments/studies/trust.toml" in prov["sources"]
    assert any(a.startswith("cclip:") and "tau" not in a for a in prov["configs"][1]) and "--byzantine" in prov["configs"][1]
    table = (tmp_path / "runs" / "results.md").read_text()
    assert table == render.TABLES["trust"].render(res) + "\n" and "| `allreduce` | signflip | cclip | 1 |" in table


def test_the_adversarial_track_shows_each_attack_against_each_defence():
    """The benchmark report's adversarial track: a row per method and defence, a column per
    attack, the mean over seeds with its interval cut to an accuracy's range, diverged runs
    counted apart, and the attack that hurt the row most."""
    from experiments import render, tables

    def row(method, attack, defence, seed, acc):
        return {"method": method, "attack": attack, "defence": defence, "seed": str(seed), "final_test_acc": acc}

    res = {"nodes": 8, "byzantine": 2, "epochs": 60, "rows": [
        row("allreduce", "none", "none", 0, 0.90), row("allreduce", "none", "none", 1, 0.92),
        row("allreduce", "signflip", "none", 0, 0.10), row("allreduce", "signflip", "none", 1, 0.90),
        row("allreduce", "ipm:eps=10", "none", 0, None), row("allreduce", "ipm:eps=10", "none", 1, 0.5),
        row("allreduce", "signflip", "cclip", 0, 0.88), row("allreduce", "signflip", "cclip", 1, 0.86)]}
    lines = tables.trust_matrix(res).splitlines()
    assert lines[0] == ("| method + defence (8 nodes, 2 attackers, 60 epochs, 2 seeds) | clean | signflip | ipm:eps=10 "
                        "| worst attack |")
    # signflip's two seeds part ways: a t-interval far wider than 0-100, cut to it
    assert lines[2] == "| `allreduce` | 91.0 [78.3, 100.0] | 50.0 [0.0, 100.0] | 50.0 (1 seed), diverged 1/2 | ipm:eps=10 |"
    assert lines[3] == "| `allreduce` + cclip | - | 87.0 [74.3, 99.7] | - | signflip |"
    page = render.PAGES["docs/benchmark.md"]
    assert f"{render.RESULTS}/trust.json" in page.trust and f"{render.RESULTS}/trust_torchrun.json" in page.trust
    text = page.text("docs/benchmark.md")
    assert "## The adversarial track" in text and "### 4 ranks under torchrun, 1 attacker" in text


def test_the_torchrun_trust_experiment_smoke(tmp_path):
    """experiments/trust_torchrun.py at a tiny size: one defended run of 4 real ranks,
    one of them the attacker drawn from the seed, recorded as a row the docs' table draws,
    its configuration listed for the witnesses (as its simulation)."""
    from experiments import _provenance, render, trust_torchrun

    res_path = tmp_path / "res.json"
    assert trust_torchrun.main(["--epochs", "1", "--max-steps", "2", "--seeds", "0", "--methods", "allreduce",
                                "--cases", "defended", "--out", str(tmp_path / "runs"),
                                "--results", str(res_path)]) == 0
    res, prov = _provenance.read(res_path)
    [row] = res["rows"]
    assert (row["method"], row["attack"], row["defence"]) == ("allreduce", "signflip", "cclip")
    assert row["attackers"] == list(robust.choose_attackers(4, 1, 0)) and row["steps"] == 2
    [config] = prov["configs"]
    assert "--simulate" in config and "cclip:iters=3,beta=0.9" in config
    assert "| `allreduce` | signflip | cclip | 1 |" in render.TABLES["trust_torchrun"].render(res)


@pytest.mark.parametrize("argv, match", [
    (["--methods", "dpsgd"], r"--methods: unknown dpsgd; accepted: allreduce, noloco"),
    (["--cases", "clean,broken"], r"--cases: unknown broken; accepted: clean, clean-defended, attacked, defended"),
    (["--nodes", "2"], r"--nodes must be at least 3"),
])
def test_the_torchrun_trust_experiment_refuses_bad_options_in_one_line(argv, match, tmp_path, capsys):
    from experiments import trust_torchrun

    with pytest.raises(SystemExit) as e:
        trust_torchrun.main([*argv, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and __import__("re").search(match, err[-1]), err


#: the torchrun runs of the tests below, each with its flags: all in ONE launch of 4 ranks
#: (torchrun and torch start once, not once per run)
_FLAGS = ["--algo", "allreduce", "--data", "synthetic", "--model", "mlp", "--epochs", "1", "--max-steps", "12",
          "--batch-size", "64", "--no-progress", "--no-node-eval", "--seed", "1"]
_RULES = ["median", "cclip:tau=1", "cclip:iters=3"]
_DILOCO = ["--algo", "diloco", "--algo-opt", "local_steps=3", "--data", "synthetic", "--model", "mlp",
           "--epochs", "1", "--max-steps", "9", "--batch-size", "64", "--no-progress", "--no-node-eval",
           "--seed", "2", "--byzantine", "1", "--attack", "scaled:factor=-8", "--aggregator", "median"]


def _attack(rule: str) -> list[str]:
    return ["--byzantine", "1", "--attack", "scaled:factor=-10", "--aggregator", rule]


@pytest.fixture(scope="module")
def torchrun_runs(tmp_path_factory):
    """{name: run directory} of the runs under torchrun, 4 ranks, one launch."""
    from tests.conftest import torchrun_jobs, why

    root = tmp_path_factory.mktemp("torchrun")
    jobs = [(f"allreduce-{k}", [*_FLAGS, *_attack(rule), "--out", str(root / f"allreduce-{k}")])
            for k, rule in enumerate(_RULES)]
    jobs.append(("diloco", [*_DILOCO, "--out", str(root / "diloco")]))
    r, codes = torchrun_jobs(4, jobs, timeout=240, cwd=root)
    assert r.returncode == 0 and codes == {name: [0] * 4 for name, _ in jobs}, why(r)
    return {name: root / name for name, _ in jobs}


@pytest.mark.parametrize("rule", _RULES)
def test_under_torchrun_an_attacker_rank_is_defended_as_in_the_simulation(tmp_path, rule, torchrun_runs):
    """4 ranks, one of them Byzantine (a real rank sending scaled, sign-flipped gradients
    through the sharded exchange's wire); the coordinate-wise median, or centered
    clipping (whose owners exchange the senders' distances and all-gather the
    aggregates), keeps the run within 5 points of the clean one, and the ranks reach the
    numbers of the simulation."""
    attack = _attack(rule)
    dist = json.loads((torchrun_runs[f"allreduce-{_RULES.index(rule)}"] / "summary.json").read_text())
    assert dist["trust"]["attackers"] == list(robust.choose_attackers(4, 1, 1))
    for name, extra in (("sim", attack), ("clean", [])):
        assert _train(*_FLAGS, *extra, "--simulate", "4", "--simulate-mode", "loop", "--out", str(tmp_path / name)) == 0
    sim = json.loads((tmp_path / "sim" / "summary.json").read_text())
    clean = json.loads((tmp_path / "clean" / "summary.json").read_text())
    assert dist["final_test_acc"] == sim["final_test_acc"]
    assert dist["final_test_acc"] >= clean["final_test_acc"] - 0.05, (dist["final_test_acc"], clean["final_test_acc"])


# ------------------------------------------------------------------ the periodic methods
def test_a_sharded_rule_gives_the_same_aggregate_exchanged_or_local():
    """The rule through the sharded layout (owners) and over every message held here."""
    from gossip.algorithms._robust import ShardedRule

    n, d = 5, 23
    M = _msgs(n, d, seed=4)
    for spec in ("median", "trimmed:f=1", "cclip:tau=0.5", "cclip:iters=2"):
        a, b = robust.parse_aggregator(spec), robust.parse_aggregator(spec)
        ca, cb = torch.zeros(d), torch.zeros(d)
        ra, rb = ShardedRule.even(a, d, n, what="t", center=ca), ShardedRule.even(b, d, n, what="t", center=cb)
        for k in range(2):  # twice: cclip starts the second from the first aggregate
            out = ra.exchange(SimulatedCommunicator(None, world_size=n), M + k)
            assert torch.equal(out, rb.local(M + k)), spec
        assert torch.equal(ca, cb)
    with pytest.raises(ValueError, match="cuts the 3 values into 5 shards"):
        ShardedRule.even(robust.parse_aggregator("median"), 3, 5, what="t")


def _quadratic_run(algo: str, aggregator: str, attack: str | None, *, rounds: int = 6, **opts) -> torch.Tensor:
    """n = 8 nodes on f_i(x) = |x - c_i|^2 / 2 (one node attacking where ``attack``), H = 4
    local SGD steps per round through the algorithm's own step: the models at the end."""
    from gossip import algorithms

    n, d, H, lr = 8, 64, 4, 0.1
    g = torch.Generator().manual_seed(11)
    C = 1.0 + 0.1 * torch.randn(n, d, generator=g)
    comm = SimulatedCommunicator(None, world_size=n)
    extra = {"local_steps": H} if algo != "demo" else {}
    alg = algorithms.build(algo, comm, aggregator=aggregator, **extra, **opts)
    if attack is not None:
        alg.set_adversary(robust.Adversary(robust.parse_attack(attack), (3,), n))
    X = torch.zeros(n, d)
    alg.setup(X)
    for _ in range(rounds * H):
        if algo == "demo":
            alg.set_lr(lr)
            G = X - C
            alg.reduce_gradients(G)
            X.sub_(lr * G)
        else:
            alg.set_lr(lr)
            alg.step(X, -lr * (X - C))
    return X


@pytest.mark.parametrize("algo, opts, rule", [
    ("diloco", {}, "median"),  # identity: the fp32 pseudo-gradients through the sharded layout
    ("diloco", {}, "cclip:tau=0.3"),  # identity: cclip's distances and all-gather in the sharded layout
    ("diloco", {"compressor": "quant:bits=8"}, "cclip:tau=0.3"),  # each owner's rule on decoded shards
    ("diloco", {}, "cclip:iters=3"),  # the adaptive radius, over the whole message's distances
    ("diloco", {"compressor": "quant:bits=8"}, "cclip:iters=3"),  # and over each owner's shard
    ("diloco", {"compressor": "quant:bits=8", "exchange": "allgather"}, "trimmed:f=1"),  # on every node
    ("sparseloco", {"topk_fraction": 0.5, "bits": 32}, "cclip:tau=0.3"),
    ("demo", {}, "median"),
])
def test_a_robust_rule_keeps_a_periodic_method_near_its_clean_run(algo, opts, rule):
    """One node of eight sends 8x its negated pseudo-gradient: the mean is pushed far off the
    clean run, the robust rule stays close to it."""
    clean = _quadratic_run(algo, "mean", None, **opts)
    attacked = _quadratic_run(algo, "mean", "scaled:factor=-8", **opts)
    defended = _quadratic_run(algo, rule, "scaled:factor=-8", **opts)
    far, near = float((attacked - clean).norm()), float((defended - clean).norm())
    assert near < far / 4, (far, near)


@pytest.mark.parametrize("algo, opts", [
    ("diloco", {}), ("diloco", {"compressor": "quant:bits=4"}), ("diloco", {"compressor": "quant:bits=4",
                                                                           "exchange": "allgather"}),
    ("sparseloco", {}), ("demo", {}),
])
def test_a_robust_rule_costs_the_periodic_methods_no_bytes(algo, opts):
    """The ledger of a round with the median equals the mean's: diloco's fp32 pseudo-gradients
    go through the sharded layout, 2 (n - 1)/n x 4d as the ring all-reduce, plus one 16-byte
    size check per node at the first exchange; the compressed and the all-gathered
    exchanges carry the same payloads with the rule at the owner or at every node."""
    from gossip import algorithms

    n, d, H = 4, 256, 2
    sent = {}
    for rule in ("mean", "median"):
        comm = SimulatedCommunicator(None, world_size=n)
        extra = {"local_steps": H} if algo != "demo" else {}
        alg = algorithms.build(algo, comm, aggregator=rule, **extra, **opts)
        X = _msgs(n, d, seed=5)
        alg.setup(X)
        per_round = []
        for _ in range(2):
            before = comm.ledger.bytes_sent
            for _ in range(H if algo != "demo" else 1):
                alg.set_lr(0.1)
                if algo == "demo":
                    alg.reduce_gradients(_msgs(n, d, seed=6))
                else:
                    alg.step(X, 0.01 * _msgs(n, d, seed=6))
            per_round.append(comm.ledger.bytes_sent - before)
        sent[rule] = per_round
    if algo == "diloco" and not opts:  # the ring all-reduce vs the sharded layout's size check
        assert sent["median"][1] == sent["mean"][1] == n * 2 * (n - 1) * 4 * d // n
        assert sent["median"][0] == sent["mean"][0] + n * (n - 1) * 16
    else:
        assert sent["median"] == sent["mean"]


def _noloco_run(topo: str, rule: str | None, attack: str | None, rounds: int = 6) -> tuple[torch.Tensor, int]:
    """noloco on the quadratic of :func:`_quadratic_run` over graph ``topo`` of 8 nodes (node 3
    attacking where ``attack``), ``rule`` its ``robust``: the models at the end and the bytes."""
    import topologies
    from gossip import algorithms

    n, d, H, lr = 8, 64, 4, 0.1
    g = torch.Generator().manual_seed(11)
    C = 1.0 + 0.1 * torch.randn(n, d, generator=g)
    comm = SimulatedCommunicator(topologies.build(topo, n))
    alg = algorithms.build("noloco", comm, local_steps=H, **({"robust": rule} if rule else {}))
    if attack is not None:
        alg.set_adversary(robust.Adversary(robust.parse_attack(attack), (3,), n))
    X = torch.zeros(n, d)
    alg.setup(X)
    for _ in range(rounds * H):
        alg.set_lr(lr)
        alg.step(X, -lr * (X - C))
    return X, comm.ledger.bytes_sent


@pytest.mark.parametrize("topo, rule", [("ring", "clippedgossip"), ("matching", "clippedgossip:tau=0.5")])
def test_clippedgossip_keeps_noloco_near_its_clean_run(topo, rule):
    """One node of eight sends 8x its negated pseudo-gradient beside its honest slow weights:
    the honest nodes' models are pushed far off the clean run; ClippedGossip on the group's
    mean (the adaptive radius on a ring, a fixed one on noloco's matching) keeps them near
    it, at noloco's bytes."""
    honest = [i for i in range(8) if i != 3]
    clean, sent_clean = _noloco_run(topo, None, None)
    attacked, _ = _noloco_run(topo, None, "scaled:factor=-8")
    defended, sent = _noloco_run(topo, rule, "scaled:factor=-8")
    far = float((attacked[honest] - clean[honest]).norm())
    near = float((defended[honest] - clean[honest]).norm())
    assert near < far / 4, (far, near)
    assert sent == sent_clean
    # a radius no honest difference reaches is noloco itself (up to the order of the sums)
    wide, _ = _noloco_run(topo, "clippedgossip:tau=1e9", None)
    torch.testing.assert_close(wide, clean, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("argv, match", [
    (["--algo", "noloco", "--aggregator", "median"],
     r"--algo noloco: it averages with its graph neighbours only .* no rule over two messages outvotes one.* its defence is --robust clippedgossip:tau=T"),
    (["--algo", "noloco", "--robust", "clippedgossip"],
     r"robust clippedgossip:b=1: the adaptive radius .* on matching a node has at most 1 neighbour\(s\), so it "
     r"would clip nothing; give a fixed radius"),
    (["--algo", "diloco", "--aggregator", "median", "--algo-opt", "outer_delay=1"],
     r"`aggregator` median with `outer_delay` 1: the eager estimate"),
    (["--algo", "diloco", "--aggregator", "median", "--compressor", "randomk:p=0.5"],
     r"diloco: aggregator=median with compressor randomk.* all-reduce the values it keeps"),
    (["--algo", "sparseloco", "--aggregator", "cclip:tau=1,beta=0.9"], r"cclip's beta is the workers' momentum"),
    (["--algo", "slowmo", "--byzantine", "1", "--attack", "signflip"],
     r"--algo slowmo: its messages do not carry .* accepted: --algo .*diloco.*sparseloco"),
    (["--algo", "localsgd", "--aggregator", "median"], r"--algo localsgd does not carry it yet \(accepted: --algo "),
])
def test_periodic_trust_refusals_are_one_line(argv, match, capsys, tmp_path):
    rc = _train(*argv, "--simulate", "4", *QUICK, "--out", str(tmp_path / "r"))
    err = capsys.readouterr().err.strip()
    assert rc != 0 and len(err.splitlines()) == 1, err
    assert __import__("re").search(match, err), err


def test_under_torchrun_diloco_with_an_attacker_rank_equals_the_simulation(tmp_path, torchrun_runs):
    """4 ranks, rank-drawn attacker sending -8x its pseudo-gradient, the median in the
    sharded layout: the same final accuracy as the in-process simulation, and the record."""
    flags = _DILOCO
    assert _train(*flags, "--simulate", "4", "--simulate-mode", "loop", "--out", str(tmp_path / "sim")) == 0
    dist = json.loads((torchrun_runs["diloco"] / "summary.json").read_text())
    sim = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert dist["trust"] == sim["trust"] and dist["trust"]["attackers"] == list(robust.choose_attackers(4, 1, 2))
    assert dist["final_test_loss"] == sim["final_test_loss"] and dist["final_test_acc"] == sim["final_test_acc"]
    assert dist["bytes_sent_per_node_per_step"] == pytest.approx(sim["bytes_sent_per_node_per_step"], rel=1e-12)
