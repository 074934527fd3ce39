"""Training that keeps going when a node dies: live membership on torchft.

``--fault-tolerance HOST:PORT`` runs each worker as one torchft *replica group* of one
rank. torchft's Lighthouse (at ``HOST:PORT``) keeps the quorum; its ``Manager``
re-forms a reconfigurable gloo process group over the live replicas at every step,
averages the step's all-reduce over that step's participants, and heals a replica that
(re)joins behind the group by sending it a live peer's state over its HTTP checkpoint
transport: no file on disk is read. See docs/fault-tolerance.md for the design, what
torchft carries and what it does not.

One step of replica ``k`` (``Manager`` calls in brackets):

1. Join the quorum [``start_quorum``, synchronous]. If the group is ahead (a restart),
   load a live peer's model, local optimizer and algorithm state and continue from
   the group's step; the data loader is re-positioned on ``k``'s own shard.
2. If the participants changed, say who left and who joined in one line and in the
   metrics. Fewer than ``--min-replicas`` participants: wait (said once), and fail in
   one line when ``--timeout`` passes without enough of them.
3. Forward and backward on ``k``'s next batch; the algorithm reduces the flat gradient
   through ``FTCommunicator``, whose all-reduce is ``Manager.allreduce``: the
   mean over this step's participants.
4. Commit [``should_commit``]: every participant agrees that nobody failed during
   the step; only then does the local optimizer step and the metrics record it. A
   step that fails (a peer died mid-all-reduce) is discarded and retried with the
   new quorum; the loader is put back so that no batch is skipped.

Workers are started one by one (``python -m gossip.train`` or ``torchrun
--nproc_per_node 1``) with ``REPLICA_GROUP_ID`` (0 .. N-1, the worker's data shard)
and ``NUM_REPLICA_GROUPS`` (N) in their environment, as torchft's own examples do; a
restarted worker is started again with the same ``REPLICA_GROUP_ID``.
"""

from __future__ import annotations

import copy
import datetime as _dt
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from gossip import algorithms, data, evaluation, rundir
from gossip.comm.base import Communicator, Handle, ring_allreduce_bytes, tensor_nbytes
from gossip.comm.ledger import Ledger

__all__ = ["FTCommunicator", "SUPPORTED_ALGORITHMS", "lighthouse_address", "run_fault_tolerant"]

#: the algorithms whose every exchange is one all-reduce of a dense vector, which torchft's
#: managed all-reduce carries over a changing quorum (diloco with a linear compressor only)
SUPPORTED_ALGORITHMS = tuple(n for n in algorithms.available() if algorithms.algorithm_class(n).fault_tolerant)
#: the environment torchft's examples give each replica group
REPLICA_ENV, REPLICAS_ENV = "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS"
#: the address this worker advertises to its peers (default: its host name)
HOST_ENV = "GOSSIP_FT_HOST"


def lighthouse_address(value: str) -> str:
    """``HOST:PORT`` or ``http://HOST:PORT`` as torchft's clients take it (``http://...``).

    Raises:
        ValueError: naming what is accepted, for anything else.
    """
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"--fault-tolerance must be the Lighthouse's HOST:PORT, got {value!r}")
    text = value.strip()
    parts = urlsplit(text if "://" in text else f"http://{text}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise ValueError(f"--fault-tolerance must be the Lighthouse's HOST:PORT (or http://HOST:PORT), got {value!r}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"http://{host}:{port}"


# --------------------------------------------------------------------------------------
# the communicator: the step's collectives over torchft's managed process group
# --------------------------------------------------------------------------------------
class _ManagedHandle(Handle):
    def __init__(self, work: Any, Y: torch.Tensor) -> None:
        self._work, self._Y = work, Y

    def wait(self) -> torch.Tensor:
        self._work.wait()  # an error is reported to the Manager: should_commit() says False
        return self._Y.view(1, -1)

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())


