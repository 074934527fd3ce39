"""``--fault-tolerance``: workers die and rejoin while the others keep stepping (torchft).

Real processes: torchft's Lighthouse on localhost and ``python -m gossip.train`` workers,
one torchft replica group each, over gloo. The workers are forked from one process that
has imported gossip's CLI (``tests/_ftzygote.py``), so that starting one costs a fork,
not an import of torch; each then runs the CLI's ``main`` as ``python -m gossip.train``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchft", reason="the [ft] extra (torchft) is part of the dev install")

from gossip.train.config import ConfigError, parse_args  # noqa: E402

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--algo", "allreduce", "--data", "mnist1d", "--model", "mlp", "--batch-size", "32", "--lr", "0.05",
        "--epochs", "50", "--log-every", "1", "--timeout", "60", "--device", "cpu"]


def _lighthouse_binary() -> str:
    near = Path(sys.executable).parent / "torchft_lighthouse"
    found = str(near) if near.exists() else shutil.which("torchft_lighthouse")
    if found is None:
        pytest.fail("torchft_lighthouse is not installed next to this Python (pip install 'gossip[ft]')")
    return found


def _env(replica: int | None = None, replicas: int = 4) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GOSSIP_FT_HOST": "localhost"}
    env.pop("RUST_LOG", None)  # torchft's own log is quiet by default (--ft-verbose turns it on)
    if replica is not None:
        env.update(REPLICA_GROUP_ID=str(replica), NUM_REPLICA_GROUPS=str(replicas))
    return env


class _Lighthouse:
    """torchft's Lighthouse on a free localhost port, with the flags of torchft's
    ``torchft_lighthouse`` (started by ``tests/_ftlighthouse.py``, which loads its
    extension without importing torch); :meth:`kill` and :meth:`start` again on the same
    port, as an operator would restart it."""

    def __init__(self, min_replicas: int, tmp: Path) -> None:
        _lighthouse_binary()  # installed with torchft, as the docs start it
        with socket.socket() as s:
            s.bind(("localhost", 0))
            self.port = s.getsockname()[1]
        self.min_replicas, self.log = min_replicas, open(tmp / "lighthouse.log", "w")
        self.addr = f"localhost:{self.port}"
        self.start()

    def start(self) -> None:
        """Start it (again) on its port; return once it listens."""
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "_ftlighthouse.py"), "--min_replicas", str(self.min_replicas),
             "--bind", f"[::]:{self.port}", "--join_timeout_ms", "5000", "--heartbeat_timeout_ms", "1000",
             "--quorum_tick_ms", "50"], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("localhost", self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
        self.close()
        pytest.fail("the Lighthouse did not start listening within 60 s")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        self.kill()
        self.log.close()


class _Worker:
    """A worker forked by the zygote (``tests/_ftzygote.py``): what the tests ask of a
    :class:`subprocess.Popen` (its exit code comes through a file, once the zygote has
    reaped it)."""

    def __init__(self, pid: int, rc: Path) -> None:
        self.pid, self.rc, self.returncode = pid, rc, None

    def poll(self) -> int | None:
        if self.returncode is None and self.rc.exists():
            self.returncode = int(self.rc.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not reaped yet: the pid is still this worker's
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Zygote:
    """``tests/_ftzygote.py``: gossip's CLI imported once, a forked worker per :meth:`start`
    (a worker starts in a fraction of a second instead of importing torch again)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "_ftzygote.py")], env=_env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT)
        self.count = 0

    def start(self, argv: list[str], env: dict, cwd: Path, out: Path, err: Path | None = None) -> _Worker:
        """``python -m gossip.train ARGV`` in ``cwd`` with ``env``: stdout to ``out``, stderr
        to ``err`` (or ``out``)."""
        self.count += 1
        rc = Path(out).parent / f".{Path(out).name}.rc{self.count}"
        req = {"argv": [str(a) for a in argv], "env": env, "cwd": str(cwd), "out": str(out),
               "err": None if err is None else str(err), "rc": str(rc)}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer.strip():
            pytest.fail(f"the zygote (tests/_ftzygote.py) stopped with {self.proc.wait()}")
        return _Worker(int(answer), rc)

    def close(self) -> None:
        """Stop it (its workers are on their own: each test stops its own)."""
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


_ZYGOTE: list[_Zygote] = []


@pytest.fixture(scope="module", autouse=True)
def _zygote_closed():
    yield
    while _ZYGOTE:
        _ZYGOTE.pop().close()


def _fork(argv: list[str], env: dict, cwd: Path, out: Path, err: Path | None = None) -> _Worker:
    if not _ZYGOTE:
        _ZYGOTE.append(_Zygote())
    return _ZYGOTE[0].start(argv, env, cwd, out, err)


def _start(replica: int, argv: list[str], tmp: Path, name: str, slow: Path | None = None,
           replicas: int = 4) -> _Worker:
    """Replica ``replica`` of ``replicas``: stdout and stderr to ``tmp/<name>.log``."""
    env = _env(replica, replicas)
    if slow is not None:
        env["GOSSIP_TEST_SLOW"] = str(slow)
    return _fork(argv, env, tmp, tmp / f"{name}.log")


def _run(argv: list[str], env: dict, tmp: Path, name: str, timeout: float = 300) -> tuple[int, str, str]:
    """``python -m gossip.train ARGV`` to its end: exit code, stdout, stderr."""
    out, err = tmp / f"{name}.out", tmp / f"{name}.err"
    code = _fork(argv, env, tmp, out, err).wait(timeout=timeout)
    return code, out.read_text(), err.read_text()


def _steps(records: list[dict]) -> list[dict]:
    """The step records (not the events: quorum, heal, topology, eval, end)."""
    return [r for r in records if "event" not in r]


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _last_step(path: Path) -> int:
    steps = [r["step"] for r in _steps(_records(path))]
    return max(steps, default=0)


def _last_participants(path: Path) -> int | None:
    steps = [r for r in _steps(_records(path)) if r.get("participants") is not None]
    return steps[-1]["participants"] if steps else None


