"""Training that keeps going when a node dies: live membership on torchft.

``--fault-tolerance HOST:PORT`` runs each worker as one torchft *replica group* of one
rank. torchft's Lighthouse (at ``HOST:PORT``) keeps the quorum; its ``Manager``
re-forms a reconfigurable gloo process group over the live replicas at every step,
averages the step's all-reduce over that step's participants, and heals a replica that
(re)joins behind the group by sending it a live peer's state over its HTTP checkpoint
transport: no file on disk is read. See docs/fault-tolerance.md for the design, what
torchft carries and what it does not. Each worker is a :class:`FaultTolerantRun`, a
:class:`gossip.train.loop.Run` whose step is the one below and whose finish is its own;
how it is built, starts, evaluates and checkpoints are the run's hooks, supplied by
:func:`replica_hooks`. It writes the records every run writes (config.json, metrics,
summary.json).

One step of replica ``k`` (``Manager`` calls in brackets):

1. Join the quorum [``start_quorum``, synchronous]. If the group is ahead (a restart),
   load a live peer's model, local optimizer and algorithm state (less the worker's own
   error-feedback residuals, ``Algorithm.local_state``, which start at zero) and continue
   from the group's step; the data loader is re-positioned on ``k``'s own shard.
2. If the participants changed, say who left and who joined in one line and in the
   metrics. Fewer than ``--min-replicas`` participants: wait (said once), and fail in
   one line when ``--timeout`` passes without enough of them.
3. When the group was re-formed, take the live replicas as the communicator's members;
   a decentralized algorithm also rebuilds its graph over them (``--topology`` over the
   live count, validated; a ring where it cannot be built) and re-establishes its
   replica state with the new neighbours by a full-precision exchange (setup traffic).
4. Forward and backward on ``k``'s next batch; the algorithm's exchanges run through
   :class:`FTCommunicator` over the quorum's process group (all-reduce means are over
   the step's participants). A failure is reported to the Manager and aborts the group
   at once, so that every survivor leaves the failed collective.
5. Commit [``should_commit``]: every participant agrees that nobody failed during
   the step; only then does the local optimizer step and the metrics record it. A
   step that fails is put back (model, optimizers, algorithm state, loader) and
   retried with the new quorum.

Workers are started one by one (``python -m gossip.train`` or ``torchrun
--nproc_per_node 1``) with ``REPLICA_GROUP_ID`` (0 .. N-1, the worker's data shard)
and ``NUM_REPLICA_GROUPS`` (N) in their environment, as torchft's own examples do; a
restarted worker is started again with the same ``REPLICA_GROUP_ID``.
"""

from __future__ import annotations

import copy
import datetime as _dt
import hashlib
import json
import math
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

import topologies
from gossip import algorithms, data, rundir
from gossip.train import assembly, evaluation, metrics
from gossip.train._ftcomm import FTCommunicator
from gossip.train.assembly import Env
from gossip.train.checkpoint import Progress
from gossip.comm.base import is_time_varying
from gossip.train.config import RESUME_AUTO, lighthouse_address
from gossip.errors import PeerError, RunError, say_line
from gossip.train.loop import Build, Evaluation, Run, RunHooks, Start

__all__ = ["FT_CHECKPOINT_FORMAT", "FTCommunicator", "FaultTolerantRun", "MODE", "ReplicaBuild", "ReplicaCheckpoints",
           "ReplicaEnv", "ReplicaEvaluation", "ReplicaLog", "ReplicaSpec", "ReplicaStart", "SUPPORTED_ALGORITHMS",
           "agreement_verdict", "ft_checkpoints", "lighthouse_address", "live_topology", "probe_lighthouse",
           "replica_hooks", "replica_spec", "run_fault_tolerant"]

#: the algorithms that run under ``--fault-tolerance`` (``Algorithm.fault_tolerant``)
SUPPORTED_ALGORITHMS = tuple(n for n in algorithms.available() if algorithms.algorithm_class(n).fault_tolerant)
#: the ``mode`` of a fault-tolerant run's config.json and summary.json (the others': simulate, torchrun)
MODE = "fault-tolerance"
#: the environment torchft's examples give each replica group
REPLICA_ENV, REPLICAS_ENV = "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS"
#: the address this worker advertises to its peers (default: its host name)
HOST_ENV = "GOSSIP_FT_HOST"


class _QuorumWatch:
    """torchft's ``ManagerClient``, remembering the replica ids of the latest quorum.

    torchft 0.2's Manager keeps a quorum's members to itself; its client's ``_quorum``
    result carries them (``gossip_<k>:<uuid>``: the uuid tells a restarted worker from
    the one that died), so the client is wrapped and every other call passes through.
    """

    def __init__(self, client: Any, manager: Any = None) -> None:
        self._client, self._manager = client, manager
        self.replica_ids: list[str] = []
        self.max_step = 0  # the group's step: the highest step among the quorum's replicas
        self.quorum_id: int | None = None  # changes when the group is re-formed
        self.replica_rank = -1  # this replica's rank in the re-formed group

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        self.replica_ids, self.max_step = list(quorum.replica_ids), int(quorum.max_step)
        self.quorum_id, self.replica_rank = int(quorum.quorum_id), int(quorum.replica_rank)
        if self._manager is not None and quorum.heal and self.quorum_id == self._manager._quorum_id:
            # torchft re-forms the group only when the quorum id changes. A replica behind the group
            # always meets a new id (its peers' commit went on without it), except where a
            # Lighthouse restarted on the same address, counting ids from 1 again, reached the id
            # this replica last had, while its peers re-formed their group without it: re-form it
            self._manager._quorum_id = -1
        return quorum

    @property
    def key(self) -> tuple:
        """The group: its quorum id and members. A Lighthouse restarted on the same address
        counts quorum ids from 1 again, so an id alone may name an earlier group."""
        return self.quorum_id, tuple(self.replica_ids)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def _quorum_retries(quorum_timeout: float) -> int:
    """torchft's ``quorum_retries`` for a quorum that may take ``quorum_timeout`` seconds.
    torchft's Manager server asks the Lighthouse again after a failed request (reconnecting
    first), sleeping ``quorum_timeout / (retries + 1)`` in between: one retry a second."""
    return max(1, math.ceil(quorum_timeout))


def _process_group(base: type, timeout: _dt.timedelta, run: Any) -> Any:
    """torchft's gloo group, whose store prefix also names the group's step.

    torchft configures each quorum's group under the prefix ``torchft/<quorum id>`` of the
    primary replica's store. A Lighthouse restarted on the same address counts quorum ids
    from 1 again, and the store still holds the keys of the first Lighthouse's groups of
    those ids (gloo's addresses of processes long gone): the group's step (the quorum's
    ``max_step``, the same on every member) keeps the new prefixes apart from them."""

    class _Gloo(base):  # type: ignore[misc, valid-type]
        def configure(self, store_addr: str, *args: Any, **kwargs: Any) -> None:
            return super().configure(f"{store_addr}/step{run.watch.max_step}", *args, **kwargs)

    return _Gloo(timeout=timeout)


def _checkpoint_transport(host: str, timeout: _dt.timedelta, verbose: bool = False) -> Any:
    """torchft's HTTP checkpoint transport, advertising ``host`` (torchft 0.2 advertises
    the machine's host name, which need not reach it from another host or namespace);
    its server's request lines only with ``--ft-verbose``."""
    from torchft.checkpointing import HTTPTransport

    class _Transport(HTTPTransport):
        def address(self) -> str:
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    transport = _Transport(timeout=timeout, num_chunks=0)
    if not verbose:
        transport._server.RequestHandlerClass.log_message = lambda *args, **kwargs: None
    return transport