class FTCommunicator(Communicator):
    """One replica's collectives over the quorum of the step, through a torchft Manager.

    ``all_reduce`` is ``Manager.allreduce``: the sum, or the mean over the step's
    participants (not over the configured number of replicas). An error during it
    (a peer died) does not raise here: torchft records it and the step's
    ``should_commit()`` returns False, so the caller discards the step.

    Only all-reduce is carried. torchft's process group is re-formed per quorum and
    offers collectives, not the point-to-point sends a gossip neighbour exchange
    needs; ``neighbor_exchange``, ``all_gather`` and ``broadcast`` raise.

    Args:
        manager: the replica's ``torchft.Manager`` (its group has one rank).
        replica: this replica's id ``k`` in ``0 .. replicas-1``.
        replicas: the number of replicas the run was configured with.
        membership: a callable returning the replica ids of the current quorum (for
            the ledger's ring model of who sends to whom).
    """

    topology = None

    def __init__(self, manager: Any, replica: int, replicas: int, membership: Any) -> None:
        self.manager, self.replica, self._members = manager, int(replica), membership
        self.world_size = int(replicas)
        self.rank = int(replica)
        self.nodes = torch.tensor([self.replica])
        self.ledger = Ledger(nodes=(self.replica,), world_size=self.world_size)

    def all_reduce_async(self, X: torch.Tensor, op: str = "sum", *, record: bool = True) -> Handle:
        from torch.distributed import ReduceOp

        self._check_reduce(X, op)
        with self.ledger.phase("communicate"):
            Y = X[0].clone(memory_format=torch.contiguous_format)
            work = self.manager.allreduce(Y, reduce_op=ReduceOp.AVG if op == "mean" else ReduceOp.SUM)
            members = sorted(self._members())
            if record and len(members) > 1 and self.replica in members:
                # ring model over the step's participants: to the successor, from the predecessor
                i, n = members.index(self.replica), len(members)
                nbytes = ring_allreduce_bytes(tensor_nbytes(X), n)
                self.ledger.record(self.replica, members[(i + 1) % n], nbytes, op="all_reduce")
                self.ledger.record(members[(i - 1) % n], self.replica, nbytes, op="all_reduce")
            self.ledger.count("all_reduce")
        return _ManagedHandle(work, Y)

    def _refuse(self, what: str) -> Handle:
        raise NotImplementedError(
            f"{what} is not carried under --fault-tolerance: torchft's managed process group offers the "
            f"all-reduce of the step's participants only (supported: {', '.join(SUPPORTED_ALGORITHMS)})")

    def neighbor_exchange_async(self, P: torch.Tensor, *, record: bool = True, step: int | None = None) -> Handle:
        return self._refuse("the neighbour exchange")

    def all_gather_async(self, X: torch.Tensor, *, record: bool = True) -> Handle:
        return self._refuse("all_gather")

    def broadcast_async(self, X: torch.Tensor, src: int, *, record: bool = True) -> Handle:
        return self._refuse("broadcast")


class _QuorumWatch:
    """torchft's ``ManagerClient``, remembering the replica ids of the latest quorum.

    torchft 0.2's Manager keeps a quorum's members to itself; its client's ``_quorum``
    result carries them (``gossip_<k>:<uuid>``: the uuid tells a restarted worker from
    the one that died), so the client is wrapped and every other call passes through.
    """

    def __init__(self, client: Any) -> None:
        self._client = client
        self.replica_ids: list[str] = []
        self.max_step = 0  # the group's step: the highest step among the quorum's replicas

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        self.replica_ids, self.max_step = list(quorum.replica_ids), int(quorum.max_step)
        return quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def _checkpoint_transport(host: str, timeout: _dt.timedelta) -> Any:
    """torchft's HTTP checkpoint transport, advertising ``host`` (torchft 0.2 advertises
    the machine's host name, which need not reach it from another host or namespace)."""
    from torchft.checkpointing import HTTPTransport

    class _Transport(HTTPTransport):
        def address(self) -> str:
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return _Transport(timeout=timeout, num_chunks=0)


