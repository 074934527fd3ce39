"""Across hosts as users launch it: one ``torchrun`` per host on the virtual cluster.

2 hosts x 2 processes (``VirtualCluster.run_torchrun``: torchrun's own elastic agents
meeting at a c10d rendezvous on host 0) train a few steps. The parameters are
bit-identical to the same run on one host (``torchrun --nproc_per_node 4``, threads
pinned in both); what the ledgers record between hosts crosses the hosts' interfaces
and what they record within a host stays on its loopback, to within the protocol
overhead; ``summary.json`` says 2 hosts of 2 processes.

These build network namespaces, so they need root (CAP_NET_ADMIN and CAP_SYS_ADMIN),
``ip`` and ``tc``; elsewhere they are skipped with the reason. The two training runs
(minutes each on 2 cores) carry the ``netns`` marker: ``make test`` leaves them out and
``.ci/run`` runs them where it can (``sudo .venv/bin/pytest -m netns``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from gossip import checkpoint
from tests.conftest import child_env, run_process
from tests.test_netshape_cluster import _ours, _prefix, needs_netns, vcl

# flat on purpose: across hosts, an unset --group-size groups each host's processes
TRAIN = ["-m", "gossip.train", "--algo", "ecd", "--bits", "8", "--topology", "ring", "--group-size", "1",
         "--no-progress"]
# two run lengths inside the first epoch (31 steps of MNIST-1D at batch 32 on 4 nodes):
# both have the same start-up, setup exchange and one evaluation, so their difference
# is the traffic of the steps alone
SHORT, LONG = 2, 25
# what neither run's ledger holds and may differ between them: the agents' keep-alives
# and store traffic, a retransmitted segment (a 64 KiB one on lo) on these 2 shared cores
SLACK = 128 * 1024


@pytest.fixture
def prefix():
    p = _prefix()
    yield p
    left = _ours(p)
    if left:  # never leave anything behind, even when a test fails
        vcl.cleanup(p)
    assert not left, f"namespaces left behind: {left}"


def _final_params(run_dir: Path) -> torch.Tensor:
    """The (n, d) parameters of the run's last checkpoint, rank by rank."""
    step = max(int(p.name.split("-step")[1].split("-")[0]) for p in run_dir.glob("ckpt-step*-rank*.pt"))
    files = sorted(run_dir.glob(f"ckpt-step{step}-rank*.pt"), key=lambda p: int(p.stem.split("rank")[1]))
    return torch.cat([checkpoint.load_checkpoint(f)["optimizer"]["params"] for f in files])


def _failure(res) -> str:
    return "\n".join(f"host {r.rank}: exit {r.returncode}\n{res.tail(r.rank, 15)}" for r in res.ranks)