#: torchft's Python loggers (its Manager's, its checkpoint transports')
_TORCHFT_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")


def _torchft_logging(verbose: bool) -> None:
    """torchft's own log: quiet unless ``--ft-verbose`` (gossip says in its own lines what
    the replica sees: quorums, heals, failures). Its Rust part reads ``RUST_LOG`` once,
    when torchft is first imported: ``warn`` by default, ``info`` with ``--ft-verbose``;
    a ``RUST_LOG`` set by the user is kept. Its Python loggers: silent, or INFO to
    stderr with ``--ft-verbose``."""
    import logging
    import warnings

    os.environ.setdefault("RUST_LOG", "info" if verbose else "warn")
    for name in _TORCHFT_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO if verbose else logging.CRITICAL + 1)
        if verbose and not logger.handlers and name == "torchft":
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            logger.addHandler(handler)
    if not verbose:  # torch's loader of the state a healing peer sends (torchft's transport)
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


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
def _replica_env() -> tuple[int, int]:
    got = {k: os.environ.get(k) for k in (REPLICA_ENV, REPLICAS_ENV)}
    try:
        k, n = int(got[REPLICA_ENV]), int(got[REPLICAS_ENV])  # type: ignore[arg-type]
        if n < 1 or not 0 <= k < n:
            raise ValueError
    except (TypeError, ValueError):
        raise RunError(
            f"--fault-tolerance: set {REPLICA_ENV}=K and {REPLICAS_ENV}=N for each worker (0 <= K < N; K is its "
            f"data shard, kept across restarts), got {REPLICA_ENV}={got[REPLICA_ENV]!r} "
            f"{REPLICAS_ENV}={got[REPLICAS_ENV]!r}") from None
    return k, n


#: the start command the messages suggest (the flags the documented figures were measured with)
_LIGHTHOUSE_CMD = ("torchft_lighthouse --min_replicas K --bind [::]:PORT --join_timeout_ms 500 "
                   "--heartbeat_timeout_ms 1000")


def probe_lighthouse(addr: str, timeout: float) -> tuple[str, str]:
    """What answers at ``addr`` (``http://HOST:PORT``): ``("lighthouse", "")``,
    ``("nothing", why)`` when no connection is made, or ``("other", what)`` when
    something that is not a torchft Lighthouse answers there.

    The Lighthouse serves its dashboard (an HTML page titled "Lighthouse Dashboard")
    over HTTP on the port of its gRPC service; anything else there, a web server or a
    service that does not speak HTTP, is told apart from it by that page.
    """
    import http.client

    parts = urlsplit(addr)
    try:
        socket.create_connection((parts.hostname, parts.port), timeout=timeout).close()
    except OSError as e:
        return "nothing", e.strerror or type(e).__name__
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("GET", "/")
        resp = conn.getresponse()
        body = resp.read(1 << 16).decode("utf-8", "replace")
    except (OSError, http.client.HTTPException) as e:
        return "other", f"a service that does not answer HTTP as the Lighthouse does ({str(e) or type(e).__name__})"
    finally:
        conn.close()
    if "Lighthouse" in body:
        return "lighthouse", ""
    server = resp.getheader("Server")
    return "other", f"HTTP {resp.status} {resp.reason}{f' from {server}' if server else ''} without its dashboard"


def _wait_for_lighthouse(addr: str, timeout: float) -> None:
    """Fail in one line, within ``timeout`` seconds, when no Lighthouse answers at ``addr``;
    at once when something else does."""
    parts = urlsplit(addr)
    where = f"--fault-tolerance {parts.hostname}:{parts.port}"
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        kind, why = probe_lighthouse(addr, max(0.1, min(2.0, left)))
        if kind == "lighthouse":
            return
        if kind == "other":
            raise RunError(f"{where}: no torchft Lighthouse there: something else answers ({why}); give the "
                            f"Lighthouse's address, or start one with `{_LIGHTHOUSE_CMD}`")
        if time.monotonic() + 0.2 >= deadline:
            raise RunError(f"{where}: no Lighthouse answers there within --timeout {timeout:g} s ({why}); start one "
                            f"with `{_LIGHTHOUSE_CMD}`")
        time.sleep(0.2)


