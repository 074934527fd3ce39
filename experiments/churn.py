#!/usr/bin/env python3
"""Churn: train with workers SIGKILLed and restarted, against an undisturbed run.

In the virtual cluster of experiments/vcluster.py (network namespaces, one Linux
machine, root needed): W workers on H hosts (worker k on host k mod H), torchft's
Lighthouse on host 0, ``python -m gossip.train --fault-tolerance`` on every worker (see
docs/fault-tolerance.md). Two runs of the same length on the same cluster:

1. undisturbed: every worker runs to the end;
2. churned: every K steps (counted on worker 0, which is never killed) one worker,
   taken in turn from 1 .. W-1, is SIGKILLed, and started again after ``--delay``
   seconds; it rejoins and heals from a live peer. One worker is away at a time: a
   kill waits until the previous restarted worker has healed.

Reported (a table on stdout and JSON with provenance under experiments/results/):
the final test accuracy of both runs; for each kill, how long the survivors took to
step on without the dead worker and how many steps they took without it; the steps the survivors lost (steps missing
from or repeated in the metrics of workers never killed: 0 expected); the steps
discarded (a step a worker died in is retried by all); for each restart the time
from its start to its heal record and the bytes of state it received; and the steps
each killed worker missed while it was away.

    sudo python -m experiments run churn --workers 8 --hosts 4 --steps 1600 --kill-every 320 --delay 3 --timeout 15
    sudo python -m experiments run churn --quick       # 4 workers on 2 hosts, 150 steps
    sudo python -m experiments run churn --algo dpsgd  # a decentralized run: the ring is rebuilt over the live workers
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from experiments.vcluster import VirtualCluster, VClusterError
from experiments import _cli

LIGHTHOUSE_PORT = 29510


def _lighthouse() -> str:
    near = Path(sys.executable).parent / "torchft_lighthouse"
    found = str(near) if near.exists() else shutil.which("torchft_lighthouse")
    if found is None:
        raise SystemExit("churn: torchft_lighthouse not found; pip install 'gossip[ft]'")
    return found


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return out


def _steps(path: Path) -> list[int]:
    return [r["step"] for r in _records(path) if "event" not in r]


def _run(vc: VirtualCluster, args: argparse.Namespace, out: Path, churn: bool) -> dict:
    """One run on the cluster; its figures."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    logs = out / "logs"
    logs.mkdir()
    h0 = vc.hosts[0].addr
    lh_log = open(logs / "lighthouse.log", "w")
    lh = vc.popen(0, [_lighthouse(), "--min_replicas", str(args.min_replicas), "--bind", f"0.0.0.0:{LIGHTHOUSE_PORT}",
                      "--join_timeout_ms", "500", "--heartbeat_timeout_ms", "1000"],
                  stdout=lh_log, stderr=subprocess.STDOUT, torchrun_env=False)
    argv = [sys.executable, "-m", "gossip.train", "--algo", args.algo, "--data", "mnist1d", "--model", args.model,
            "--batch-size", "32", "--lr", str(args.lr), "--epochs", "1000", "--max-steps", str(args.steps),
            "--log-every", "1",
            "--timeout", str(args.timeout), "--device", "cpu", "--fault-tolerance", f"{h0}:{LIGHTHOUSE_PORT}",
            "--min-replicas", str(args.min_replicas), "--out", str(out)]
    # what `python -m experiments verify` witnesses: the training as its simulation of the
    # workers, without torchft's flags (the fault-tolerant path itself is not witnessed)
    from experiments import _provenance

    ft, train = ("--fault-tolerance", "--min-replicas"), argv[3:]
    _provenance.record_config([x for i, x in enumerate(train) if x not in ft and (i == 0 or train[i - 1] not in ft)],
                              ranks=args.workers)

    def start(k: int, tag: str) -> subprocess.Popen:
        host = vc.hosts[k % vc.n]
        env = {"REPLICA_GROUP_ID": str(k), "NUM_REPLICA_GROUPS": str(args.workers), "GOSSIP_FT_HOST": host.addr,
               "GLOO_SOCKET_IFNAME": host.ifname, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
               "RUST_LOG": "warn"}
        return vc.popen(k % vc.n, argv, env=env, stdout=open(logs / f"w{k}-{tag}.log", "w"),
                        stderr=subprocess.STDOUT, torchrun_env=False)

    t0 = time.monotonic()
    procs = {k: start(k, "0") for k in range(args.workers)}
    restarts: list[dict] = []
    kills: list[int] = []  # worker 0's last step when each kill was made
    pending: list[tuple[float, int, int]] = []  # (restart time, worker, step killed at)
    victims = list(range(1, args.workers))
    next_kill, nkill = args.kill_every, 0
    m0 = out / "metrics-rank0.jsonl"
    try:
        while True:
            done = procs[0].poll() is not None
            step0 = max(_steps(m0), default=0)
            # one worker away at a time: the next kill waits until the last restarted worker has
            # healed (with --min-replicas W-1 a second death would rightly stop the group), and
            # none comes so late that its worker could not return before the end
            away = bool(pending) or any(r["heal"] is None for r in restarts)
            if churn and not done and not away and step0 >= next_kill and step0 < args.steps - args.kill_every:
                k = victims[nkill % len(victims)]
                nkill += 1
                next_kill = step0 + args.kill_every
                if procs[k].poll() is None:
                    at = max(_steps(out / f"metrics-rank{k}.jsonl"), default=0)
                    os.killpg(procs[k].pid, signal.SIGKILL)
                    procs[k].wait()
                    pending.append((time.monotonic() + args.delay, k, at))
                    kills.append(step0)
                    print(f"churn: SIGKILL worker {k} at its step {at} (worker 0 at {step0})", flush=True)
            for item in list(pending):
                when, k, at = item
                if time.monotonic() >= when:
                    pending.remove(item)
                    procs[k] = start(k, f"r{len(restarts) + 1}")
                    restarts.append({"worker": k, "killed_at_step": at, "started": time.monotonic(), "heal": None})
            for r in restarts:
                if r["heal"] is None:
                    heals = [h for h in _records(out / f"metrics-rank{r['worker']}.jsonl")
                             if h.get("event") == "heal" and h["from_step"] == 0]
                    if len(heals) >= sum(1 for q in restarts if q["worker"] == r["worker"] and q is not r
                                         and q["heal"] is not None) + 1:
                        r["heal"] = heals[-1]
                        r["time_to_heal_s"] = round(time.monotonic() - r["started"], 2)
            if all(p.poll() is not None for p in procs.values()) and not pending:
                break
            if done and all(p.poll() is not None for k, p in procs.items()
                            if not any(r["worker"] == k and r["heal"] is None for r in restarts)):
                break  # the run ended before a restarted worker rejoined: it is reported, not waited for
            if time.monotonic() - t0 > args.run_timeout:
                raise SystemExit(f"churn: the run did not end within {args.run_timeout} s; logs in {logs}")
            time.sleep(0.05)
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        os.killpg(lh.pid, signal.SIGKILL)
        lh.wait()
        lh_log.close()
    codes = {k: p.returncode for k, p in procs.items()}
    killed = {r["worker"] for r in restarts}
    survivors = [k for k in range(args.workers) if k not in killed]
    lost, healed = {}, {}
    for k in survivors:
        s = _steps(out / f"metrics-rank{k}.jsonl")
        end = max([r["step"] for r in _records(out / f"metrics-rank{k}.jsonl") if r.get("event") == "end"], default=0)
        lost[k] = len(set(range(1, max(end, args.steps) + 1)) - set(s)) + (len(s) - len(set(s)))
        healed[k] = sum(1 for r in _records(out / f"metrics-rank{k}.jsonl") if "healed_from" in r)
    ends = [r for r in _records(m0) if r.get("event") == "end"]
    aborted = {k: ([r.get("aborted_groups") for r in _records(out / f"metrics-rank{k}.jsonl")
                    if r.get("event") == "end"] or [None])[-1] for k in survivors}
    discarded = sum((logs / f).read_text().count("discarded") for f in os.listdir(logs) if f.startswith("w0-"))
    for r in restarts:
        r.pop("started")
        h = r.pop("heal")
        r["healed_at_step"] = h["step"] if h else None
        r["heal_bytes"] = h["bytes"] if h else None
        r["steps_missed"] = (h["step"] - r["killed_at_step"]) if h else None
        r.setdefault("time_to_heal_s", None)
    pauses = _pauses(_records(m0), kills, [r["healed_at_step"] for r in restarts], args.workers)
    return {"exit_codes": codes, "test_acc": ends[-1]["test_acc"] if ends else None,
            "test_loss": ends[-1]["test_loss"] if ends else None, "wall_s": round(time.monotonic() - t0, 1),
            "survivors": survivors, "survivor_steps_lost": lost,
            "survivor_steps_taken_by_healing": healed, "steps_discarded_on_worker0": discarded,
            "aborted_groups": aborted, "pauses": pauses, "restarts": restarts}