def _wait(cond, what: str, procs: list[_Worker], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        for p in procs:
            if p.poll() not in (None, 0):
                pytest.fail(f"a worker exited with {p.returncode} while waiting for {what}")
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


def _standing_still(paths: list[Path], quiet_s: float = 1.5):
    """A condition for :func:`_wait`: no new step in any of the metrics files ``paths`` for
    ``quiet_s`` seconds (from the first poll on)."""
    seen: dict[str, Any] = {"steps": None, "since": time.monotonic()}

    def cond() -> bool:
        now = [_last_step(p) for p in paths]
        if now != seen["steps"]:
            seen["steps"], seen["since"] = now, time.monotonic()
        return time.monotonic() - seen["since"] >= quiet_s

    return cond


def _stop(procs: list[_Worker], lighthouse: _Lighthouse | None = None) -> None:
    """Teardown: every worker still running killed (and reaped), then the Lighthouse."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    if lighthouse is not None:
        lighthouse.close()


def _churn(tmp: Path, algo: list[str], steps: int, kill_at: int = 15) -> dict:
    """Four workers; replica 3 is SIGKILLed at step ``kill_at`` and, once the survivors
    have stepped on without it, started again; the run goes on to ``steps``.

    The survivors are slowed down (``tests._ftmodel``) from the restart until the
    restarted worker has healed, so the run cannot end before the rejoin however loaded
    the machine is; nothing waits for a step count it does not control.
    """
    lh = _Lighthouse(min_replicas=3, tmp=tmp)
    procs: list[_Worker] = []
    slow, out = tmp / "slow", tmp / "churn"
    try:
        argv = [*ARGS, *algo, "--model", "tests._ftmodel:mlp", "--fault-tolerance", lh.addr, "--min-replicas", "3",
                "--max-steps", str(steps), "--out", str(out)]
        procs = [_start(k, argv, tmp, f"w{k}", slow=slow) for k in range(4)]
        m = [out / f"metrics-rank{k}.jsonl" for k in range(4)]
        _wait(lambda: _last_step(m[3]) >= kill_at, f"replica 3 to reach step {kill_at}", procs)
        procs[3].send_signal(signal.SIGKILL)
        procs[3].wait()
        killed_at = _last_step(m[3])
        # the survivors keep stepping without any restart, averaging over the three of them
        _wait(lambda: all(_last_participants(m[k]) == 3 for k in range(3)),
              "the survivors to step on without replica 3", procs[:3])
        assert all(p.poll() is None for p in procs[:3]), "a survivor stopped"
        slow.touch()
        spare = _start(3, argv, tmp, "w3-restarted", slow=slow)  # restart replica 3
        procs.append(spare)
        _wait(lambda: any(r.get("event") == "heal" for r in _records(m[3])), "replica 3 to heal", [spare, *procs[:3]])
        slow.unlink()
        for p in procs[:3] + [spare]:
            assert p.wait(timeout=300) == 0, (tmp / "w0.log").read_text()[-3000:]
    finally:
        _stop(procs, lh)
    records = {k: _records(m[k]) for k in range(4)}
    for k in range(3):  # every survivor's metrics show each step exactly once
        done = [r["step"] for r in _steps(records[k])]
        assert done == list(range(1, steps + 1)), f"replica {k}: steps {done[:5]}...{done[-5:]}"
        quorum = [r for r in records[k] if r.get("event") == "quorum"]
        assert [r["left"] for r in quorum if r["left"] and r["step"] > 0] == [[3]], quorum  # nobody else left
        assert [r["joined"] for r in quorum if r["joined"] and r["step"] > 0] == [[3]], quorum
        assert [r for r in records[k] if r.get("event") == "end"][-1]["step"] == steps
    # the restarted replica healed from a live peer (not from disk) and continued from the group's step
    heals = [r for r in records[3] if r.get("event") == "heal"]
    assert len(heals) == 1 and heals[0]["source"] in (0, 1, 2) and heals[0]["bytes"] > 0, heals
    heal = heals[0]
    assert heal["step"] > killed_at
    done3 = [r["step"] for r in _steps(records[3])]
    assert done3 == list(range(1, killed_at + 1)) + list(range(heal["step"] + 1, steps + 1))
    log = (tmp / "w0.log").read_text()
    assert re.search(r"quorum at step \d+: 3 replicas \[0, 1, 2\] \(left: \[3\]; joined: none\)", log), log[-2000:]
    # the survivors kept stepping while replica 3 was away: steps averaged over 3 participants
    between = [r for r in _steps(records[0]) if killed_at < r["step"] <= heal["step"] and r["loss"] is not None]
    # a step or two may still have completed with all 4 before the death was seen (the kill
    # lands between steps at an arbitrary point); from the first 3-participant step on, every
    # step until the heal is averaged over the 3 survivors
    first3 = next((i for i, r in enumerate(between) if r["participants"] == 3), len(between))
    assert all(r["participants"] == 4 for r in between[:first3]) and first3 <= 3, between[:5]
    between = between[first3:]
    assert between and all(r["participants"] == 3 for r in between), between[:3]
    params = [torch.load(out / f"model-replica{k}.pt")["params"] for k in range(4)]
    return {"records": records, "heal": heal, "killed_at": killed_at, "params": params, "log": log}


def _consensus(params: list[torch.Tensor]) -> float:
    """max_i ||x_i - xbar|| / ||xbar||."""
    X = torch.stack(params).double()
    xbar = X.mean(0)
    return float((X - xbar).norm(dim=1).max() / xbar.norm())


def test_kill_one_worker_the_others_keep_stepping_and_it_heals_from_a_peer(tmp_path: Path) -> None:
    """Centralized, with state that must stay consistent: PowerSGD's shared Q (warm start)
    comes from the peer, its own error memory restarts at zero."""
    steps = 300
    algo = ["--algo", "powersgd"]
    # the undisturbed run (below), started at once: it needs nothing of the churned one
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    ref = _fork([*ARGS, *algo, "--model", "tests._ftmodel:mlp", "--simulate", "4", "--max-steps", str(steps),
                 "--no-progress", "--out", str(ref_dir / "run")], _env(), ref_dir, ref_dir / "out.log",
                ref_dir / "err.log")
    got = _churn(tmp_path, algo, steps)
    assert got["heal"]["reset"] == ["error"], got["heal"]
    assert "its own error started at zero" in (tmp_path / "w3-restarted.log").read_text()
    # every replica ends with the same model: the all-reduce kept them identical after the heal
    for k in range(1, 4):
        assert torch.equal(got["params"][0], got["params"][k])
    # against an undisturbed run of the same length (the same 4 nodes, shards and seed in one
    # process): the same test accuracy within 5 points. The churned run averaged 3 gradients
    # instead of 4 while replica 3 was away and restarted its error memory; MNIST-1D runs that
    # differ only in their seed differ by about 2 points at this length.
    assert ref.wait(timeout=300) == 0, (ref_dir / "err.log").read_text()[-2000:]
    ref_acc = json.loads((ref_dir / "run" / "summary.json").read_text())["final_test_acc"]
    end = [r for r in got["records"][0] if r.get("event") == "end"][-1]
    assert abs(end["test_acc"] - ref_acc) <= 0.05, (end, ref_acc)


@pytest.mark.parametrize("algo", [["--algo", "dpsgd"], ["--algo", "ecd", "--bits", "8"]], ids=["dpsgd", "ecd"])
def test_decentralized_rebuilds_the_ring_over_the_survivors_and_after_the_rejoin(tmp_path: Path,
                                                                                  algo: list[str]) -> None:
    steps = 150
    got = _churn(tmp_path, algo, steps)
    for k in range(3):
        topo = [r for r in got["records"][k] if r.get("event") == "topology"]
        # the ring over 4, over the 3 survivors, and over 4 again after the rejoin (rebuilt
        # also after a discarded step: the re-formed group is a new quorum)
        assert [r["replicas"] for r in topo][0] == [0, 1, 2, 3], topo
        assert [0, 1, 2] in [r["replicas"] for r in topo] and topo[-1]["replicas"] == [0, 1, 2, 3], topo
        assert all(r["topology"] == "ring" and r["fallback"] is None for r in topo), topo
        three = next(r for r in topo if r["replicas"] == [0, 1, 2])
        assert three["spectral_gap"] == pytest.approx(1.0)  # a ring of 3 with 1/3 weights is complete
        if algo[1] == "ecd":  # the estimates of the new neighbours, re-established in full precision
            assert all(r["setup_bytes_sent"] > 0 for r in topo), topo
    assert re.search(r"topology at step \d+: ring over replicas \[0, 1, 2\], spectral gap 1", got["log"])
    # after the rejoin the four models mix again: bounded consensus distance at the end
    assert _consensus(got["params"]) < 0.05, _consensus(got["params"])


def _torchrun_group(replica: int, replicas: int, argv: list[str], tmp: Path, name: str,
                    slow: Path | None = None) -> subprocess.Popen:
    """Replica group ``replica``: one torchrun launch of 2 processes (its members), as a
    user starts one per host; stdout and stderr to ``tmp/<name>.log``."""
    env = _env(replica, replicas)
    if slow is not None:
        env["GOSSIP_TEST_SLOW"] = str(slow)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    log = open(tmp / f"{name}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "--master_addr", "localhost", "--master_port", str(port), "-m", "gossip.train", *argv],
                            env=env, cwd=tmp, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _member_pid(launcher: subprocess.Popen, member: int) -> int:
    """The pid of the worker of torchrun ``launcher`` that is ``member`` (its RANK)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) != launcher.pid:
                continue
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if env.get("RANK") == str(member):
            return int(d.name)
    pytest.fail(f"no worker of RANK {member} under torchrun {launcher.pid}")