def _incarnations(replica_ids: list[str]) -> list[tuple[int, str]]:
    """``[(k, uuid)]`` of ``gossip_<k>:<uuid>`` ids, by k."""
    out = []
    for rid in replica_ids:
        name, _, uid = rid.partition(":")
        out.append((int(name.rpartition("_")[2]), uid))
    return sorted(out)


# --------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------
def _replica_env(run_error: type) -> tuple[int, int]:
    got = {k: os.environ.get(k) for k in (REPLICA_ENV, REPLICAS_ENV)}
    try:
        k, n = int(got[REPLICA_ENV]), int(got[REPLICAS_ENV])  # type: ignore[arg-type]
        if n < 1 or not 0 <= k < n:
            raise ValueError
    except (TypeError, ValueError):
        raise run_error(
            f"--fault-tolerance: set {REPLICA_ENV}=K and {REPLICAS_ENV}=N for each worker (0 <= K < N; K is its "
            f"data shard, kept across restarts), got {REPLICA_ENV}={got[REPLICA_ENV]!r} "
            f"{REPLICAS_ENV}={got[REPLICAS_ENV]!r}") from None
    return k, n


def _wait_for_lighthouse(addr: str, timeout: float, run_error: type) -> None:
    """Fail in one line, within ``timeout`` seconds, when nothing listens at ``addr``."""
    parts = urlsplit(addr)
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((parts.hostname, parts.port), timeout=max(0.1, min(2.0, left))):
                return
        except OSError as e:
            last = e.strerror or type(e).__name__
        if time.monotonic() + 0.2 >= deadline:
            raise run_error(
                f"--fault-tolerance {parts.hostname}:{parts.port}: no Lighthouse answers there within --timeout "
                f"{timeout:g} s ({last}); start one with `torchft_lighthouse --min_replicas K --bind [::]:PORT`")
        time.sleep(0.2)