def _pauses(records: list[dict], kills: list[int], heals: list[int | None], workers: int) -> list[dict]:
    """For each kill, on worker 0 (never killed): the seconds from its last step before the
    kill to its first step without the dead worker, and the steps it committed without it
    (until the dead worker's heal, or the end of the run)."""
    steps = [r for r in records if "event" not in r and r.get("loss") is not None]
    out = []
    for at, healed in zip(kills, heals):
        before = [r for r in steps if r["step"] <= at]
        fewer = [r for r in steps if r["step"] > at and (healed is None or r["step"] <= healed)
                 and (r.get("participants") or workers) < workers]
        out.append({"worker0_step": at,
                    "resumed_after_s": round(fewer[0]["time"] - before[-1]["time"], 2) if before and fewer else None,
                    "steps_without_it": len(fewer)})
    return out


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run churn``."""
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--steps", type=int, default=1600)
    p.add_argument("--kill-every", type=int, default=320, metavar="K",
                   help="steps between kills (a restarted worker must start and rejoin within them)")
    p.add_argument("--delay", type=float, default=3.0, help="seconds before a killed worker is started again")
    p.add_argument("--min-replicas", type=int, default=None, help="default: workers - 1")
    p.add_argument("--model", default="mlp")
    p.add_argument("--algo", default="allreduce", help="any --algo that runs under --fault-tolerance")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--rate", default=None, help="link rate per host, e.g. 100mbit (default unshaped)")
    p.add_argument("--delay-ms", type=float, default=None, help="one-way link latency in ms")
    p.add_argument("--timeout", type=float, default=15.0,
                   help="gossip.train --timeout: also how long a survivor may wait on a dead peer in a collective")
    p.add_argument("--run-timeout", type=float, default=1800.0)
    p.add_argument("--out", default=None,
                   help="results JSON (default experiments/results/churn-W<w>-H<h>[-<algo>].json)")
    p.add_argument("--work", default="/tmp/gossip-churn", help="run directories")
    p.add_argument("--quick", action="store_true", help="4 workers on 2 hosts, 150 steps, a kill every 50")


def main(argv: list[str] | None = None) -> int:
    p, a = _cli.parse(argv, options, __doc__, "churn")
    if a.quick:
        a.workers, a.hosts, a.steps, a.kill_every = 4, 2, 150, 50
    if a.min_replicas is None:
        a.min_replicas = max(1, a.workers - 1)
    if not 2 <= a.workers or not 1 <= a.hosts <= a.workers or a.kill_every < 1 or a.steps <= a.kill_every:
        p.error("need --workers >= 2, 1 <= --hosts <= --workers and --steps > --kill-every >= 1")
    from experiments import _provenance

    record = _provenance.start(["experiments/churn.py", "gossip"],
                               argv=["experiments/churn.py", *(argv if argv is not None else sys.argv[1:])])
    work = Path(a.work)
    try:
        with VirtualCluster(a.hosts, rate=a.rate, delay=(a.delay_ms / 1000 if a.delay_ms else None),
                            prefix="churn") as vc:
            ref = _run(vc, a, work / "undisturbed", churn=False)
            churned = _run(vc, a, work / "churned", churn=True)
            network = vc.describe()
    except VClusterError as e:
        print(f"churn: {e}", file=sys.stderr)
        return 2
    res = {"network": network, "workers": a.workers, "hosts": a.hosts, "steps": a.steps,
           "kill_every": a.kill_every, "restart_delay_s": a.delay, "min_replicas": a.min_replicas, "algo": a.algo,
           "timeout_s": a.timeout,
           "undisturbed": ref, "churned": churned}
    name = f"churn-W{a.workers}-H{a.hosts}" + ("" if a.algo == "allreduce" else f"-{a.algo}")
    out = Path(a.out) if a.out else REPO / "experiments" / "results" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    _provenance.write(out, res, record)
    print(f"{a.workers} workers on {a.hosts} hosts, {a.steps} steps, a kill every {a.kill_every} steps, "
          f"restart after {a.delay:g} s ({network}); load {record.load_before} -> {record.load_after}")
    print(f"test accuracy: undisturbed {ref['test_acc']}, churned {churned['test_acc']}")
    print(f"steps lost by the survivors: {churned['survivor_steps_lost']} (taken by healing from a peer: "
          f"{churned['survivor_steps_taken_by_healing']}); steps discarded "
          f"(a worker died in them): {churned['steps_discarded_on_worker0']}")
    print("| worker | killed at step | survivors resumed after (s) | steps without it | healed at step | "
          "time to heal (s) | heal bytes |")
    print("|---|---|---|---|---|---|---|")
    for r, pz in zip(churned["restarts"], churned["pauses"]):
        print(f"| {r['worker']} | {r['killed_at_step']} | {pz['resumed_after_s']} | {pz['steps_without_it']} | "
              f"{r['healed_at_step']} | {r['time_to_heal_s']} | {r['heal_bytes']} |")
    print(f"results: {out}")
    unhealed = {r["worker"] for r in churned["restarts"] if r["healed_at_step"] is None}
    ok = all(c == 0 for k, c in churned["exit_codes"].items() if k not in unhealed) and \
        all(v == 0 for v in churned["survivor_steps_lost"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