def _end_groups(procs: list[subprocess.Popen], lh: "_Lighthouse") -> None:
    """Kill what is left of the replica groups' torchrun launches, then the Lighthouse."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    lh.close()


def test_replica_groups_of_a_gradient_algorithm_train_what_the_simulation_of_the_groups_trains(tmp_path: Path) -> None:
    """2 replica groups of 2 running a gradient algorithm (efsgd, 8-bit, with its error
    feedback): the gradients averaged inside each group once, then exchanged between the
    groups over torchft; each group's loss equals the simulated groups' step by step."""
    steps = 12
    lh = _Lighthouse(min_replicas=2, tmp=tmp_path)
    out, ref_dir = tmp_path / "run", tmp_path / "ref"
    argv = [*ARGS, "--algo", "efsgd", "--bits", "8", "--algo-opt", "exchange=allgather", "--model",
            "tests._ftmodel:mlp", "--fault-tolerance", lh.addr, "--min-replicas", "2", "--group-size", "2",
            "--timeout", "10", "--max-steps", str(steps), "--no-progress", "--out", str(out)]
    ref_dir.mkdir()
    ref = _fork([*argv[:argv.index("--fault-tolerance")], "--simulate", "4", "--group-size", "2", "--max-steps",
                 str(steps), "--no-progress", "--out", str(ref_dir / "run")], _env(), ref_dir, ref_dir / "out.log",
                ref_dir / "err.log")
    procs: list[subprocess.Popen] = []
    try:
        procs = [_torchrun_group(k, 2, argv, tmp_path, f"g{k}") for k in range(2)]
        for k, p in enumerate(procs):
            assert p.wait(timeout=300) == 0, (tmp_path / f"g{k}.log").read_text()[-3000:]
    finally:
        _end_groups(procs, lh)
    assert ref.wait(timeout=120) == 0, (ref_dir / "err.log").read_text()[-2000:]
    for k in range(2):
        want = [r["loss"] for r in _records(ref_dir / "run" / f"metrics-rank{k}.jsonl") if r.get("kind") == "train"]
        rows = [_steps(_records(out / f"metrics-rank{2 * k + j}.jsonl")) for j in range(2)]
        got = [(a["loss"] + b["loss"]) / 2 for a, b in zip(*rows)]
        assert len(want) == len(got) == steps and got == pytest.approx(want, rel=1e-5), (got, want)


def test_replica_groups_a_killed_member_takes_its_group_out_and_the_group_heals_on_restart(tmp_path: Path) -> None:
    """2 replica groups of 2 (``--group-size 2``: DDP-style averaging inside a group, diloco
    sharded between the groups over torchft). Member 1 of group 1 is SIGKILLed: its torchrun
    launch ends the group, the Lighthouse drops it and group 0 steps on alone; the group
    started again heals member by member (each member's slice of the outer state from
    the same member of group 0) and the run ends with one model."""
    steps, h = 300, 5
    lh = _Lighthouse(min_replicas=1, tmp=tmp_path)
    slow, out = tmp_path / "slow", tmp_path / "run"
    argv = [*ARGS, "--algo", "diloco", "--algo-opt", f"local_steps={h}", "--model", "tests._ftmodel:mlp",
            "--fault-tolerance", lh.addr, "--min-replicas", "1", "--group-size", "2", "--timeout", "10",
            "--max-steps", str(steps), "--no-progress", "--out", str(out)]
    procs: list[subprocess.Popen] = []
    m = [out / f"metrics-rank{n}.jsonl" for n in range(4)]  # node k * 2 + member
    # the same groups in one process (--simulate 4 --group-size 2) for the steps before the kill
    ref_dir, early = tmp_path / "ref", 12
    ref_dir.mkdir()
    ref = _fork([*argv[:argv.index("--fault-tolerance")], "--simulate", "4", "--group-size", "2", "--max-steps",
                 str(early), "--no-progress", "--out", str(ref_dir / "run")], _env(), ref_dir, ref_dir / "out.log",
                ref_dir / "err.log")
    try:
        procs = [_torchrun_group(k, 2, argv, tmp_path, f"g{k}", slow=slow) for k in range(2)]
        _wait(lambda: _last_step(m[3]) >= 15, "group 1 to reach step 15", procs)
        victim = _member_pid(procs[1], 1)
        slow.touch()  # group 0 slowed down until group 1 has healed: the run cannot end before the rejoin
        os.kill(victim, signal.SIGKILL)
        # torchrun ends the group when a member dies (a member blocked in torchft's commit vote
        # on the dead one leaves when that call returns: within --timeout)
        assert procs[1].wait(timeout=120) != 0
        killed_at = max(_last_step(m[2]), _last_step(m[3]))
        _wait(lambda: all(_last_participants(m[n]) == 1 for n in (0, 1)), "group 0 to step on alone", procs[:1])
        procs.append(_torchrun_group(1, 2, argv, tmp_path, "g1-restarted", slow=slow))
        _wait(lambda: all(any(r.get("event") == "heal" for r in _records(m[n])) for n in (2, 3)),
              "both members of group 1 to heal", [procs[0], procs[2]])
        slow.unlink()
        for p in (procs[0], procs[2]):
            assert p.wait(timeout=300) == 0, (tmp_path / "g0.log").read_text()[-3000:]
    finally:
        _end_groups(procs, lh)
    records = {n: _records(m[n]) for n in range(4)}
    log0 = (tmp_path / "g0.log").read_text()
    # with both groups alive the replica groups train what the simulation of the groups trains:
    # each group's loss (its members' mean) step by step
    assert ref.wait(timeout=120) == 0, (ref_dir / "err.log").read_text()[-2000:]
    for k in range(2):
        want = [r["loss"] for r in _records(ref_dir / "run" / f"metrics-rank{k}.jsonl") if r.get("kind") == "train"]
        rows = [[r for r in _steps(records[2 * k + j]) if r["step"] <= early] for j in range(2)]
        assert all(r["participants"] == 2 for row in rows for r in row)
        got = [(a["loss"] + b["loss"]) / 2 for a, b in zip(*rows)]
        assert len(want) == len(got) == early and got == pytest.approx(want, rel=1e-5), (got, want)
    for n in (0, 1):  # both members of group 0: every step once, alone between the death and the heal
        done = [r["step"] for r in _steps(records[n])]
        assert done == list(range(1, steps + 1)), f"node {n}: steps {done[:5]}...{done[-5:]}"
        quorum = [r for r in records[n] if r.get("event") == "quorum" and r["step"] > 0]
        assert [r["left"] for r in quorum if r["left"]] == [[1]], quorum
        assert [r["joined"] for r in quorum if r["joined"]] == [[1]], quorum
        assert 1 in [r["participants"] for r in _steps(records[n]) if r["step"] > killed_at], records[n][-5:]
    assert re.search(r"\[replica 0 member 1\] quorum at step \d+: 1 replicas \[0\] \(left: \[1\]", log0), log0[-2000:]
    restarted = (tmp_path / "g1-restarted.log").read_text()
    for n, member in ((2, 0), (3, 1)):  # each member healed from replica 0, past the step it died at
        heals = [r for r in records[n] if r.get("event") == "heal"]
        assert len(heals) == 1 and heals[0]["source"] == 0 and heals[0]["bytes"] > 0, heals
        assert heals[0]["step"] > killed_at
        assert f"[replica 1 member {member}] healed from replica 0" in restarted, restarted[-2000:]
    # diloco's last outer step (steps is a multiple of H) leaves every replica group with one model
    params = [torch.load(out / f"model-replica{k}.pt")["params"] for k in range(2)]
    assert torch.equal(params[0], params[1])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["group_size"] == 2 and summary["fault_tolerance"]["replica_group_size"] == 2
    assert summary["bytes_by_level"]["intra"] > 0 and summary["bytes_by_level"]["inter"] > 0


@pytest.mark.parametrize("value, match", [
    ("nohost", r"--fault-tolerance must be the Lighthouse's HOST:PORT"),
    ("localhost:notaport", r"--fault-tolerance must be the Lighthouse's HOST:PORT"),
    ("ftp://h:1", r"--fault-tolerance must be the Lighthouse's HOST:PORT"),
])
def test_bad_lighthouse_address_is_refused(value: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_args(["--fault-tolerance", value])


def test_min_replicas_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"--min-replicas must be a positive integer, got 0"):
        parse_args(["--fault-tolerance", "localhost:1", "--min-replicas", "0"])


def test_unsupported_algorithms_and_bad_settings_are_one_line_before_anything_connects(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    from gossip.errors import RunError
    from gossip.train import run

    # the rules across flags are the config's: refused as the flags are read
    with pytest.raises(ConfigError, match=r"--fault-tolerance supports --algo allreduce, dpsgd, .*choco, efsgd, "
                                          r".*powersgd, .*sketched, .*diloco, got --algo sgp"):
        parse_args(["--algo", "sgp", "--fault-tolerance", "localhost:1", "--out", str(tmp_path)])
    with pytest.raises(ConfigError, match=r"--algo ecd is decentralized: --min-replicas must be at least 2 .*got 1"):
        parse_args(["--algo", "ecd", "--fault-tolerance", "localhost:1", "--min-replicas", "1", "--out", str(tmp_path)])
    with pytest.raises(ConfigError, match=r"--fault-tolerance runs one worker per process: do not combine it with "
                                          r"--simulate"):
        parse_args(["--algo", "allreduce", "--fault-tolerance", "localhost:1", "--simulate", "2", "--out", str(tmp_path)])
    with pytest.raises(ConfigError, match=r"--fault-tolerance needs --out DIR"):
        parse_args(["--algo", "allreduce", "--fault-tolerance", "localhost:1"])
    # the environment's, by the run
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    cfg = parse_args(["--algo", "allreduce", "--fault-tolerance", "localhost:1", "--out", str(tmp_path)])
    with pytest.raises(RunError, match=r"set REPLICA_GROUP_ID=K and NUM_REPLICA_GROUPS=N"):
        run(cfg)
    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "4")
    cfg = parse_args(["--algo", "allreduce", "--fault-tolerance", "localhost:1", "--min-replicas", "5",
                      "--out", str(tmp_path)])
    with pytest.raises(RunError, match=r"--min-replicas 5 exceeds the 4 replicas of NUM_REPLICA_GROUPS"):
        run(cfg)
    # a replica group is one torchrun launch: --group-size must be its number of processes
    monkeypatch.delenv("RANK", raising=False)
    cfg = parse_args(["--algo", "allreduce", "--fault-tolerance", "localhost:1", "--group-size", "2",
                      "--out", str(tmp_path)])
    with pytest.raises(RunError, match=r"--group-size 2: a replica group is one torchrun launch of G processes "
                                       r"\(its members\), and this one has 1 \(WORLD_SIZE\); launch each replica "
                                       r"group with `torchrun --nproc_per_node 2`"):
        run(cfg)
    # shards owned by rank cannot follow the quorum: refused before the Lighthouse is even looked for
    # (nothing listens at localhost:1)
    cfg = parse_args(["--algo", "efsgd", "--compressor", "sign", "--fault-tolerance", "localhost:1",
                      "--max-steps", "1", "--out", str(tmp_path)])
    with pytest.raises(RunError, match=r"uses the sharded exchange, .* add --algo-opt exchange=allgather"):
        run(cfg)


def test_the_topology_over_the_live_replicas_falls_back_to_a_ring_and_says_why() -> None:
    import topologies
    from gossip.train.fault_tolerance import live_topology

    ft = ["--fault-tolerance", "localhost:1", "--min-replicas", "2", "--out", "run"]
    cfg = parse_args(["--algo", "dpsgd", "--topology", "torus", *ft])
    topo, why = live_topology(cfg, 9)
    assert topo.name == "torus" and why is None
    topo, why = live_topology(cfg, 7)  # a torus of 7 cannot be built
    assert topo.name == "ring" and topo.n == 7
    assert re.fullmatch(r"--topology torus with world size 7: .*; falling back to ring", why), why
    topo, why = live_topology(parse_args(["--algo", "dpsgd", *ft]), 2)
    assert topo.name == "complete" and "falling back to complete" in why
    # an expander is re-drawn with the run's seed over the live count: every survivor draws the same graph
    cfg = parse_args(["--algo", "dpsgd", "--topology", "expander", "--degree", "3", "--seed", "5", *ft])
    a, b = live_topology(cfg, 6)[0], live_topology(cfg, 6)[0]
    assert a.n == 6 and (a.to_dense() == b.to_dense()).all()
    assert (a.to_dense() == topologies.build("expander", 6, degree=3, seed=5).to_dense()).all()


class _Manager:
    """What FTCommunicator asks of a torchft Manager."""

    def __init__(self) -> None:
        self.error: Exception | None = None

    def errored(self) -> Exception | None:
        return self.error

    def report_error(self, e: Exception) -> None:
        self.error = e


class _DeadPeerGroup:
    """A process group whose peer died: every collective fails when waited on."""

    aborted = 0

    def allreduce(self, tensors, opts):
        return self

    def wait(self, timeout=None):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234")

    def abort(self) -> None:
        self.aborted += 1


def test_a_failed_collective_is_reported_and_aborts_the_group_so_every_peer_leaves_it() -> None:
    from gossip.train.fault_tolerance import FTCommunicator

    manager, pg = _Manager(), _DeadPeerGroup()
    comm = FTCommunicator(manager, pg, replica=2, replicas=4, timeout=5)
    comm.reconfigure([0, 2, 3], None)
    assert (comm.rank, comm.world_size) == (1, 3)
    X = torch.ones(1, 5)
    Y = comm.all_reduce(X, op="mean")  # the peer's failure does not raise: the step is discarded
    assert Y.shape == X.shape and pg.aborted == 1 and comm.aborts == 1
    assert re.match(r"all_reduce: .*Connection closed by peer", str(manager.errored()))
    # later operations of the failed step post nothing and return the replica's own values
    assert torch.equal(comm.all_gather(X), X.expand(3, 5)) and pg.aborted == 1
    # the ledger counts by replica id, whatever the member's rank in the quorum
    assert comm.run_ledger.nodes == (2,)
    sent = comm.run_ledger.bytes_sent
    manager.error = None
    comm.reconfigure([1, 2], None)
    comm.all_reduce(X)
    assert comm.run_ledger.bytes_sent > sent
    with pytest.raises(ValueError, match=r"replica 2 is not among the quorum's members \[0, 1\]"):
        comm.reconfigure([0, 1], None)


def test_lighthouse_address_is_normalised_and_incarnations_are_told_apart() -> None:
    from gossip.train.fault_tolerance import _incarnations, lighthouse_address

    assert lighthouse_address("lh:29510") == "http://lh:29510"
    assert lighthouse_address("http://10.0.0.1:29510/") == "http://10.0.0.1:29510"
    # a restarted worker keeps its number and gets a new uuid from torchft
    assert _incarnations(["gossip_3:b", "gossip_0:a", "gossip_12:c"]) == [(0, "a"), (3, "b"), (12, "c")]
    # zero-padded names: torchft ranks a quorum's replicas by name, which is then their number
    from gossip.train.fault_tolerance import _replica_name

    names = [_replica_name(k) for k in (12, 3, 100, 0)]
    assert [k for k, _ in _incarnations(sorted(n + ":u" for n in names))] == [0, 3, 12, 100]
    assert _incarnations(["gossip_3:b"]) != _incarnations(["gossip_3:d"])


class _Mailbox:
    """Point-to-point sends between in-process ranks (one thread each): a stand-in for the
    quorum's gloo group, to check the neighbour exchange against the simulation."""

    def __init__(self) -> None:
        import threading

        self.box: dict[tuple, list[torch.Tensor]] = {}  # in order, as gloo delivers per pair and tag
        self.cond = threading.Condition()

    def group(self, rank: int) -> Any:
        box = self

        class _Work:
            def __init__(self, fn=None) -> None:
                self.fn = fn

            def wait(self, timeout=None) -> bool:
                if self.fn is not None:
                    self.fn()
                return True

            def is_completed(self) -> bool:
                return self.fn is None

        class _Group:
            def send(self, tensors, dst, tag):
                with box.cond:
                    box.box.setdefault((rank, dst, tag), []).append(tensors[0].clone())
                    box.cond.notify_all()
                return _Work()

            def recv(self, tensors, src, tag):
                def take() -> None:
                    with box.cond:
                        box.cond.wait_for(lambda: box.box.get((src, rank, tag)), timeout=30)
                        tensors[0].copy_(box.box[(src, rank, tag)].pop(0))
                return _Work(take)

        return _Group()