@pytest.mark.netns
@needs_netns
def test_two_hosts_of_two_processes_match_one_host(tmp_path, prefix, mnist1d_cache):
    env = child_env(1, {"GOSSIP_CACHE": str(mnist1d_cache[0])})
    runs = {}
    with vcl.VirtualCluster(2, prefix=prefix, subnet="10.213.79.0/24") as vc:
        # exactly the line a user types on each host: no RANK/WORLD_SIZE from us
        argv = vc.torchrun_argv(1, 2, TRAIN)
        assert argv[-len(TRAIN):] == TRAIN and "--rdzv-backend" in argv and "--local-addr" in argv
        assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"} & set(vc.torchrun_env(1, env))
        assert vc.torchrun_env(1, env)["GLOO_SOCKET_IFNAME"] == f"{prefix}h1"
        for steps in (SHORT, LONG):
            out = tmp_path / f"hosts-{steps}"
            res = vc.run_torchrun([*TRAIN, "--max-steps", str(steps), "--out", str(out)], 2, env=env,
                                  timeout=300, outdir=tmp_path / f"vcluster-{steps}")
            assert res.ok, _failure(res)
            runs[steps] = (res, out)
    assert _ours(prefix) == []

    res, out = runs[LONG]
    assert len(res.workers) == 2 and sorted(r for ranks in res.workers for r in ranks) == [0, 1, 2, 3]
    assert all(len(ranks) == 2 for ranks in res.workers)
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["world_size"], summary["hosts"], summary["procs_per_host"]) == (4, 2, 2)
    assert summary["steps"] == LONG and summary["mode"] == "torchrun"

    # the same run on one host: the same numbers, bit for bit
    one = tmp_path / "one-host"
    p = run_process([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                     *TRAIN, "--max-steps", str(LONG), "--out", str(one)], timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    one_summary = json.loads((one / "summary.json").read_text())
    assert (one_summary["hosts"], one_summary["procs_per_host"]) == (1, 4)
    assert torch.equal(_final_params(out), _final_params(one))
    assert summary["final_test_loss"] == one_summary["final_test_loss"]

    # the steps' traffic: between hosts over the interfaces, within a host over lo
    for _, o in runs.values():  # one evaluation (its all-reduces are not in the ledger) in each
        records = [json.loads(ln) for ln in (o / "metrics-rank0.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if r["kind"] == "eval"] in ([SHORT], [LONG])
    ledger = {s: vcl.ledger_traffic(o, r.workers) for s, (r, o) in runs.items()}
    short = runs[SHORT][0]
    for h in range(2):
        inter = ledger[LONG][h]["inter"] - ledger[SHORT][h]["inter"]
        intra = ledger[LONG][h]["intra"] - ledger[SHORT][h]["intra"]
        sent = res.ranks[h].tx_bytes - short.ranks[h].tx_bytes
        loopback = res.ranks[h].lo_bytes - short.ranks[h].lo_bytes
        assert inter > 0 and intra > 0
        # TCP/IP/Ethernet headers (66 B per 1448) and acks: a few percent over the ledger;
        # had the processes of one host talked over its interface, lo would be empty
        assert inter - SLACK <= sent <= 1.08 * inter + SLACK, (h, inter, sent)
        assert intra - SLACK <= loopback <= 1.08 * intra + SLACK, (h, intra, loopback)


@needs_netns
def test_torchrun_static_rendezvous_and_bad_values(tmp_path, prefix):
    # one os.write per line: the host's two workers share its stdout file, and print()
    # writes the text and its newline separately, so their lines could interleave
    show = ("import os, time; os.write(1, ' '.join(['worker', *[os.environ[k] for k in ('RANK', 'LOCAL_RANK', "
            "'GROUP_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'GLOO_SOCKET_IFNAME')]]).encode() + b'\\n'); "
            "time.sleep(2)")  # long enough for the cluster to see which ranks run where
    script = tmp_path / "show.py"
    script.write_text(show + "\n")
    with vcl.VirtualCluster(2, prefix=prefix, subnet="10.213.80.0/24") as vc:
        with pytest.raises(vcl.VClusterError, match=r"bad rendezvous 'etcd': expected one of c10d, static"):
            vc.torchrun_argv(0, 2, [str(script)], rdzv="etcd")
        with pytest.raises(vcl.VClusterError, match=r"bad number of processes per host 0"):
            vc.torchrun_argv(0, 0, [str(script)])
        assert vc.torchrun_argv(1, 2, [str(script)], rdzv="static")[-7:] == [
            "--node-rank", "1", "--master-addr", "10.213.80.1", "--master-port", "29500", str(script)]
        res = vc.run_torchrun([str(script)], 2, rdzv="static", timeout=120, outdir=tmp_path / "out")
    assert res.ok, _failure(res)
    for h in range(2):
        rows = [ln.split()[1:] for ln in res.ranks[h].stdout.read_text().splitlines() if ln.startswith("worker")]
        assert sorted(rows) == [[str(2 * h), "0", str(h), "4", "2", f"{prefix}h{h}"],
                                [str(2 * h + 1), "1", str(h), "4", "2", f"{prefix}h{h}"]]
    assert res.workers == [[0, 1], [2, 3]]


@pytest.mark.netns
@needs_netns
def test_a_worker_killed_on_host_1_restarts_and_the_run_ends_as_on_one_host(tmp_path, prefix, mnist1d_cache):
    """``--resume auto`` across hosts: SIGKILL of a worker on host 1 after the step-10
    checkpoints; the agents restart the workers (a new rendezvous round), they continue
    from the newest checkpoint, and the run ends bit-identical to an uninterrupted run
    on one host, each step logged once."""
    import os
    import signal

    env = child_env(1, {"GOSSIP_CACHE": str(mnist1d_cache[0])})
    run = [*TRAIN, "--max-steps", "40", "--checkpoint-every", "10", "--log-every", "1", "--emulate-latency", "20"]
    out = tmp_path / "restarted"
    killed: list[int] = []

    def kill_rank_3_once() -> None:
        if killed or not all((out / f"ckpt-step10-rank{r}.pt").exists() for r in range(4)):
            return
        for pid in (p for ps in vcl._children().values() for p in ps):
            e = vcl._environ(pid)
            if e.get("RANK") == "3" and "TORCHELASTIC_RUN_ID" in e:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return

    with vcl.VirtualCluster(2, prefix=prefix, subnet="10.213.80.0/24") as vc:
        res = vc.run_torchrun([*run, "--out", str(out), "--resume", "auto"], 2, options=["--max-restarts", "3"],
                              env=env, timeout=400, outdir=tmp_path / "vcluster", monitor=kill_rank_3_once)
    assert killed, "found no worker of rank 3 to kill"
    assert res.ok, _failure(res)
    assert "exitcode: -9" in res.ranks[1].stderr.read_text()  # host 1's agent saw it and restarted
    one = tmp_path / "one-host"
    p = run_process([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                     *run, "--out", str(one)], timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert torch.equal(_final_params(out), _final_params(one))
    for rank in range(4):
        lines = (out / f"metrics-rank{rank}.jsonl").read_text().splitlines()
        steps = [json.loads(x)["step"] for x in lines if json.loads(x)["kind"] == "train"]
        assert steps == list(range(1, 41)), (rank, steps)