class FaultTolerantRun(Run):
    """One replica of a ``--fault-tolerance`` run: :class:`gossip.train.loop.Run`'s training
    story (its :meth:`~gossip.train.loop.Run.train`: begin, step until the end, an epoch's end,
    checkpoints, finish) with the module's steps 1-5 as its :meth:`step` and its own
    :meth:`finish`; it overrides nothing else of the run.

    It records what every run records: its step, quorum, heal and end records through the
    run's log, ``config.json`` and ``summary.json`` (the same keys as any run's, plus a
    ``fault_tolerance`` object: replica, quorums, heals, discarded steps, aborted groups)
    from :mod:`gossip.train.metrics`' records; its device by
    :func:`gossip.train.assembly.choose_device`. What a replica does its own way is in
    the run's hooks (:func:`replica_hooks`), and why:

    - :class:`ReplicaBuild`: nothing is exchanged before the first quorum (the group
      forms again at every step), so the replica's parts are built offline, and its run
      directory is not claimed: nothing is written before the replica's group has agreed
      (a refused replica writes nothing, least of all into the file of the live replica
      whose id it took); its :class:`ReplicaLog` holds the records until then;
    - :class:`ReplicaStart`: the Lighthouse and torchft's Manager (with the resumed step:
      the quorum heals the replicas behind the most advanced one), shut down at the end
      however the run ends;
    - :class:`ReplicaEvaluation`: the replica's own model, no collective (a peer's death
      must not cost an epoch's evaluation);
    - :class:`ReplicaCheckpoints`: one file per replica (``ckpt-step<N>-replica<k>.pt``),
      read back by the replica alone: the run's :class:`~gossip.train.checkpoint.CheckpointManager`
      resumes the step every rank agrees on through collectives, which a replica cannot
      take part in before it has a quorum (each replica resumes on its own and the
      quorum heals those behind the most advanced one).
    """

    def step(self) -> None:
        """The module's steps 1-5 for the group's next step: ``progress.step`` moves on only
        when the step is committed (a heal moves it past the steps the group took)."""
        step = self._quorum(self.manager.current_step())
        n = self._membership(step)
        if self.watch.key != self.agreed_quorum and self.manager.errored() is None:
            self._agree(step)  # before anything of the algorithm is exchanged, waiting or not
        if not self._enough(n, step):
            return
        if self.watch.key != self.built_quorum and self.manager.errored() is None:
            self._rebuild([k for k, _ in self.members], step)
        if self.manager.errored() is not None:  # re-forming the group, healing or rebuilding failed
            self.manager.should_commit()  # says no: the next quorum retries
            self._say(f"step {step + 1} skipped ({_first_line(self.manager.errored())[:120]}); retrying")
            return
        if self.log.pending is not None:  # the first step of a group that agreed
            self._open_run_files()
        self._step(step, n)

    def finish(self) -> dict | None:
        """The end record (this replica's model on the test set), its final parameters in
        ``model-replica<k>.pt``, and on replica 0 summary.json (its own figures: no
        collective at the end either); returns the summary on replica 0 (None elsewhere)."""
        step = self.manager.current_step()
        end = {"event": "end", "step": step, **evaluation.test_metrics(self.model, self.dataset, self.device),
               "time": self.elapsed(), "aborted_groups": self.comm.aborts}
        # the run's writers are closed (Run.train closes them before its last checkpoint): appended
        writer = rundir.MetricsWriter(rundir.metrics_path(self.out, self.node), keep_until=2**62)
        writer.write(end)
        writer.close()
        if self.member == 0:  # the members of a replica group hold one model
            torch.save({"params": self.gopt.flat.data[0].detach().clone(), "step": step},
                       self.out / f"model-replica{self.replica}.pt")
        if not self.is_main:
            return None
        say_line(json.dumps(end), sys.stdout)
        summary = metrics.summary_record(self.facts(), steps=step, ledger=self.comm.run_ledger, comm=self.comm,
                                         last_eval=self.last_eval, dpsgd_bytes=self.dpsgd_bytes,
                                         wall_time_s=self.elapsed(), groups=self.groups)
        summary["fault_tolerance"] = {
            "replica": self.replica, "replicas": self.replicas, "min_replicas": self.min_replicas,
            "replica_group_size": self.group_size,
            "lighthouse": self.addr, "quorums": self.quorums, "heals": self.heals,
            "discarded_steps": self.discarded, "aborted_groups": self.comm.aborts,
            "resumed_from_step": self.resumed_step}
        rundir.write_json(rundir.summary_path(self.out), summary)
        return summary

    # --- the replica's helpers: its state for a peer, its loader, its lines, its Manager -----
    @property
    def _ckpt_member(self) -> int | None:
        """The member index in checkpoint file names: in replica groups only."""
        return self.member if self.group_size > 1 else None

    def _state(self) -> dict:
        # a copy: the transport serves it while this replica trains on (torchft orders the
        # healing peer's fetch before this step's all-reduce completes, but the copy makes
        # that ordering irrelevant); called only when a peer needs healing
        return copy.deepcopy({"gossip": self.gopt.state_dict(), "replica": self.replica, "agree": self.agree_digest})

    def _load(self, sd: dict) -> None:
        if sd.get("agree") != self.agree_digest:
            # a peer of another config (or data): its state may not even fit this model. Nothing
            # is loaded; the agreement right after this quorum names the difference and refuses
            self.heal_source, self.heal_mismatch = int(sd.get("replica", -1)), True
            return
        state, algo = sd["gossip"], self.algo
        if self.decentralized:
            # the replica state of a graph is rebuilt with the new neighbours right after the
            # quorum (a full-precision exchange); from the peer: its model, local optimizer,
            # step counters and the algorithm's iteration t
            with torch.no_grad():
                self.gopt.flat.data.copy_(state["params"])
            for opt, osd in zip(self.gopt.optimizers, state["optimizers"]):
                opt.load_state_dict(osd)
            self.gopt.steps = int(state["steps"])
            _set_iteration(algo, int(state["algorithm"]["t"]))
            self.built_quorum = None
        else:
            self.gopt.load_state_dict(state)
            for inner in _inner_algorithms(algo):  # this worker's own residual died with it
                for name in inner.local_state:
                    getattr(inner.state, name).zero_()
        self.heal_reset = list(_template(algo).local_state)
        self.heal_bytes = sum(int(t.numel() * t.element_size()) for t in _tensors(sd))
        self.heal_source = int(sd["replica"])

    def _position_loader(self, step: int) -> None:
        """The loader of this replica's own shard, just before the batch of ``step``."""
        self.loader = data.ShardLoader(self.dataset.x_train, self.dataset.y_train, self.shards[self.node],
                                       self.cfg.data.batch_size, seed=self.cfg.run.seed, node=self.node,
                                       device=self.device)
        for _ in range(step):  # the loader's order is a function of (seed, node, step)
            self.loader.next_batch()
        self.loaders = [self.loader]

    def _say(self, line: str) -> None:
        say_line(f"[{self.who}] {line}")  # the replicas share one stderr

    def _start_manager(self) -> None:
        from torch.distributed import TCPStore
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo

        host = os.environ.get(HOST_ENV) or socket.gethostname()
        td = _dt.timedelta(seconds=self.timeout)
        # the replica group's own store, started by its member 0 (torchft's Manager expects it
        # started); in groups its address goes to the other members over the group's process group
        self.store = None
        if self.member == 0:
            self.store = TCPStore(host_name=host, port=0, is_master=True, wait_for_workers=False, timeout=td)
        store_host, store_port = (host, self.store.port) if self.group_size == 1 else _share_address(
            host, self.store.port if self.store is not None else 0)
        self.pg = _process_group(ProcessGroupGloo, td, self)  # re-configured by the Manager at every quorum change
        self.manager = Manager(
            pg=self.pg, load_state_dict=self._load, state_dict=self._state, min_replica_size=self.min_replicas,
            use_async_quorum=False,  # heal before the forward pass: a restarted replica takes part at once
            # a survivor may spend up to --timeout stuck in a collective on a peer that died without
            # closing its connections before it asks for the next quorum: the others' wait must outlast that
            timeout=td, quorum_timeout=3 * td, connect_timeout=td, rank=self.member, world_size=self.group_size,
            # a Lighthouse that stops answering is asked again about once a second, reconnecting, for as long
            # as the quorum may take: one restarted on the same address is rejoined
            quorum_retries=_quorum_retries(3 * self.timeout),
            store_addr=store_host, store_port=store_port, lighthouse_addr=self.addr,
            replica_id=_replica_name(self.replica), hostname=host, init_sync=False,  # x_1 is identical by the seed
            checkpoint_transport=_checkpoint_transport(host, td, self.verbose),
        )
        self.watch = self.manager._client = _QuorumWatch(self.manager._client, self.manager)
        self.comm.attach(self.manager, self.pg)

    # --- agreement: the replicas of a group share one config and one data set ---------
    def _agreement_record(self) -> None:
        """What every replica must share (the torchrun ranks' :func:`gossip.train.agreement.agreement_record`,
        and the number of replicas and ``--min-replicas``), and its digest."""
        from gossip.train import agreement

        self.agree = {**agreement.agreement_record(self.cfg, self.dataset),
                      REPLICAS_ENV: self.replicas, "min_replicas": self.min_replicas}
        if self.group_size > 1:  # (absent for groups of one: the records of runs made before groups still agree)
            self.agree["replica_group_size"] = self.group_size
        # each replica resumes (or not) on its own; one behind the group heals from it
        self.agree.pop("resume_auto", None)
        text = json.dumps(self.agree, sort_keys=True, default=str)
        self.agree_digest = hashlib.sha256(text.encode()).hexdigest()

    def _agree(self, step: int) -> None:
        """At every re-formed group, before the algorithm exchanges anything: every member
        of the group compares its :meth:`_agreement_record` and replica id with the others'
        (one all-gather of a digest; of the records only when they differ).

        At the start every replica of a group that differs stops with one line naming the
        option and each value (as the torchrun ranks do); later, a replica that joins with
        another config, or with the replica id of a live one, is refused (it stops with
        that line) and the replicas that have trained go on without it, saying so."""
        size = len(self.watch.replica_ids)
        mine = json.dumps({"replica": self.replica, "veteran": self.stepped, "host": socket.gethostname(),
                           "pid": os.getpid(), "record": self.agree}, sort_keys=True, default=str).encode()
        resuming = self.resumed_step is not None and not self.stepped
        head = torch.tensor([self.replica, int(self.stepped), len(mine), int(resuming)]
                            + [int.from_bytes(bytes.fromhex(self.agree_digest)[i:i + 8], "big", signed=True)
                               for i in range(0, 32, 8)], dtype=torch.int64)
        heads = self.comm.gather_group(head, size)
        if heads is None:  # a member failed: the step is discarded, the next group agrees again
            return
        # a group of replicas that all resumed from their checkpoints and none has stepped since: the
        # whole run was started again, and its first step waits for every replica, as a fresh start does
        self.group_resuming = bool(heads[:, 3].all())
        ids = heads[:, 0].tolist()
        if len(set(ids)) == len(ids) and bool((heads[:, 4:] == heads[0, 4:]).all()):
            self.agreed_quorum = self.watch.key
            return
        longest = int(heads[:, 2].max())
        buf = torch.zeros(longest, dtype=torch.uint8)
        buf[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        rows = self.comm.gather_group(buf, size)
        if rows is None:
            return
        entries = [json.loads(bytes(row[:int(n)].tolist()).decode()) for row, n in zip(rows, heads[:, 2].tolist())]
        line, refused = agreement_verdict(self.cfg, entries, self.replicas)
        me = self.watch.replica_rank
        if me in refused:
            raise RunError(line)
        odd = sorted({entries[r]["replica"] for r in refused})
        self._say(f"refused replica {', '.join(map(str, odd))} ({line}); going on without it")
        self.manager.report_error(RuntimeError(f"replica {', '.join(map(str, odd))} was refused"))

    def _open_run_files(self) -> None:
        """Before this replica's first step, its group having agreed: the run directory,
        config.json (replica 0, unless a restarted one finds it), and the metrics file,
        appended to (a restarted replica writes on after its earlier records; a resumed
        one after those up to its checkpoint's step), with the records held until now."""
        self.out.mkdir(parents=True, exist_ok=True)
        if self.is_main and not rundir.config_path(self.out).exists():
            record = metrics.config_record(self.facts(), cfg_dict=self.cfg_dict, layout=self.gopt.layout,
                                           corpus=self.dataset.corpus)
            record["fault_tolerance_replicas"] = self.replicas
            if self.group_size > 1:
                record["fault_tolerance_group_size"] = self.group_size
            rundir.write_json(rundir.config_path(self.out), record)
        self.log.release(keep=2**62 if self.resumed_step is None else self.resumed_step)  # resumed: redo what follows

    def _topology(self, n: int) -> tuple[Any, str | None]:
        return live_topology(self.cfg, n)

    def _rebuild(self, ids: list[int], step: int) -> None:
        """Every quorum: the communicator's live members; for a decentralized algorithm the
        graph over them and the replica state (DCD/ECD replicas, CHOCO's x-hat) re-established
        with the new neighbours by a full-precision exchange, counted as setup traffic."""
        if ids.index(self.replica) != self.watch.replica_rank:  # torchft's order of ranks is not ours
            self.manager.report_error(RuntimeError(f"replica {self.replica} is rank {self.watch.replica_rank} of the "
                                                   f"group, expected {ids.index(self.replica)} of {ids}"))
            return
        if not self.decentralized:
            self.comm.reconfigure(ids, None)
            self.built_quorum = self.watch.key
            return
        topo, why = self._topology(len(ids))
        if why is not None:
            self._say(f"--topology {self.cfg.comm.topology} cannot be built on the {len(ids)} live replicas: {why}")
        self.comm.reconfigure(ids, topo)
        t = _iteration(self.algo)
        algo = self._new_algorithm()
        before = self.comm.run_ledger.setup_bytes_sent
        with self.comm.ledger.setup():
            algo.setup(self.gopt.flat.data, self.gopt.layout)
        _set_iteration(algo, t)
        if self.groups is not None:
            self.groups.algo = algo
        self.algo = self.gopt.algorithm = algo
        if self.manager.errored() is not None:
            return  # the exchange failed: the step is discarded and the next quorum rebuilds again
        self.built_quorum = self.watch.key
        gap = _spectral_gap(topo)
        setup = self.comm.run_ledger.setup_bytes_sent - before
        self._say(f"topology at step {step}: {topo.name} over replicas {ids}"
                  + (f", spectral gap {gap:.4g}" if gap is not None else "")
                  + f"; replica state re-established ({setup:,} bytes sent, setup traffic)")
        self.log.record({"event": "topology", "step": step, "replicas": ids, "topology": topo.name,
                      "spectral_gap": gap, "fallback": why, "setup_bytes_sent": setup})

    def _new_algorithm(self) -> Any:
        """The algorithm over the replicas (``self.comm``); in replica groups of ``G``
        (:class:`gossip.groups.Grouped`): member ``j`` runs it on slice ``j`` with the
        members ``j`` of the other replica groups (torchft's process group of this member
        joins exactly those), or, for an algorithm that cannot be sliced, member 0 on the
        whole vector with a broadcast inside the group."""
        if self.group_size == 1:
            return assembly.build_algorithm(self.cfg, self.comm)
        from gossip.groups import Grouped

        try:
            return Grouped.hosted(lambda c: assembly.build_algorithm(self.cfg, c), self.comm, inter=self.comm,
                                  member=self.member, intra=self.intra, group_size=self.group_size)
        except ValueError as e:
            raise RunError(f"--group-size {self.group_size}: {e}") from None

    def _in_group(self, what: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, whose operations inside the replica group (the gradients'
        all-reduce, the slices' all-gather) fail this process in one line when a member
        of its group is gone: a replica group takes part whole or not at all, and its
        torchrun launch ends it (the other replica groups go on without it)."""
        try:
            return fn(*args)
        except PeerError as e:
            raise RunError(f"{self.who}: a member of its replica group failed during {what} ({_first_line(e)[:160]}); "
                           "the replica group leaves the quorum and the others go on: start the group's torchrun "
                           "again to rejoin (it heals from a live replica group)") from None

    def _average_in_group(self) -> torch.Tensor:
        """In a replica group: the members' gradients averaged in full precision over the
        group's process group, as DDP inside a group does (counted as ``intra`` traffic);
        the flat average."""
        G = self.gopt.flat.gather_grads()
        with self.comm.ledger.phase("communicate"):
            G = self._in_group("the gradients' all-reduce", self.intra.all_reduce, G, "sum")
        return G.div_(self.group_size)

    # --- the step ---------------------------------------------------------------------
    def _quorum(self, step: int) -> int:
        """Step 1: join the step's quorum (healing inside it when the group is ahead); the step."""
        try:
            self.manager.start_quorum()
        except Exception as e:  # no quorum within 3 x --timeout: say whether the Lighthouse is there
            raise RunError(self._no_quorum(step, e)) from None
        now = self.manager.current_step()
        if now != step and self.heal_mismatch:  # nothing was loaded: the agreement refuses this replica
            self.heal_mismatch = False
        elif now != step:  # healed from a live peer
            reset = f"; its own {', '.join(self.heal_reset)} started at zero" if self.heal_reset else ""
            self.heals += 1
            self._say(f"healed from replica {self.heal_source} at step {now} (was at step {step}; "
                      f"{self.heal_bytes:,} bytes of state received{reset})")
            self.log.record({"event": "heal", "step": now, "from_step": step, "source": self.heal_source,
                          "bytes": self.heal_bytes, "reset": self.heal_reset})
            if self.stepped:  # a live worker that fell behind (its vote said no where others' said yes):
                # the steps it took by healing are recorded once, as healed, with no loss of its own
                for s_ in range(step + 1, now + 1):
                    if s_ % self.cfg.run.log_every == 0 or s_ == self.stop:
                        self.log.record({"step": s_, "loss": None, "healed_from": self.heal_source,
                                      "participants": None, "time": self.elapsed()})
        if self.loader_step != now:
            self._position_loader(now)
            self.loader_step = now
        return now

    def _no_quorum(self, step: int, e: BaseException) -> str:
        """Why no quorum was formed, in one line: the Lighthouse gone (or replaced by another
        service) or, where it answers, a quorum it could not form."""
        window = f"3 x --timeout ({3 * self.timeout:g} s)"
        kind, why = probe_lighthouse(self.addr, min(5.0, self.timeout))
        if kind == "nothing":
            return (f"--fault-tolerance {self.addr}: the Lighthouse stopped answering ({why}) and no quorum was "
                    f"formed within {window} at step {step}; restart it on that address (`{_LIGHTHOUSE_CMD}`): "
                    f"workers still waiting rejoin it, and a stopped one continues from its checkpoint with "
                    f"--resume auto")
        if kind == "other":
            return (f"--fault-tolerance {self.addr}: the Lighthouse is gone and something else answers there "
                    f"({why}); no quorum was formed within {window} at step {step}")
        return (f"--fault-tolerance {self.addr}: the Lighthouse answers but formed no quorum of --min-replicas "
                f"{self.min_replicas} within {window} at step {step} ({_first_line(e)[:200]}); check its "
                f"--min_replicas against the live workers")

    def _membership(self, step: int) -> int:
        """Step 2: say who left and who joined, once per change; the step's participants."""
        members = _incarnations(self.watch.replica_ids)
        if members != self.members:  # a restarted worker is a new incarnation: left and joined
            left = sorted(k for k, u in self.members if (k, u) not in members)
            joined = sorted(k for k, u in members if (k, u) not in self.members) if self.members else []
            ids = [k for k, _ in members]
            self._say(f"quorum at step {step}: {len(ids)} replicas {ids}"
                      f" (left: {left or 'none'}; joined: {joined or 'none'})")
            self.log.record({"event": "quorum", "step": step, "replicas": ids, "left": left, "joined": joined})
            self.members = members
            self.quorums += 1
        return self.manager.num_participants()

    def _enough(self, n: int, step: int) -> bool:
        """Fewer participants than needed: vote no, wait (said once), fail at --timeout."""
        # the first step waits for every configured worker (as a torchrun rendezvous would);
        # later steps go on with --min-replicas of them
        if n < self.min_replicas:
            need, what = self.min_replicas, f"--min-replicas {self.min_replicas}"
        else:
            # (the group's step, not this worker's: a restarted worker whose healing failed
            # is at 0 while the group is not, and retries)
            start = (step == 0 and self.watch.max_step == 0) or (self.group_resuming and not self.stepped)
            need, what = (self.replicas if start else n), f"all {REPLICAS_ENV}={self.replicas} to start"
        if n >= need:
            self.waiting_since, self.said_wait = None, False
            return True
        self.waiting_since = self.waiting_since or time.monotonic()
        if not self.said_wait:
            self._say(f"waiting: the quorum has {n} of {need} replicas ({what})")
            self.said_wait = True
        if time.monotonic() - self.waiting_since > self.timeout:
            raise RunError(
                f"{what}: only {n} replica(s) in the quorum for --timeout {self.timeout:g} s at step {step}; start "
                f"more workers" + (" or lower --min-replicas" if need == self.min_replicas else ""))
        # no step: the commit vote says no (it would otherwise count a step not taken)
        self.manager.report_error(RuntimeError("waiting for replicas"))
        self.manager.should_commit()
        time.sleep(0.2)
        return False

    def _step(self, step: int, n: int) -> None:
        """Steps 3 and 4: the local gradient, the algorithm's exchange over the step's
        participants, and the commit; a step that fails anywhere is put back entirely."""
        cfg, algo = self.cfg, self.algo
        saved = self.loader.state_dict()
        x, y = self.loader.next_batch()
        lr = assembly.lr_at(cfg, step, self.total)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.model.train()
        self.opt.zero_grad(set_to_none=False)
        loss = evaluation.loss_fn(self.dataset.task)(self.model(x), y)
        loss.backward()
        G = self._average_in_group() if self.group_size > 1 else None  # flat, gathered once
        algo.set_lr(lr)
        if algo.acts_on == "gradient":  # its memories (error feedback, Q) change: keep what to go back to
            snapshot = {"algorithm": algo.state_dict()}
            if G is None:
                G = self.gopt.flat.gather_grads()
            self._in_group("the exchange", algo.reduce_gradients, G)
        else:  # the algorithm changes the model in its step, from the gradients in place
            if G is not None:
                self.gopt.flat.scatter_grads(G)
            snapshot = copy.deepcopy(self.gopt.state_dict())
            self._in_group("the exchange", self.gopt.step)
        if not self.manager.should_commit():
            if "params" in snapshot:
                self.gopt.load_state_dict(snapshot)
            else:
                algo.load_state_dict(snapshot["algorithm"])
            self.loader.load_state_dict(saved)  # the batch is retried in the next quorum
            self.discarded += 1
            self._say(f"step {step + 1} discarded (a participant failed); retrying with a new quorum")
            return
        if algo.acts_on == "gradient":
            self.gopt.flat.scatter_grads(G)
            self.opt.step()
            self.gopt.steps += 1
            algo.on_step_end(self.gopt.steps)
        self.loader_step, self.stepped = step + 1, True
        done = self.manager.current_step()
        self.progress.step = done  # committed: Run.train ends the epoch and checkpoints after it
        self.progress.epoch_losses[0].append(loss.item())
        if done % cfg.run.log_every == 0 or done == self.stop:
            self.log.record({"step": done, "loss": loss.item(), "lr": lr, "participants": n,
                          "time": self.elapsed(),
                          "bytes_sent": int(self.comm.run_ledger.bytes_sent),
                          "setup_bytes_sent": int(self.comm.run_ledger.setup_bytes_sent)})

# --------------------------------------------------------------------------------------
# the run's hooks: how a replica is built, starts, evaluates and checkpoints
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplicaSpec:
    """Who this worker is: replica ``replica`` of ``replicas``, the Lighthouse's address,
    ``--min-replicas``, ``--timeout`` and ``--ft-verbose``."""

    replica: int
    replicas: int
    addr: str
    min_replicas: int
    timeout: float
    verbose: bool
    member: int = 0  # this process's place in its replica group (torchrun's RANK)
    group_size: int = 1  # the replica group's processes (one torchrun launch; --group-size)

    @property
    def node(self) -> int:
        """This process's node id, its data shard and metrics file: ``replica * G + member``."""
        return self.replica * self.group_size + self.member

    @property
    def who(self) -> str:
        """How its lines name it: ``replica k``, in groups ``replica k member j``."""
        return f"replica {self.replica}" + (f" member {self.member}" if self.group_size > 1 else "")


def replica_spec(cfg: Any) -> ReplicaSpec:
    """This worker's :class:`ReplicaSpec`, refused in one line where torchft is missing, the
    replica environment is not set or ``--min-replicas`` exceeds the replicas."""
    verbose = bool(cfg.comm.ft_verbose)
    _torchft_logging(verbose)  # before torchft's first import: its Rust log reads RUST_LOG then
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise RunError("--fault-tolerance needs torchft: pip install 'gossip[ft]' (torchft>=0.2)") from None
    # the cross-flag rules (--algo, --simulate, --out, --min-replicas of a graph) are the config's
    addr = lighthouse_address(cfg.comm.fault_tolerance)
    replica, replicas = _replica_env()
    if cfg.comm.min_replicas > replicas:
        raise RunError(f"--min-replicas {cfg.comm.min_replicas} exceeds the {replicas} replicas of "
                       f"{REPLICAS_ENV}; accepted: 1 .. {replicas}")
    member, size = _group_env(cfg)
    return ReplicaSpec(replica, replicas, addr, cfg.comm.min_replicas, float(cfg.comm.timeout), verbose,
                       member=member, group_size=size)


def _group_env(cfg: Any) -> tuple[int, int]:
    """This process's member index and its replica group's size: a replica group is one
    torchrun launch (its ``WORLD_SIZE`` processes, ``RANK`` the member); ``--group-size``,
    where given, must be that size."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1
    member = int(os.environ["RANK"]) if world > 1 else 0
    g = cfg.comm.group_size
    if g is not None and g != world:
        raise RunError(f"--fault-tolerance --group-size {g}: a replica group is one torchrun launch of G processes "
                       f"(its members), and this one has {world} (WORLD_SIZE); launch each replica group with "
                       f"`torchrun --nproc_per_node {g}`, or drop --group-size")
    return member, world


@dataclass
class ReplicaEnv(Env):
    """A replica's :class:`~gossip.train.assembly.Env`: node ``rank`` of ``world_size``
    (replica ``k`` alone in its process, or member ``j`` of a replica group of ``G``: node
    ``k * G + j``), outside any run-wide torchrun group; its mode is :data:`MODE`."""

    @property
    def mode(self) -> str:
        return MODE


class ReplicaBuild(Build):
    """A replica's parts, all refused (in one line) before anything connects: the
    agreement record, x_1 (identical on every replica by the seed), its shard and loader,
    the algorithm over a placeholder membership (every replica) whose replica state is
    built with the first quorum's neighbours. Its run directory is not claimed (nothing
    is written before its group agreed); its log holds the records until then."""

    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec

    def parts(self, run: FaultTolerantRun) -> None:  # noqa: PLR0915 - the replica's state, in one place
        spec, cfg, dataset = self.spec, run.cfg, run.dataset
        run.replica, run.replicas, run.addr = spec.replica, spec.replicas, spec.addr
        run.min_replicas, run.timeout, run.verbose = spec.min_replicas, spec.timeout, spec.verbose
        run.member, run.group_size, run.node, run.who = spec.member, spec.group_size, spec.node, spec.who
        run.decentralized = algorithms.is_decentralized(cfg.algorithm.name)
        run.nodes, run.is_main = [spec.node], spec.node == 0
        run.out = Path(cfg.run.out if cfg.run.resume in (None, RESUME_AUTO) else cfg.run.resume)
        # one torchrun launch per replica group (of G processes), on hosts the run does not know
        run.hosts = {"hosts": None, "procs_per_host": spec.group_size}
        run.resumed_step = None  # the step of the checkpoint this replica resumed from
        run.group_resuming = False  # is this replica's group a run started again from its checkpoints
        run.members = []
        run.heal_bytes, run.heal_source, run.heal_reset, run.heal_mismatch = 0, -1, [], False
        run.agreed_quorum = None  # the group (_QuorumWatch.key) last found to agree
        run.built_quorum = None  # the group the topology and replica state were built for
        run.quorums = run.heals = run.discarded = 0  # for the summary's fault_tolerance object
        run.manager = None
        run.sim_path, run.sim_why, run.clock, run.adversary, run.batches = None, "", None, None, None
        run.cfg_dict = cfg.to_dict()
        if (dataset.corpus or {}).get("sha256"):  # a text corpus's identity, as every mode records it
            run.cfg_dict["corpus_sha256"] = dataset.corpus["sha256"]
        run._agreement_record()
        torch.manual_seed(cfg.run.seed)  # x_1 identical on every replica
        run.model = assembly.build_model(cfg, dataset, run.device)
        run.opt = assembly.local_optimizer(cfg, run.model)
        run.models, run.opts = [run.model], [run.opt]
        nodes = spec.replicas * spec.group_size  # in groups: one shard per member of every replica group
        try:  # by the data set's task: a language model's windows of text, a classifier's labels
            run.shards = data.partition_dataset(dataset, nodes, scheme=cfg.data.partition, seed=cfg.run.seed)
        except ValueError as e:
            raise RunError(f"--partition {cfg.data.partition} over {nodes} "
                           f"{'replicas' if spec.group_size == 1 else 'members of the replica groups'}: {e}; "
                           "use fewer replicas or more data") from None
        run.intra = _intra_communicator(spec, run.device) if spec.group_size > 1 else None
        self._optimizer(run)
        run.dim = run.gopt.flat.dim
        run.ledger = run.comm.run_ledger
        try:  # positioned again at the start (ReplicaStart), and at every heal
            run._position_loader(0)
        except ValueError as e:
            raise RunError(f"--batch-size {cfg.data.batch_size}: {e}") from None

    @staticmethod
    def _optimizer(run: FaultTolerantRun) -> None:
        from gossip.runtime import GossipOptimizer

        cfg = run.cfg
        # a placeholder membership (all replicas) until the first quorum
        run.comm.reconfigure(list(range(run.replicas)), run._topology(run.replicas)[0] if run.decentralized else None)
        run.algo = run._new_algorithm()
        try:
            with run.comm.offline():  # the replica state is built with the first quorum's neighbours
                run.gopt = GossipOptimizer([run.model], [run.opt], run.algo)
        except (ValueError, TypeError) as e:
            raise RunError(f"--algo {cfg.algorithm.name}: {e}") from None
        inner = _inner_algorithms(run.algo)
        first = inner[0] if inner else run.algo.template
        if not type(first).fault_tolerant:  # e.g. MergeComp's schedule of the EF family (--merge)
            raise RunError(f"--fault-tolerance: --algo {cfg.algorithm.name} as configured builds "
                           f"{type(first).__name__}, which does not run under --fault-tolerance; supported: "
                           f"{', '.join(SUPPORTED_ALGORITHMS)} (without --merge)")
        if run.group_size > 1:
            from gossip.train.communicators import RunGroups

            run.groups = RunGroups(run.group_size, run.algo, run.intra, run.comm.run_ledger, [[run.node]], 1)
        if getattr(first.state, "exchange", None) == "sharded":
            raise RunError(f"--fault-tolerance: --algo {cfg.algorithm.name} with --compressor "
                           f"{cfg.algorithm.compressor_spec} uses the sharded exchange, whose shards are owned "
                           "by rank and would be re-assigned at every quorum change; add --algo-opt "
                           "exchange=allgather")
        if isinstance(run.algo.config, algorithms.DiLoCoConfig) and run.algo.config.outer_delay:
            raise RunError(f"--fault-tolerance: --algo {cfg.algorithm.name} with outer_delay=1 keeps an exchange "
                           "in flight across a round, which a quorum change would cut; drop outer_delay")

    def log(self, run: FaultTolerantRun) -> ReplicaLog:
        return ReplicaLog(run.cfg, run.env, run.comm, run.out, run.steps_per_epoch, replica=run.node, who=run.who)

    def checkpoints(self, run: FaultTolerantRun) -> ReplicaCheckpoints:
        return ReplicaCheckpoints(run)


class ReplicaLog(metrics.RunLog):
    """The run's log of one replica: its records in ``metrics-rank<k>.jsonl`` (``k`` its
    replica id, whatever its rank in the quorum), held (``pending``) until its group has
    agreed and :meth:`release` opens the file; its lines on every replica, each prefixed
    with ``[replica k]`` (the replicas share one stderr); an eval record is an ``event``
    as every record of this file that is not a step's (quorum, heal, topology, end)."""

    def __init__(self, cfg: Any, env: Env, comm: Any, out: Path, steps_per_epoch: int, *, replica: int,
                 who: str | None = None) -> None:
        super().__init__(cfg, env, comm, out, steps_per_epoch, nodes=[replica])
        self.replica = replica
        self.who = who or f"replica {replica}"
        #: records held until this replica's group has agreed (None once the run's files are open)
        self.pending: list[dict] | None = []

    def say(self, line: str) -> None:
        say_line(f"[{self.who}] {line}")

    def record(self, rec: dict) -> None:
        if self.pending is not None:
            self.pending.append(rec)
        else:
            super().record(rec)

    def eval(self, step: int, ev: dict, elapsed: float) -> None:
        # kind: the eval record of every mode (gossip.tools.analysis); event: so that a reader of steps passes it by
        self.record({"event": "eval", "kind": "eval", "step": step, "epoch": step / self.steps_per_epoch,
                     "time": elapsed, **ev})

    def release(self, keep: int) -> None:
        """Open the metrics file (records after ``keep`` dropped) and write the held records."""
        self.open(keep=keep)
        held, self.pending = self.pending or [], None
        for rec in held:
            super().record(rec)


class ReplicaStart(Start):
    """A replica's start: the Lighthouse, torchft's Manager (with the resumed step: the
    quorum heals the replicas behind the most advanced one), its loader; the Manager
    shut down however the run ends. Its files are opened by its first step, once its
    group has agreed (:meth:`FaultTolerantRun._open_run_files`)."""

    def open(self, run: FaultTolerantRun, resumed: bool) -> None:
        _wait_for_lighthouse(run.addr, run.timeout)
        run._start_manager()
        if resumed:
            state = run.ckpt.state
            run.manager.load_state_dict({"step": state["step"], "batches_committed": state["batches_committed"]})
        run._position_loader(0)
        run.loader_step, run.waiting_since, run.said_wait = 0, None, False
        run.stepped = False  # has this process committed a step (a restarted one has not, before it heals)

    def close(self, run: FaultTolerantRun) -> None:
        if run.manager is not None:
            run.manager.shutdown(wait=False)


class ReplicaEvaluation(Evaluation):
    """After an epoch's last step: this replica's own model on the test set (no
    collective: a peer's death must not cost an epoch's evaluation; with a centralized
    algorithm every replica's model is the group's). The train loss is the mean of this
    replica's own steps in the epoch (steps it took by healing have none)."""

    def evaluate(self, run: FaultTolerantRun) -> dict[str, float]:
        ev = evaluation.test_metrics(run.model, run.dataset, run.device)
        losses = run.progress.epoch_losses[0]
        return {"train_loss": sum(losses) / len(losses) if losses else float("nan"), **ev}


class ReplicaCheckpoints:
    """A replica's checkpoints: its state at the group's committed step (model, local
    optimizer and the algorithm's whole state, its own error memories included, the
    group's step and the ledger) in ``ckpt-step<N>-replica<k>.pt``, written atomically,
    the two newest kept. Each replica its own, so that a run outlives its Lighthouse; on
    ``--resume`` each replica loads its own newest one (``state``: for the Manager's step)."""

    def __init__(self, run: FaultTolerantRun) -> None:
        self.run = run
        self.state: dict | None = None

    def check_finished(self, stop: int, total: int) -> None:
        """Nothing to agree on before the quorum: a replica of a finished run resumes at its
        last step and ends at once."""

    def resume(self, auto: bool = False) -> Progress | None:
        """This replica's newest checkpoint in the run directory, loaded (None where it has
        none: ``--resume auto`` then starts, and the quorum heals it from a replica that
        resumed further). A checkpoint of another config is refused in one line naming
        what differs."""
        run = self.run
        found = ft_checkpoints(run.out, run.replica, run._ckpt_member)
        if not found:
            if not auto:
                raise RunError(f"--resume {str(run.out)!r}: no checkpoint of {run.who} there "
                               f"({_ckpt_name('N', run.replica, run._ckpt_member)}); --resume auto starts "
                               "a replica that has none")
            return None
        step = max(found)
        try:
            # tensors and plain containers only: a file in --out cannot run code when loaded
            state = torch.load(found[step], map_location=run.device, weights_only=True)
        except Exception as e:  # noqa: BLE001 - a damaged file: say which
            raise RunError(f"--resume: cannot read {str(found[step])!r} ({_first_line(e)[:200]})") from None
        if (state.get("format") != FT_CHECKPOINT_FORMAT or int(state.get("replica", -1)) != run.replica
                or int(state.get("member", 0)) != run.member):
            raise RunError(f"--resume: {str(found[step])!r} is not a --fault-tolerance checkpoint of {run.who}")
        theirs = state["agree"]
        diffs = [f"{k}: {json.dumps(theirs.get(k), default=str)} in the checkpoint, "
                 f"{json.dumps(run.agree.get(k), default=str)} now"
                 for k in dict.fromkeys([*theirs, *run.agree]) if theirs.get(k) != run.agree.get(k)]
        if diffs:
            raise RunError(f"--resume: the checkpoint of {run.who} at step {step} was written with "
                           f"another config; {'; '.join(diffs)}")
        run.gopt.load_state_dict(state["gossip"])
        run.comm.run_ledger.load_state_dict(state["ledger"])
        if run.intra is not None and "intra_ledger" in state:
            run.intra.ledger.load_state_dict(state["intra_ledger"])
        run.resumed_step = step
        run._say(f"resumed from its checkpoint at step {step}")
        self.state = state
        progress = Progress.fresh(1)
        progress.step = int(state["step"])
        return progress

    def save(self, progress: Progress) -> Path:
        """This replica's checkpoint of the group's committed step."""
        run = self.run
        if run.log.pending is not None:  # no step was taken (--max-steps 0): nothing was exchanged
            run._open_run_files()
            run.log.close()  # (Run.train closed the run's writers before its last checkpoint)
        step = run.manager.current_step()
        state = {"format": FT_CHECKPOINT_FORMAT, "replica": run.replica, "replicas": run.replicas, "step": step,
                 "batches_committed": int(run.manager.batches_committed()), "agree": run.agree,
                 "gossip": run.gopt.state_dict(), "ledger": run.comm.run_ledger.state_dict()}
        if run.intra is not None:
            state.update(member=run.member, intra_ledger=run.intra.ledger.state_dict())
        path = run.out / _ckpt_name(step, run.replica, run._ckpt_member)
        rundir.write_atomically(path, lambda f: torch.save(state, f))
        kept = ft_checkpoints(run.out, run.replica, run._ckpt_member)
        for old in sorted(kept)[:-2]:
            kept[old].unlink(missing_ok=True)
        return path


def replica_hooks(spec: ReplicaSpec) -> RunHooks:
    """The hooks of a :class:`FaultTolerantRun` (see its docstring for why each)."""
    return RunHooks(build=ReplicaBuild(spec), start=ReplicaStart(), evaluation=ReplicaEvaluation())


#: the format tag of a --fault-tolerance checkpoint, and its file name in the run directory
FT_CHECKPOINT_FORMAT = "gossip-fault-tolerance-1"
_FT_CHECKPOINT = "ckpt-step{step}-replica{replica}.pt"


def _ckpt_name(step: Any, replica: int, member: int | None = None) -> str:
    """The checkpoint file of ``replica`` (of its ``member``, in replica groups) at ``step``."""
    name = _FT_CHECKPOINT.format(step=step, replica=replica)
    return name if member is None else name.replace(".pt", f"-member{member}.pt")


def ft_checkpoints(run_dir: str | Path, replica: int, member: int | None = None) -> dict[int, Path]:
    """``{step: path}`` of replica ``replica``'s ``--fault-tolerance`` checkpoints in ``run_dir``
    (``member``: of that member of a replica group)."""
    import re

    tail = "" if member is None else f"-member{int(member)}"
    pattern = re.compile(rf"^ckpt-step(\d+)-replica{int(replica)}{tail}\.pt$")
    d = Path(run_dir)
    if not d.is_dir():
        return {}
    return {int(m.group(1)): p for p in d.iterdir() if (m := pattern.match(p.name)) and p.is_file()}


def agreement_verdict(cfg: Any, entries: list[dict], replicas: int) -> tuple[str, set[int]]:
    """What a group whose members differ does: one line, and the group ranks that stop.

    ``entries`` are the members' ``{"replica", "veteran", "host", "pid", "record"}`` by
    group rank; a veteran has committed a step of this run. Two members with one replica
    id: the one that is not a veteran stops (both, and everyone, where neither or both
    are). Members whose records differ: where veterans agree among themselves, the
    others that differ from them stop; otherwise (the start of the run) every member does.
    """
    from gossip.train import agreement

    everyone = set(range(len(entries)))
    by_id: dict[int, list[int]] = {}
    for r, e in enumerate(entries):
        by_id.setdefault(int(e["replica"]), []).append(r)
    for k, ranks in sorted(by_id.items()):
        if len(ranks) > 1:
            who = ", ".join(f"host {entries[r]['host']} pid {entries[r]['pid']}"
                            + (" (training)" if entries[r]["veteran"] else "") for r in ranks)
            line = (f"{REPLICA_ENV}={k} is given to {len(ranks)} workers ({who}): give each worker its own "
                    f"{REPLICA_ENV} in 0 .. {replicas - 1}")
            veterans = [r for r in ranks if entries[r]["veteran"]]
            return line, (set(ranks) - set(veterans) if len(veterans) == 1 else everyone)
    veterans = [r for r, e in enumerate(entries) if e["veteran"]]
    records = [e["record"] for e in entries]
    ids = [int(e["replica"]) for e in entries]
    if veterans and all(records[r] == records[veterans[0]] for r in veterans):
        ref = veterans[0]
        odd = [r for r in everyone if records[r] != records[ref]]
        line = agreement.disagreement(cfg, [records[ref]] + [records[r] for r in odd],
                                      [ids[ref]] + [ids[r] for r in odd], unit="replica")
        joiners = ", ".join(str(ids[r]) for r in odd)
        return f"replica {joiners} cannot join the run: {line}", set(odd)
    line = agreement.disagreement(cfg, [records[r] for r in sorted(everyone, key=lambda r: ids[r])],
                                  sorted(ids), unit="replica")
    return line or "the replicas' configs differ", everyone


def live_topology(cfg: Any, n: int) -> tuple[Any, str | None]:
    """The run's ``--topology`` over ``n`` live replicas, and None; or, where it cannot be
    built on ``n`` nodes (a torus of 7), a ring (of two nodes: the complete graph) and why.

    The builders validate W (symmetric, doubly stochastic, connected) before it is used;
    an expander is re-drawn with the run's seed over the live count, and a time-varying
    graph (``onepeer-exp``, ``matching``) is built over the live set.
    """
    try:
        return assembly.build_topology(cfg, n), None
    except RunError as e:
        fallback = "ring" if n >= 3 else "complete"
        return topologies.build(fallback, n), f"{e}; falling back to {fallback}"


def _first_line(err: BaseException | None) -> str:
    """The first line of an error torchft reported (its wrapper appends a traceback)."""
    err = getattr(err, "original_exception", err)
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _replica_name(k: int) -> str:
    """torchft's replica id of replica ``k``: zero-padded, so that torchft's order of the
    group's ranks (by replica id, as strings) is the numeric order of ``k``."""
    return f"gossip_{k:05d}"


def _template(algo: Any) -> Any:
    """What the algorithm is: itself, or in replica groups the inner algorithm."""
    return getattr(algo, "template", algo)


def _inner_algorithms(algo: Any) -> list[Any]:
    """The algorithms this process runs: itself, or in replica groups those of its slices
    (none on a member other than 0 of an unsharded run)."""
    inners = getattr(algo, "inners", None)
    return [algo] if inners is None else list(inners.values())


def _iteration(algo: Any) -> int:
    """The algorithm's iteration ``t`` (a decentralized algorithm's)."""
    return int(algo.t) if hasattr(algo, "inners") else int(algo.state.t)


def _set_iteration(algo: Any, t: int) -> None:
    if hasattr(algo, "inners"):
        algo.t = t
    for inner in _inner_algorithms(algo):
        inner.state.t = t


def _intra_communicator(spec: ReplicaSpec, device: Any) -> Any:
    """A communicator over the replica group's members (torchrun's process group of the
    launch), with a ledger of its own: the traffic inside the group."""
    from gossip.comm import DistCommunicator, Ledger

    return DistCommunicator(None, timeout=spec.timeout, device=device,
                            ledger=Ledger([spec.member], spec.group_size))


def _share_address(host: str, port: int) -> tuple[str, int]:
    """Member 0's store address (``host``, ``port``: its own) to every member of the
    replica group, over the group's process group."""
    import torch.distributed as dist

    buf = torch.zeros(258, dtype=torch.uint8)
    raw = host.encode()[:256]
    buf[0], buf[1] = port >> 8, port & 0xFF
    buf[2:2 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    dist.broadcast(buf, src=0)
    got = bytes(buf[2:].tolist()).rstrip(b"\0").decode()
    return got, (int(buf[0]) << 8) | int(buf[1])


def _spectral_gap(topo: Any) -> float | None:
    """1 - rho of a static graph; None for a time-varying one (no single W)."""
    try:
        return None if is_time_varying(topo) else float(topo.spectral_gap)
    except Exception:  # noqa: BLE001 - a figure for the log, never a reason to stop
        return None


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
    """Run one replica of a ``--fault-tolerance`` run (:class:`FaultTolerantRun`); its
    summary on replica 0, None elsewhere.

    Raises:
        gossip.errors.RunError: one line for every failure the user can act on (torchft
            missing, a replica environment or ``--algo`` setting that cannot run, no
            Lighthouse at the address, a quorum below ``--min-replicas`` for ``--timeout``).
    """
    spec = replica_spec(cfg)
    resume = cfg.run.resume
    if resume not in (None, RESUME_AUTO) and not Path(resume).is_dir():
        raise RunError(f"--resume {resume!r}: no such run directory")
    if spec.group_size > 1:  # the replica group's members: torchrun's processes of this launch (gloo)
        from gossip.comm import init_from_env

        init_from_env("gloo", timeout=max(60.0, 3 * spec.timeout))
    env = ReplicaEnv(world_size=spec.replicas * spec.group_size, distributed=False, rank=spec.node)
    device = assembly.choose_device(cfg, env)
    dataset = assembly.build_dataset(cfg)
    comm = FTCommunicator(None, None, spec.replica, spec.replicas, spec.timeout)
    # the configured graph over every replica: the records' topology and, as in every mode, the
    # epoch line's ratio to full-precision D-PSGD's bytes per node per step on it
    topo = live_topology(cfg, spec.replicas)[0] if algorithms.is_decentralized(cfg.algorithm.name) else None
    return FaultTolerantRun(cfg, env, topo, device, dataset, comm, hooks=replica_hooks(spec)).train()