@pytest.mark.parametrize("algo, topology, opts", [
    ("dpsgd", "onepeer-exp", {}),  # a time-varying graph over the live set
    ("ecd", "ring", {"compressor": "quant:bits=8"}),
    ("choco", "ring", {"compressor": "topk:p=0.5", "gamma": 0.5}),
])
def test_the_neighbour_exchange_over_the_quorum_gives_the_simulations_numbers(algo, topology, opts) -> None:
    """Three live replicas (ids 0, 2, 5 of 6) on a graph rebuilt over them: the same
    models as the in-process simulation of three nodes, step for step."""
    import threading

    import topologies
    from gossip import algorithms
    from gossip.comm.simulated import SimulatedCommunicator
    from gossip.train.fault_tolerance import FTCommunicator

    n, d, steps = 3, 10, 4
    topo = topologies.build(topology, n)
    gen = torch.Generator().manual_seed(0)
    X0 = torch.randn(n, d, generator=gen)
    U = [torch.randn(n, d, generator=gen) * 0.1 for _ in range(steps)]
    sim = algorithms.build(algo, SimulatedCommunicator(topo), seed=3, **opts)
    Xs = X0.clone()
    sim.setup(Xs)
    for t in range(steps):
        sim.step(Xs, U[t])
    mail, members, out = _Mailbox(), [0, 2, 5], {}

    def node(i: int) -> None:
        comm = FTCommunicator(_Manager(), mail.group(i), replica=members[i], replicas=6, timeout=30)
        comm.reconfigure(members, topo)
        a = algorithms.build(algo, comm, seed=3, **opts)
        X = X0[i:i + 1].clone()
        with comm.ledger.setup():
            a.setup(X)
        for t in range(steps):
            a.step(X, U[t][i:i + 1])
        out[i] = (X, comm.run_ledger)

    threads = [threading.Thread(target=node, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    for i in range(n):
        torch.testing.assert_close(out[i][0][0], Xs[i], rtol=0, atol=1e-6)
        ledger = out[i][1]
        assert ledger.nodes == (members[i],) and ledger.bytes_sent > 0  # counted under the replica's id


class _Collectives:
    """All-reduce and all-gather between in-process ranks (one thread each)."""

    def __init__(self, n: int) -> None:
        import threading

        self.n, self.barrier, self.slots = n, threading.Barrier(n, timeout=30), [None] * n

    def group(self, rank: int) -> Any:
        box = self

        class _Done:
            def wait(self, timeout=None) -> bool:
                return True

            def is_completed(self) -> bool:
                return True

        def exchange(t: torch.Tensor) -> list[torch.Tensor]:
            box.barrier.wait()
            box.slots[rank] = t.clone()
            box.barrier.wait()
            got = list(box.slots)
            box.barrier.wait()
            return got

        class _Group:
            def allreduce(self, tensors, opts):
                got = exchange(tensors[0])
                tensors[0].copy_(torch.stack(got).sum(0))
                return _Done()

            def allgather(self, outs, inputs, opts):
                for o, g in zip(outs[0], exchange(inputs[0])):
                    o.copy_(g)
                return _Done()

        return _Group()


@pytest.mark.parametrize("algo, opts", [
    ("efsgd", {"compressor": "sign", "exchange": "allgather"}),
    ("powersgd", {}),
    ("sketched", {}),
    ("localtopk", {}),
])
def test_the_centralized_exchanges_over_the_quorum_give_the_simulations_numbers(algo, opts) -> None:
    """Three live replicas (ids 1, 3, 4 of 5): all-reduces averaged over the three and
    all-gathers of their rows give the in-process simulation's directions, step for step,
    error memories and PowerSGD's Q included."""
    import threading

    from gossip import algorithms
    from gossip.comm.simulated import SimulatedCommunicator

    n, d, steps = 3, 64, 3
    gen = torch.Generator().manual_seed(1)
    X0 = torch.randn(1, d, generator=gen).expand(n, d).clone()
    G = [torch.randn(n, d, generator=gen) for _ in range(steps)]
    layout = algorithms.base.ParamLayout.from_shapes([(8, 8)])
    sim = algorithms.build(algo, SimulatedCommunicator(None, world_size=n), seed=3, **opts)
    sim.setup(X0.clone(), layout)
    want = []
    for t in range(steps):
        g = G[t].clone()
        sim.set_lr(0.1)
        sim.reduce_gradients(g)
        want.append(g)
    coll, members, got = _Collectives(n), [1, 3, 4], {}

    def node(i: int) -> None:
        from gossip.train.fault_tolerance import FTCommunicator

        comm = FTCommunicator(_Manager(), coll.group(i), replica=members[i], replicas=5, timeout=30)
        comm.reconfigure(members, None)
        a = algorithms.build(algo, comm, seed=3, **opts)
        a.setup(X0[i:i + 1].clone(), layout)
        got[i] = []
        for t in range(steps):
            g = G[t][i:i + 1].clone()
            a.set_lr(0.1)
            a.reduce_gradients(g)
            got[i].append(g)

    threads = [threading.Thread(target=node, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    for i in range(n):
        for t in range(steps):
            torch.testing.assert_close(got[i][t][0], want[t][i], rtol=1e-5, atol=1e-6)


class _Writes:
    """A stream that keeps each write apart, as an unbuffered stderr sends each one."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def write(self, s: str) -> int:
        self.calls.append(s)
        return len(s)

    def flush(self) -> None:
        pass


def test_each_replicas_line_reaches_stderr_in_one_write(monkeypatch):
    # the replicas share one stderr; print() would write the text and its newline apart
    # under python -u, and another replica's line could land between the two
    from types import SimpleNamespace

    from gossip.train.fault_tolerance import FaultTolerantRun, ReplicaLog

    err = _Writes()
    monkeypatch.setattr(sys, "stderr", err)
    FaultTolerantRun._say(SimpleNamespace(who="replica 2"), "quorum 3 -> 2 replicas")
    FaultTolerantRun._say(SimpleNamespace(who="replica 0 member 1"), "rejoined")
    ReplicaLog.say(SimpleNamespace(who="replica 1"), "epoch  1/2")  # the run's lines (an epoch's end)
    assert err.calls == ["[replica 2] quorum 3 -> 2 replicas\n", "[replica 0 member 1] rejoined\n",
                         "[replica 1] epoch  1/2\n"]


def test_the_fault_tolerant_run_overrides_only_the_step_and_the_finish():
    """The rest of a replica's run is the run's own loop with the replica's hooks
    (how it is built, starts, evaluates and checkpoints), supplied by composition."""
    from gossip.train import fault_tolerance as ft
    from gossip.train.loop import Build, Evaluation, Run, Start

    inherited = {n for c in Run.__mro__[:-1] for n in vars(c) if not n.startswith("__")}
    assert {n for n in vars(ft.FaultTolerantRun) if n in inherited} == {"step", "finish"}
    hooks = ft.replica_hooks(ft.ReplicaSpec(0, 2, "http://localhost:1", 1, 5.0, False))
    assert isinstance(hooks.build, ft.ReplicaBuild) and isinstance(hooks.build, Build)
    assert isinstance(hooks.start, ft.ReplicaStart) and isinstance(hooks.start, Start)
    assert isinstance(hooks.evaluation, ft.ReplicaEvaluation) and isinstance(hooks.evaluation, Evaluation)
    assert ft.ReplicaEnv(world_size=2, distributed=False, rank=1).mode == ft.MODE


# --------------------------------------------------------------------------------------
# replicas agree or are refused
# --------------------------------------------------------------------------------------
#: a short run of the tiny model: the agreement happens at the first quorum
SHORT = [*ARGS, "--model", "tests._ftmodel:mlp", "--max-steps", "3", "--timeout", "20", "--no-progress"]


def _group(tmp: Path, argvs: list[list[str]], ids: list[int], replicas: int, lh_min: int = 1) -> list[tuple[int, str]]:
    """Workers with replica ids ``ids`` and their own extra flags, on one Lighthouse; each
    worker's (exit code, stderr)."""
    lh = _Lighthouse(min_replicas=lh_min, tmp=tmp)
    procs = []
    try:
        for i, (k, extra) in enumerate(zip(ids, argvs)):
            procs.append(_fork([*SHORT, "--fault-tolerance", lh.addr, "--out", str(tmp / "run"), *extra],
                               _env(k, replicas), tmp, tmp / f"p{i}.log"))
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        _stop(procs, lh)
    return [(c, (tmp / f"p{i}.log").read_text()) for i, c in enumerate(codes)]


def _error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if "gossip.train: error:" in ln]


class _Lone:
    """A lone worker's run: exit code, stdout, stderr, seconds from start to exit."""

    def __init__(self, proc: _Worker, out: Path, err: Path) -> None:
        self.proc, self.out, self.err, self.t0 = proc, out, err, time.monotonic()

    def finish(self) -> None:
        self.returncode = self.proc.wait(timeout=180)
        self.took = time.monotonic() - self.t0
        self.stdout, self.stderr = self.out.read_text(), self.err.read_text()


@pytest.fixture(scope="module")
def lone(tmp_path_factory) -> dict[str, Any]:
    """The one-line failures of a worker on its own, started at once (each waits on its own
    --timeout, so together they take the longest one's time, not the sum): no Lighthouse at
    the address, a web server there, a Lighthouse that forms no quorum, a quorum below
    --min-replicas. ``{case: _Lone}``, and the ports under ``"port:<case>"``."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class _Hello(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"hello")

        def log_message(self, *args: Any) -> None:
            pass

    tmp = tmp_path_factory.mktemp("lone")
    server = ThreadingHTTPServer(("localhost", 0), _Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with socket.socket() as s:
        s.bind(("localhost", 0))
        free = s.getsockname()[1]  # nothing listens here once the socket is closed
    (tmp / "two").mkdir()
    (tmp / "one").mkdir()
    lh_two = _Lighthouse(min_replicas=2, tmp=tmp / "two")  # two replicas for a quorum; one worker comes
    lh_one = _Lighthouse(min_replicas=1, tmp=tmp / "one")
    cases = {
        "unreachable": ([*ARGS, "--timeout", "2", "--max-steps", "5", "--fault-tolerance", f"localhost:{free}"],
                        _env(0, 2), free),
        "web": ([*SHORT, "--timeout", "60", "--fault-tolerance", f"localhost:{server.server_address[1]}"], _env(0, 2),
                server.server_address[1]),
        "no_quorum": ([*SHORT, "--timeout", "2", "--fault-tolerance", lh_two.addr], _env(0, 1), lh_two.port),
        "below_min": ([*ARGS, "--timeout", "3", "--max-steps", "5", "--fault-tolerance", lh_one.addr,
                       "--min-replicas", "2"], _env(0, 2), lh_one.port),
    }
    got: dict[str, Any] = {}
    try:
        for case, (argv, env, port) in cases.items():
            out, err = tmp / f"{case}.out", tmp / f"{case}.err"
            proc = _fork([*argv, "--out", str(tmp / case)], env, tmp, out, err)
            got[case], got[f"port:{case}"] = _Lone(proc, out, err), port
        for case in cases:
            got[case].finish()
    finally:
        _stop([got[c].proc for c in cases if c in got], lh_two)
        lh_one.close()
        server.shutdown()
    return got


def test_unreachable_lighthouse_is_one_line_naming_it_within_the_timeout(lone) -> None:
    r, port = lone["unreachable"], lone["port:unreachable"]
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and re.search(rf"--fault-tolerance localhost:{port}: no Lighthouse answers there within "
                                         r"--timeout 2 s", lines[0]), r.stderr
    assert r.took < 60


def test_a_port_where_no_lighthouse_answers_is_named_as_such_at_once(lone) -> None:
    """A web server on the port is not a Lighthouse: said before anything waits on it."""
    r, port = lone["web"], lone["port:web"]
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and re.fullmatch(
        rf"gossip\.train: error: --fault-tolerance localhost:{port}: no torchft Lighthouse there: something else "
        r"answers \(HTTP 200 OK from BaseHTTP/\S+ Python/\S+ without its dashboard\); give the Lighthouse's address, "
        r"or start one with `torchft_lighthouse .*`", lines[0]), r.stderr
    assert r.took < 60  # not --timeout: nothing to wait for


def test_a_lighthouse_that_answers_but_forms_no_quorum_says_so(lone) -> None:
    r, port = lone["no_quorum"], lone["port:no_quorum"]
    assert r.returncode == 2, r.stderr[-2000:]
    assert _error_lines(r.stderr) and re.search(
        rf"error: --fault-tolerance http://localhost:{port}: the Lighthouse answers but formed no quorum of "
        r"--min-replicas 1 within 3 x --timeout \(6 s\) at step 0 \(.*\); check its --min_replicas against the live "
        r"workers$", _error_lines(r.stderr)[0]), r.stderr[-2000:]


def test_a_quorum_below_min_replicas_waits_says_so_once_then_fails_at_the_timeout(lone) -> None:
    r = lone["below_min"]
    assert r.returncode == 2, r.stderr[-2000:]
    ours = [ln for ln in r.stderr.splitlines() if "replica 0]" in ln or "gossip.train" in ln]
    assert sum("waiting: the quorum has 1 of 2 replicas (--min-replicas 2)" in ln for ln in ours) == 1, ours
    assert re.search(r"gossip\.train: error: --min-replicas 2: only 1 replica\(s\) in the quorum for --timeout 3 s",
                     ours[-1]), ours


#: a flag each of replicas 1-4 gives another value, and what the agreement says of it
MISMATCHES = [
    (["--lr", "0.1"], "lr: 0.05 on replica 0, 0.1 on replica 1"),
    (["--seed", "1"], "seed: 0 on replica 0, 1 on replica 2"),
    (["--model", "mlp"], 'model_name: "tests._ftmodel:mlp" on replica 0, "mlp" on replica 3'),
    (["--algo", "powersgd"], 'algo: "allreduce" on replica 0, "powersgd" on replica 4'),
]


def test_replicas_started_with_different_flags_are_refused_on_every_replica(tmp_path: Path) -> None:
    """Before anything of the algorithm is exchanged (a model of another size would abort
    gloo; another algorithm would wait on exchanges the other never posts). Five workers,
    four of them each with one flag of its own, in one group (the Lighthouse forms the
    first quorum with all five): every one stops with the line naming each flag and value."""
    got = _group(tmp_path, [[], *(extra for extra, _ in MISMATCHES)], list(range(5)), 5, lh_min=5)
    want = "gossip.train: error: the replicas were started with different configs; "
    for code, text in got:
        assert code == 2, text[-3000:]
        lines = _error_lines(text)
        assert len(lines) == 1 and lines[0].startswith(want), text[-3000:]
        # (another algorithm also differs in what it implies: its momentum)
        parts = lines[0][len(want):].split("; ")
        assert all(said in parts for _, said in MISMATCHES), lines[0]
        assert "Traceback" not in text, text[-3000:]
    # nothing written: the run directory holds no config and no metrics
    assert not (tmp_path / "run" / "config.json").exists()
    assert not list((tmp_path / "run").glob("metrics-rank*.jsonl")) if (tmp_path / "run").exists() else True


def test_two_workers_with_one_replica_id_are_refused_naming_both(tmp_path: Path) -> None:
    got = _group(tmp_path, [[], []], [0, 0], 2)
    for code, text in got:
        assert code == 2, text[-3000:]
        lines = _error_lines(text)
        assert len(lines) == 1 and re.search(
            r"error: REPLICA_GROUP_ID=0 is given to 2 workers \(host \S+ pid \d+, host \S+ pid \d+\): give each worker "
            r"its own REPLICA_GROUP_ID in 0 \.\. 1$", lines[0]), text[-3000:]
    assert not (tmp_path / "run" / "config.json").exists()


def test_a_replica_joining_later_with_another_config_is_refused_and_the_others_go_on(tmp_path: Path) -> None:
    """Replica 1 dies and is started again with another --lr: it stops with the line, the
    replica that trained goes on without it (it says so) and ends normally."""
    lh = _Lighthouse(min_replicas=1, tmp=tmp_path)
    slow, out = tmp_path / "slow", tmp_path / "run"
    argv = [*ARGS, "--model", "tests._ftmodel:mlp", "--max-steps", "60", "--timeout", "20", "--no-progress",
            "--fault-tolerance", lh.addr, "--out", str(out)]
    procs: list[_Worker] = []
    try:
        procs = [_start(k, argv, tmp_path, f"w{k}", slow=slow, replicas=2) for k in range(2)]
        m = [out / f"metrics-rank{k}.jsonl" for k in range(2)]
        _wait(lambda: _last_step(m[1]) >= 3, "replica 1 to reach step 3", procs)
        slow.touch()  # the survivor cannot finish before the joiner has been seen
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        before = m[1].read_text()
        # replica 1 started again, with another --lr
        spare = _start(1, [*argv, "--lr", "0.1"], tmp_path, "w1-restarted", slow=slow, replicas=2)
        procs.append(spare)
        assert spare.wait(timeout=180) == 2, (tmp_path / "w1-restarted.log").read_text()[-3000:]
        slow.unlink()
        assert procs[0].wait(timeout=180) == 0, (tmp_path / "w0.log").read_text()[-3000:]
    finally:
        _stop(procs, lh)
    joiner = (tmp_path / "w1-restarted.log").read_text()
    assert _error_lines(joiner) == [
        "gossip.train: error: replica 1 cannot join the run: the replicas were started with different configs; "
        "lr: 0.05 on replica 0, 0.1 on replica 1"], joiner[-3000:]
    survivor = (tmp_path / "w0.log").read_text()
    assert re.search(r"\[replica 0\] refused replica 1 \(replica 1 cannot join the run: .*lr: 0\.05 on replica 0, "
                     r"0\.1 on replica 1\); going on without it", survivor), survivor[-3000:]
    assert m[1].read_text() == before  # the refused worker wrote nothing into replica 1's metrics
    done = [r["step"] for r in _steps(_records(m[0]))]
    assert done == list(range(1, 61)), done


def test_the_agreement_verdict_refuses_the_newcomer_or_everyone() -> None:
    from gossip.train.fault_tolerance import agreement_verdict

    cfg = parse_args(["--algo", "allreduce", "--fault-tolerance", "localhost:1", "--out", "run"])

    def entry(k, veteran, lr=0.05, pid=1):
        return {"replica": k, "veteran": veteran, "host": "h", "pid": pid, "record": {"lr": lr, "seed": 0}}

    # at the start (nobody has trained): everyone stops, naming each value
    line, refused = agreement_verdict(cfg, [entry(0, False), entry(1, False, 0.1)], 2)
    assert refused == {0, 1} and line == "the replicas were started with different configs; lr: 0.05 on replica 0, " \
                                        "0.1 on replica 1"
    # later: the newcomer that differs from the replicas that trained stops, alone
    line, refused = agreement_verdict(cfg, [entry(0, True), entry(1, False, 0.1), entry(2, True)], 3)
    assert refused == {1} and line.startswith("replica 1 cannot join the run: ") and "0.1 on replica 1" in line
    # a second worker given a live replica's id: the newcomer stops; at the start, both
    line, refused = agreement_verdict(cfg, [entry(0, True, pid=7), entry(0, False, pid=8), entry(1, True)], 2)
    assert refused == {1} and "REPLICA_GROUP_ID=0 is given to 2 workers (host h pid 7 (training), host h pid 8)" in line
    _, refused = agreement_verdict(cfg, [entry(0, False, pid=7), entry(0, False, pid=8)], 2)
    assert refused == {0, 1}


# --------------------------------------------------------------------------------------
# fault tolerance you can follow
# --------------------------------------------------------------------------------------
def _ours(line: str) -> bool:
    """A line gossip prints under --fault-tolerance: a replica's own, or replica 0's end record."""
    return line.startswith("[replica ") or line.startswith('{"event": "end"')


@pytest.fixture(scope="module")
def two_epochs(tmp_path_factory) -> tuple[Path, list[int]]:
    """A whole 2-epoch run of two replicas (2 x 62 steps of 32), replica 1 with
    --ft-verbose: its folder (logs p0.log, p1.log; run directory run/) and exit codes."""
    tmp = tmp_path_factory.mktemp("two_epochs")
    mnist = [a for a in SHORT if a not in ("--max-steps", "3")]
    mnist[mnist.index("--epochs") + 1] = "2"
    lh = _Lighthouse(min_replicas=1, tmp=tmp)
    procs = []
    try:
        for k, extra in ((0, []), (1, ["--ft-verbose"])):
            procs.append(_fork([*mnist, "--fault-tolerance", lh.addr, "--out", str(tmp / "run"), *extra],
                               _env(k, 2), tmp, tmp / f"p{k}.log"))
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        _stop(procs, lh)
    return tmp, codes


def test_torchfts_log_is_quiet_unless_asked_and_every_replica_prints_its_epoch_lines(two_epochs) -> None:
    """A 2-epoch run: each replica prints its quorum and its two epoch lines and nothing of
    torchft's (whose Manager logs several INFO lines a step); --ft-verbose brings them back."""
    tmp_path, codes = two_epochs
    quiet, verbose = ((tmp_path / f"p{k}.log").read_text() for k in range(2))
    assert codes == [0, 0], quiet[-2000:] + verbose[-2000:]
    lines = [ln for ln in quiet.splitlines() if ln.strip()]
    assert all(_ours(ln) for ln in lines), [ln for ln in lines if not _ours(ln)][:5]
    epochs = [ln for ln in lines if "] epoch " in ln]
    assert len(epochs) == 2 and all(re.match(r"\[replica 0\] epoch +\d/2  train \d\.\d{4}  test \d\.\d{4}  acc "
                                             r"\d+\.\d\d%  sent/node/step ", ln) for ln in epochs), epochs
    assert re.search(r"\[INFO\] \[torchft::manager\]", verbose)  # the flag turns torchft's log on
    assert len([ln for ln in verbose.splitlines() if "] epoch " in ln]) == 2
    evals = [r for r in _records(tmp_path / "run" / "metrics-rank0.jsonl") if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [62, 124] and all("test_acc" in r and "train_loss" in r for r in evals)
    assert all(r["event"] == "eval" for r in evals)  # not a step's record: readers of steps pass it by


def test_a_fault_tolerant_run_writes_the_records_of_every_run(two_epochs, tmp_path: Path) -> None:
    """summary.json and config.json with the keys of a plain run's (one of the same algorithm
    in one process here), plus fault tolerance's own: its ``fault_tolerance`` object and
    ``fault_tolerance_replicas``."""
    from gossip.train.loop import run as run_plain

    ft_dir, codes = two_epochs
    assert codes == [0, 0]
    plain = tmp_path / "plain"
    run_plain(parse_args(["--algo", "allreduce", "--data", "mnist1d", "--model", "mlp", "--batch-size", "32",
                          "--max-steps", "2", "--simulate", "2", "--no-progress", "--device", "cpu",
                          "--out", str(plain)]))
    ft, ref = (json.loads((d / "summary.json").read_text()) for d in (ft_dir / "run", plain))
    assert [k for k in ft if k != "fault_tolerance"] == list(ref), (sorted(set(ft) ^ set(ref)))
    assert ft["mode"] == "fault-tolerance" and ft["world_size"] == 2 and ft["steps"] == 124 and not ft["diverged"]
    assert ft["final_test_acc"] is not None and ft["bytes_sent_per_node_per_step"] > 0
    assert ft["fault_tolerance"]["replica"] == 0 and ft["fault_tolerance"]["replicas"] == 2
    assert ft["fault_tolerance"]["quorums"] >= 1 and ft["fault_tolerance"]["heals"] == 0
    ft_cfg, ref_cfg = (json.loads((d / "config.json").read_text()) for d in (ft_dir / "run", plain))
    assert set(ft_cfg) == set(ref_cfg) | {"fault_tolerance_replicas"}, sorted(set(ft_cfg) ^ set(ref_cfg))
    assert ft_cfg["mode"] == "fault-tolerance" and ft_cfg["fault_tolerance_replicas"] == 2


def test_a_language_model_trains_under_fault_tolerance(tmp_path: Path) -> None:
    """The replicas' shards are windows of the text (a classifier's come from its labels)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def greet(name):\n    return f'Grüße, {name}! 🙂'\n\nclass Café:\n    naïve = True\n" * 60,
                      encoding="utf-8")
    tiny_lm = ["--data", "text", "--data-dir", str(corpus), "--model", "gpt", "--model-opt", "layers=1",
               "--model-opt", "width=16", "--model-opt", "heads=2", "--data-opt", "context=16", "--batch-size", "4"]
    got = _group(tmp_path, [tiny_lm, tiny_lm], [0, 1], 2)
    for code, text in got:
        assert code == 0, text[-3000:]
        assert re.search(r"\] epoch [ .\d]+/50  train \d+\.\d{4}  test \d+\.\d{4}  bpb \d+\.\d{3} ppl ",
                         text), text[-2000:]
    end = [r for r in _records(tmp_path / "run" / "metrics-rank0.jsonl") if r.get("event") == "end"][-1]
    assert end["step"] == 3 and end["test_bpb"] > 0
    assert "corpus_sha256" in json.loads((tmp_path / "run" / "config.json").read_text())


# --------------------------------------------------------------------------------------
# no single point of total loss: the Lighthouse
# --------------------------------------------------------------------------------------
def _two_workers(tmp: Path, lh: _Lighthouse, extra: list[str], slow: Path, names=("w0", "w1")) -> list:
    argv = [*ARGS, "--model", "tests._ftmodel:mlp", "--no-progress", "--fault-tolerance", lh.addr,
            "--out", str(tmp / "run"), *extra]
    return [_start(k, argv, tmp, names[k], slow=slow, replicas=2) for k in range(2)]


def test_when_the_lighthouse_dies_every_worker_names_it_and_the_run_resumes_from_its_checkpoints(
        tmp_path: Path) -> None:
    """The Lighthouse is killed and not restarted: every worker stops within 3 x --timeout
    with a line naming it. Started again, with a Lighthouse, and --resume auto, each
    replica continues from its own newest checkpoint: the steps after it are taken again,
    with the same losses to the last bit, and every step is in the metrics exactly once."""
    lh = _Lighthouse(min_replicas=1, tmp=tmp_path)
    slow, out = tmp_path / "slow", tmp_path / "run"
    flags = ["--timeout", "4", "--checkpoint-every", "4", "--max-steps", "24"]
    procs: list[_Worker] = []
    try:
        slow.touch()  # the run cannot end before the Lighthouse is gone
        procs = _two_workers(tmp_path, lh, flags, slow)
        m = [out / f"metrics-rank{k}.jsonl" for k in range(2)]
        _wait(lambda: min(_last_step(m[0]), _last_step(m[1])) >= 6, "both replicas to reach step 6", procs)
        lh.kill()
        t0 = time.monotonic()
        codes = [p.wait(timeout=120) for p in procs]
        took = time.monotonic() - t0
        logs = [(tmp_path / f"w{k}.log").read_text() for k in range(2)]
        assert codes == [2, 2], logs
        for log in logs:
            lines = _error_lines(log)
            assert len(lines) == 1 and re.search(
                rf"error: --fault-tolerance http://localhost:{lh.port}: the Lighthouse stopped answering \(Connection "
                r"refused\) and no quorum was formed within 3 x --timeout \(12 s\) at step \d+; restart it on that "
                r"address \(`torchft_lighthouse .*`\): workers still waiting rejoin it, and a stopped one continues "
                r"from its checkpoint with --resume auto$", lines[0]), log[-3000:]
        assert took < 60, took
        before = {k: {r["step"]: r["loss"] for r in _steps(_records(m[k]))} for k in range(2)}
        kept = {k: max(int(re.search(r"step(\d+)", p.name).group(1)) for p in out.glob(f"ckpt-step*-replica{k}.pt"))
                for k in range(2)}
        assert kept[0] == kept[1] >= 4 and max(before[0]) > kept[0], (kept, max(before[0]))
        # the whole run, started again: a Lighthouse, and both workers with --resume auto
        slow.unlink()
        lh.start()
        procs = _two_workers(tmp_path, lh, [*flags, "--resume", "auto"], slow, names=("r0", "r1"))
        for k, p in enumerate(procs):
            assert p.wait(timeout=180) == 0, (tmp_path / f"r{k}.log").read_text()[-3000:]
    finally:
        _stop(procs, lh)
    for k in range(2):
        assert f"[replica {k}] resumed from its checkpoint at step {kept[k]}" in (tmp_path / f"r{k}.log").read_text()
        steps = _steps(_records(m[k]))
        assert [r["step"] for r in steps] == list(range(1, 25)), [r["step"] for r in steps]
        redone = [r for r in steps if kept[k] < r["step"] <= max(before[k])]
        assert redone and all(r["loss"] == before[k][r["step"]] for r in redone), (redone, before[k])
    p0, p1 = (torch.load(out / f"model-replica{k}.pt")["params"] for k in range(2))
    assert torch.equal(p0, p1)
    # a checkpoint of another config is refused, naming the option, before anything connects
    code, _, err = _run([*ARGS, "--model", "tests._ftmodel:mlp", "--no-progress", "--fault-tolerance", "localhost:1",
                         "--out", str(out), *flags, "--resume", "auto", "--lr", "0.1"], _env(0, 2), tmp_path, "refused")
    assert code == 2 and _error_lines(err) == [
        "gossip.train: error: --resume: the checkpoint of replica 0 at step 24 was written with another config; "
        "lr: 0.05 in the checkpoint, 0.1 now"], err[-2000:]


def test_a_lighthouse_restarted_on_the_same_address_is_rejoined_and_the_run_goes_on(tmp_path: Path) -> None:
    """Killed mid-run and started again on its port: the workers, which kept their state,
    rejoin it and go on from their step (nothing is lost, no step is taken twice)."""
    lh = _Lighthouse(min_replicas=1, tmp=tmp_path)
    slow, out = tmp_path / "slow", tmp_path / "run"
    procs: list[_Worker] = []
    try:
        slow.touch()
        # --timeout bounds the wait of a worker whose peer rejoined the new Lighthouse later (the
        # first group after the restart may be re-formed once more): seconds, not minutes
        procs = _two_workers(tmp_path, lh, ["--timeout", "10", "--max-steps", "30"], slow)
        m = [out / f"metrics-rank{k}.jsonl" for k in range(2)]
        _wait(lambda: min(_last_step(m[0]), _last_step(m[1])) >= 5, "both replicas to reach step 5", procs)
        lh.kill()
        # the workers find it gone: no step without a quorum, so their steps stand still (a step
        # already in its commit may still land); polled, however loaded the machine
        _wait(_standing_still(m), "both replicas to stop stepping without the Lighthouse", procs, timeout=120)
        at_kill = [_last_step(m[k]) for k in range(2)]
        lh.start()
        listening = time.monotonic()
        _wait(lambda: all(_last_step(m[k]) > at_kill[k] for k in range(2)), "both replicas to step again",
              procs, timeout=180)
        rejoined = time.monotonic() - listening
        slow.unlink()
        for k, p in enumerate(procs):
            assert p.wait(timeout=180) == 0, (tmp_path / f"w{k}.log").read_text()[-3000:]
    finally:
        _stop(procs, lh)
    # the documented bound, about 2 s (a retry a second, the Lighthouse's join timeout), with room for a
    # machine loaded by a whole test suite
    assert rejoined < 30, rejoined
    for k in range(2):
        steps = [r["step"] for r in _steps(_records(m[k]))]
        assert steps == list(range(1, 31)), steps
        log = (tmp_path / f"w{k}.log").read_text()
        assert not _error_lines(log) and "Traceback" not in log, log[-3000:]
    p0, p1 = (torch.load(out / f"model-replica{k}.pt")["params"] for k in range(2))
    assert torch.equal(p0, p1)


def _touch(path: str) -> None:
    Path(path).write_text("ran")


class _Forged:
    """An object whose unpickling runs code (writes a file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return _touch, (str(self.marker),)


def test_a_forged_replica_checkpoint_is_refused_without_running_its_code(tmp_path):
    from types import SimpleNamespace

    from gossip.errors import RunError
    from gossip.train.fault_tolerance import ReplicaCheckpoints, _ckpt_name

    marker = tmp_path / "ran"
    path = tmp_path / _ckpt_name(5, 0)
    torch.save({"format": "forged", "payload": _Forged(marker)}, path)
    run = SimpleNamespace(out=tmp_path, replica=0, _ckpt_member=None, device=torch.device("cpu"), who="replica 0")
    with pytest.raises(RunError, match=rf"--resume: cannot read '.*{path.name}'"):
        ReplicaCheckpoints(run).resume()
    assert not marker.exists()