class _FTRun:
    """One replica's run (see the module's steps)."""

    def __init__(self, cfg: Any) -> None:
        from gossip import loop

        self.cfg, self.loop, self.RunError = cfg, loop, loop.RunError
        algo = cfg.algorithm.name
        if algo not in SUPPORTED_ALGORITHMS:
            kind = "decentralized: rebuilding the topology over the live nodes is not built yet" \
                if algorithms.is_decentralized(algo) else "its exchanges are not all-reduces of dense vectors"
            raise self.RunError(f"--fault-tolerance supports --algo {', '.join(SUPPORTED_ALGORITHMS)} so far, "
                                f"got --algo {algo} ({kind}; see docs/fault-tolerance.md)")
        if cfg.comm.simulate is not None:
            raise self.RunError("--fault-tolerance runs one worker per process: do not combine it with --simulate")
        if cfg.run.out is None:
            raise self.RunError("--fault-tolerance needs --out DIR: a restarted worker writes on in the same directory")
        if cfg.run.resume is not None:
            raise self.RunError("--fault-tolerance heals a restarted worker from a live peer: drop --resume")
        try:
            import torchft  # noqa: F401
        except ImportError:
            raise self.RunError("--fault-tolerance needs torchft: pip install 'gossip[ft]' (torchft>=0.2)") from None
        self.addr = lighthouse_address(cfg.comm.fault_tolerance)
        self.min_replicas = cfg.comm.min_replicas
        self.timeout = float(cfg.comm.timeout)
        self.replica, self.replicas = _replica_env(self.RunError)
        if self.min_replicas > self.replicas:
            raise self.RunError(f"--min-replicas {self.min_replicas} exceeds the {self.replicas} replicas of "
                                f"{REPLICAS_ENV}; accepted: 1 .. {self.replicas}")
        self.out = Path(cfg.run.out)
        self.device = torch.device("cpu") if cfg.comm.device != "cuda" else torch.device("cuda")
        self.members: list[tuple[int, str]] = []
        self.heal_bytes, self.heal_source = 0, -1

    # --- state a healing peer receives: model, local optimizer, algorithm -------------
    def _state(self) -> dict:
        # a copy: the transport serves it while this replica trains on (torchft orders the
        # healing peer's fetch before this step's all-reduce completes, but the copy makes
        # that ordering irrelevant); called only when a peer needs healing
        return copy.deepcopy({"gossip": self.gopt.state_dict(), "replica": self.replica})

    def _load(self, sd: dict) -> None:
        self.gopt.load_state_dict(sd["gossip"])
        self.heal_bytes = sum(int(t.numel() * t.element_size()) for t in _tensors(sd))
        self.heal_source = int(sd["replica"])

    def _position_loader(self, step: int) -> None:
        """The loader of this replica's own shard, just before the batch of ``step``."""
        self.loader = data.ShardLoader(self.dataset.x_train, self.dataset.y_train, self.shards[self.replica],
                                       self.cfg.data.batch_size, seed=self.cfg.run.seed, node=self.replica,
                                       device=self.device)
        for _ in range(step):  # the loader's order is a function of (seed, node, step)
            self.loader.next_batch()

    def _say(self, line: str) -> None:
        print(f"[replica {self.replica}] {line}", file=sys.stderr, flush=True)

    def run(self) -> dict | None:
        from torchft import Manager
        from torch.distributed import TCPStore

        cfg, loop = self.cfg, self.loop
        _wait_for_lighthouse(self.addr, self.timeout, self.RunError)
        self.dataset = loop._build_dataset(cfg)
        torch.manual_seed(cfg.run.seed)  # x_1 identical on every replica
        self.model = loop._build_model(cfg, self.dataset, self.device)
        self.opt = loop._local_optimizer(cfg, self.model)
        try:
            self.shards = data.partition(self.dataset.y_train, self.replicas, scheme=cfg.data.partition,
                                         seed=cfg.run.seed)
        except ValueError as e:
            raise self.RunError(f"--partition {cfg.data.partition} over {self.replicas} replicas: {e}") from None
        self.out.mkdir(parents=True, exist_ok=True)
        if self.replica == 0 and not rundir.config_path(self.out).exists():
            record = {**cfg.to_dict(), "fault_tolerance_replicas": self.replicas}
            rundir.write_json(rundir.config_path(self.out), record)
        host = os.environ.get(HOST_ENV) or socket.gethostname()
        td = _dt.timedelta(seconds=self.timeout)
        # the replica group's own store (a group of one rank): torchft's Manager expects it started
        store = TCPStore(host_name=host, port=0, is_master=True, wait_for_workers=False, timeout=td)
        from torchft.process_group import ProcessGroupGloo

        self.pg = ProcessGroupGloo(timeout=td)  # re-configured by the Manager at every quorum change
        self.manager = Manager(
            pg=self.pg, load_state_dict=self._load, state_dict=self._state, min_replica_size=self.min_replicas,
            use_async_quorum=False,  # heal before the forward pass: a restarted replica takes part at once
            # a survivor may spend up to --timeout stuck in a collective on a dead peer before it
            # asks for the next quorum: the others' quorum wait must outlast that
            timeout=td, quorum_timeout=3 * td, connect_timeout=td, rank=0, world_size=1,
            store_addr=host, store_port=store.port, lighthouse_addr=self.addr, replica_id=f"gossip_{self.replica}",
            hostname=host, init_sync=False,  # x_1 is identical by the seed
            checkpoint_transport=_checkpoint_transport(host, td),
        )
        self.watch = self.manager._client = _QuorumWatch(self.manager._client)
        self.comm = FTCommunicator(self.manager, self.replica, self.replicas,
                                   lambda: [k for k, _ in _incarnations(self.watch.replica_ids)])
        self.algo = loop._build_algorithm(cfg, self.comm)
        from gossip.runtime import GossipOptimizer

        try:
            self.gopt = GossipOptimizer([self.model], [self.opt], self.algo)
        except (ValueError, TypeError) as e:
            raise self.RunError(f"--algo {cfg.algorithm.name}: {e}") from None
        if getattr(self.algo, "collective", "all_reduce") != "all_reduce":
            raise self.RunError(f"--fault-tolerance: --algo {cfg.algorithm.name} with --compressor "
                                f"{cfg.algorithm.compressor_spec} all-gathers its payloads, which torchft's Manager "
                                "does not carry; use a linear compressor (identity, randomk, randomblock)")
        try:
            return self._train()
        finally:
            self.manager.shutdown(wait=False)

    def _train(self) -> dict | None:
        cfg, loop = self.cfg, self.loop
        steps_per_epoch = len(self.shards[self.replica]) // cfg.data.batch_size or 1
        total = cfg.run.epochs * steps_per_epoch
        stop = total if cfg.run.max_steps is None else min(total, cfg.run.max_steps)
        metrics = rundir.MetricsWriter(rundir.metrics_path(self.out, self.replica), keep_until=2**62)  # append
        self._position_loader(0)
        loader_step, t0, waiting_since, said_wait = 0, time.perf_counter(), None, False
        stepped = False  # has this process committed a step (a restarted one has not, before it heals)
        try:
            while (step := self.manager.current_step()) < stop:
                # 1. the quorum of this step; healing happens inside when the group is ahead
                try:
                    self.manager.start_quorum()
                except Exception as e:  # the Lighthouse did not form a quorum within --timeout
                    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    raise self.RunError(
                        f"--fault-tolerance {self.addr}: no quorum of --min-replicas {self.min_replicas} formed "
                        f"within 3 x --timeout ({3 * self.timeout:g} s) at step {step} ({first[:200]})") from None
                if self.manager.current_step() != step:  # healed from a live peer
                    self._say(f"healed from replica {self.heal_source} at step {self.manager.current_step()} "
                              f"(was at step {step}; {self.heal_bytes:,} bytes of state received)")
                    metrics.write({"event": "heal", "step": self.manager.current_step(), "from_step": step,
                                   "source": self.heal_source, "bytes": self.heal_bytes})
                    if stepped:  # a live worker that fell behind (its vote said no where others' said yes):
                        # the steps it took by healing are recorded once, as healed, with no loss of its own
                        for s_ in range(step + 1, self.manager.current_step() + 1):
                            if s_ % cfg.run.log_every == 0 or s_ == stop:
                                metrics.write({"step": s_, "loss": None, "healed_from": self.heal_source,
                                               "participants": None, "time": time.perf_counter() - t0})
                    step = self.manager.current_step()
                if loader_step != step:
                    self._position_loader(step)
                    loader_step = step
                # 2. who is here
                members = _incarnations(self.watch.replica_ids)
                if members != self.members:  # a restarted worker is a new incarnation: left and joined
                    left = sorted(k for k, u in self.members if (k, u) not in members)
                    joined = sorted(k for k, u in members if (k, u) not in self.members) if self.members else []
                    ids = [k for k, _ in members]
                    self._say(f"quorum at step {step}: {len(ids)} replicas {ids}"
                              f" (left: {left or 'none'}; joined: {joined or 'none'})")
                    metrics.write({"event": "quorum", "step": step, "replicas": ids, "left": left,
                                   "joined": joined})
                    self.members = members
                n = self.manager.num_participants()
                # the first step waits for every configured worker (as a torchrun rendezvous
                # would); later steps go on with --min-replicas of them
                if n < self.min_replicas:
                    need, what = self.min_replicas, f"--min-replicas {self.min_replicas}"
                else:
                    # (the group's step, not this worker's: a restarted worker whose healing failed
                    # is at 0 while the group is not, and retries below)
                    start = step == 0 and self.watch.max_step == 0
                    need, what = (self.replicas if start else n), f"all {REPLICAS_ENV}={self.replicas} to start"
                if n < need:
                    waiting_since = waiting_since or time.monotonic()
                    if not said_wait:
                        self._say(f"waiting: the quorum has {n} of {need} replicas ({what})")
                        said_wait = True
                    if time.monotonic() - waiting_since > self.timeout:
                        raise self.RunError(
                            f"{what}: only {n} replica(s) in the quorum for --timeout {self.timeout:g} s at step "
                            f"{step}; start more workers" + (" or lower --min-replicas" if need == self.min_replicas
                                                             else ""))
                    # no step: the commit vote says no (it would otherwise count a step not taken)
                    self.manager.report_error(RuntimeError("waiting for replicas"))
                    self.manager.should_commit()
                    time.sleep(0.2)
                    continue
                waiting_since, said_wait = None, False
                if self.manager.errored() is not None:  # e.g. re-forming the group or healing failed
                    self.manager.should_commit()  # says no: the next quorum retries
                    self._say(f"step {step + 1} skipped ({str(self.manager.errored())[:120]}); retrying")
                    continue
                # 3. the local gradient, reduced over the step's participants
                saved = self.loader.state_dict()
                x, y = self.loader.next_batch()
                lr = loop._lr_at(cfg, step, total)
                for g in self.opt.param_groups:
                    g["lr"] = lr
                self.model.train()
                self.opt.zero_grad(set_to_none=False)
                loss = evaluation.loss_fn(self.dataset.task)(self.model(x), y)
                loss.backward()
                self.algo.set_lr(lr)
                if self.algo.acts_on == "gradient":
                    G = self.gopt.flat.gather_grads()
                    self.algo.reduce_gradients(G)
                    snapshot = None
                else:  # the algorithm changes the model in its step: keep what to go back to
                    snapshot = copy.deepcopy(self.gopt.state_dict())
                    self.gopt.step()
                # 4. commit only if every participant got through the step
                if self.manager.should_commit():
                    if snapshot is None:
                        self.gopt.flat.scatter_grads(G)
                        self.opt.step()
                        self.gopt.steps += 1
                        self.algo.on_step_end(self.gopt.steps)
                    loader_step, stepped = step + 1, True
                    done = self.manager.current_step()
                    if done % cfg.run.log_every == 0 or done == stop:
                        metrics.write({"step": done, "loss": loss.item(), "lr": lr, "participants": n,
                                       "time": time.perf_counter() - t0,
                                       "bytes_sent": int(self.comm.ledger.bytes_sent)})
                else:
                    if snapshot is not None:
                        self.gopt.load_state_dict(snapshot)
                    self.loader.load_state_dict(saved)  # the batch is retried in the next quorum
                    self._say(f"step {step + 1} discarded (a participant failed); retrying with a new quorum")
            end = {"event": "end", "step": self.manager.current_step(),
                   **evaluation.test_metrics(self.model, self.dataset, self.device), "time": time.perf_counter() - t0}
            metrics.write(end)
            torch.save({"params": self.gopt.flat.data[0].detach().clone(), "step": end["step"]},
                       self.out / f"model-replica{self.replica}.pt")
        finally:
            metrics.close()
        if self.replica == 0:
            print(json.dumps(end), flush=True)
        return end


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def run_fault_tolerant(cfg: Any) -> dict | None:
    """Run one replica of a ``--fault-tolerance`` run (see the module); its end record.

    Raises:
        gossip.loop.RunError: one line for every failure the user can act on (torchft
            missing, an unsupported ``--algo``, no Lighthouse at the address, a quorum
            below ``--min-replicas`` for ``--timeout``).
    """
    return _FTRun(cfg).run()
