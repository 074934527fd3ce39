"""The collectives of one ``--fault-tolerance`` replica, over torchft's re-formed group.

torchft's ``Manager`` manages one operation, ``allreduce``: it turns a failure into a
discarded step. Its process group (``torchft.process_group.ProcessGroupGloo``, re-formed
over the live replicas at every quorum change) is an ordinary c10d ``ProcessGroup``,
which also carries ``send``/``recv``, ``allgather`` and ``broadcast``; nothing in torchft
addresses one peer or watches those. :class:`FTCommunicator` therefore posts every
operation on that group directly, the narrowest layer of torch.distributed that carries
them, and manages failures itself the way the Manager does: an error is reported to the
Manager (the step's ``should_commit`` says no) and the operation returns a well-formed
but meaningless result that the discarded step throws away.

One thing it adds: a replica whose operation fails **aborts the group at once**
(``ProcessGroup.abort`` after dropping the failed work, which closes gloo's
connections). A peer that was waiting on this replica then fails too, and aborts in
turn, so a failure spreads through the whole group in milliseconds instead of leaving
the survivors that were not the dead worker's direct peers blocked until ``--timeout``
(gloo's ring all-reduce: only the dead worker's ring neighbours see its connection
drop). torchft reconfigures an aborted group at the next quorum, whose id changes
because the step's commit failed.

Node ids: within a quorum the communicator is rank ``i`` of ``n`` live replicas, sorted
by replica id (torchft's own order of the group's ranks, kept equal to the numeric
order by zero-padded replica names); the ledger counts by replica id ``0 .. N-1`` across
quorums (:class:`_LiveLedger` translates).
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from gossip.comm.base import Communicator, Handle, Received, Done, is_time_varying, ring_allreduce_bytes, tensor_nbytes
from gossip.comm.ledger import Ledger

__all__ = ["FTCommunicator"]

_TAG_PAYLOAD = 0x6751  # + (step & 1): two overlapped exchanges never share a tag


class _LiveLedger:
    """The run's ledger seen through one quorum: node ids are live ranks ``0 .. n-1``
    here and replica ids in the ledger underneath."""

    def __init__(self, ledger: Ledger, members: list[int]) -> None:
        self._ledger, self._ids = ledger, np.asarray(members, dtype=np.int64)

    def record(self, src: Any, dst: Any, nbytes: Any, *, op: str = "exchange") -> None:
        s = self._ids[np.asarray(src, dtype=np.int64)]
        d = self._ids[np.asarray(dst, dtype=np.int64)]
        self._ledger.record(s, d, nbytes, op=op)

    def __getattr__(self, name: str) -> Any:  # phases, setup(), count, totals: the run's ledger
        return getattr(self._ledger, name)


class _FTHandle(Handle):
    """A posted operation; ``wait`` never raises for a peer's failure (see the module)."""

    def __init__(self, comm: FTCommunicator, works: list[Any], what: str, finish: Any, fallback: Any) -> None:
        self._comm, self._works, self._what = comm, works, what
        self._finish, self._fallback, self._result = finish, fallback, None

    def wait(self) -> Any:
        if self._result is None:
            ok = self._works is not None and self._comm._wait(self._works, self._what)
            self._works = []  # the failed works must not keep the aborted group alive
            self._result = self._finish() if ok else self._fallback()
        return self._result

    def is_completed(self) -> bool:
        return self._result is not None or all(w.is_completed() for w in self._works or [])


class FTCommunicator(Communicator):
    """One replica's collectives over the live replicas of the step (see the module).

    ``reconfigure(members, topology)`` is called at every quorum change: ``rank`` and
    ``world_size`` become this replica's place among ``members`` and their number, and
    ``topology`` (over ``len(members)`` nodes, or None for a centralized algorithm) gives
    the neighbours of ``neighbor_exchange``. ``all_reduce`` with ``op="mean"`` averages
    over the live replicas, as torchft's ``Manager.allreduce`` does. The sharded exchange
    (shards owned by rank) is not carried: a quorum change would re-assign the shards.

    Args:
        manager: the replica's ``torchft.Manager``; errors are reported to it (None
            until :meth:`attach`; only :meth:`offline` works without it).
        pg: the Manager's reconfigurable process group (likewise).
        replica: this replica's id ``k`` in ``0 .. replicas-1``.
        replicas: the number of replicas the run was configured with.
        timeout: seconds one operation may take before it counts as failed.
    """

    def __init__(self, manager: Any, pg: Any, replica: int, replicas: int, timeout: float) -> None:
        self.manager, self.pg, self.replica = manager, pg, int(replica)
        self.replicas, self.timeout = int(replicas), float(timeout)
        self.run_ledger = Ledger(nodes=(self.replica,), world_size=self.replicas)
        self.aborts = 0  # groups this replica aborted after a failure
        self._offline = False
        self.reconfigure([self.replica], None)

    def attach(self, manager: Any, pg: Any) -> None:
        """The Manager and its process group, once started (the communicator is built
        before, offline, so that the algorithm is built and checked before anything connects)."""
        self.manager, self.pg = manager, pg

    def reconfigure(self, members: list[int], topology: Any) -> None:
        if self.replica not in members:
            raise ValueError(f"replica {self.replica} is not among the quorum's members {members}")
        if topology is not None and int(topology.n) != len(members):
            raise ValueError(f"the topology has {topology.n} nodes for {len(members)} live replicas")
        self.members = sorted(int(k) for k in members)
        self.rank, self.world_size = self.members.index(self.replica), len(self.members)
        self.nodes = torch.tensor([self.rank])
        self.topology = topology
        self.ledger = _LiveLedger(self.run_ledger, self.members)

    @contextlib.contextmanager
    def offline(self):
        """``with comm.offline(): ...``: nothing is sent or counted, every operation returns
        its fallback (the replica's own values). For building the optimizer before the first
        quorum exists; the replica state is then built with the quorum's neighbours."""
        self._offline = True
        try:
            yield self
        finally:
            self._offline = False

    # --- posting and waiting ---------------------------------------------------------
    def _post(self, what: str, start: Any) -> list[Any] | None:
        """The works ``start()`` posts; None (the fallback result) when the step has already
        failed (as torchft does after a first error: later operations are no-ops) or offline."""
        if self._offline or self.manager.errored() is not None:
            return None
        try:
            return start()
        except Exception as e:  # noqa: BLE001 - a peer's failure at posting (connection closed)
            self._fail(e, what)
            return None

    def _wait(self, works: list[Any], what: str) -> bool:
        error = None
        for i in range(len(works)):
            try:
                works[i].wait(timedelta(seconds=self.timeout))
            except Exception as e:  # noqa: BLE001 - a peer died or stopped answering
                error = e
                break
        if error is None:
            return True
        works.clear()  # no reference to a work may outlive the abort: it keeps the connections open
        self._fail(error, what)
        return False

    def _fail(self, e: BaseException, what: str) -> None:
        """Report to the Manager (the step is discarded) and abort the group, so that the
        peers waiting on this replica fail now rather than at their timeout."""
        text = str(e).strip()
        self.manager.report_error(RuntimeError(f"{what}: {text.splitlines()[0][:200] if text else type(e).__name__}"))
        try:
            self.pg.abort()
            self.aborts += 1
        except Exception:  # noqa: BLE001 - already aborted or never configured
            pass

    # --- the operations ----------------------------------------------------------------
    def all_reduce_async(self, X: torch.Tensor, op: str = "sum", *, record: bool = True) -> Handle:
        from torch.distributed import AllreduceOptions, ReduceOp

        self._check_reduce(X, op)
        n, record = self.world_size, record and not self._offline
        with self.ledger.phase("communicate"):
            Y = X.clone(memory_format=torch.contiguous_format)
            if n == 1:
                return Done(Y)
            opts = AllreduceOptions()
            opts.reduceOp = ReduceOp.SUM  # gloo has no AVG: divide below
            works = self._post("all_reduce", lambda: [self.pg.allreduce([Y], opts)])
            if record:
                nbytes = ring_allreduce_bytes(tensor_nbytes(X), n)
                self.ledger.record(self.rank, (self.rank + 1) % n, nbytes, op="all_reduce")
                self.ledger.record((self.rank - 1) % n, self.rank, nbytes, op="all_reduce")
                self.ledger.count("all_reduce")
        finish = (lambda: Y.div_(n)) if op == "mean" else (lambda: Y)
        return _FTHandle(self, works, "all_reduce", finish, lambda: X.clone())

    def all_gather_async(self, X: torch.Tensor, *, record: bool = True) -> Handle:
        from torch._C._distributed_c10d import AllgatherOptions  # (not re-exported by torch.distributed)

        self._check_rows(X, "all_gather")
        n, record = self.world_size, record and not self._offline
        with self.ledger.phase("communicate"):
            Xc = X.contiguous()
            out = [torch.empty_like(Xc[0]) for _ in range(n)]
            if n == 1:
                return Done(Xc.clone())
            works = self._post("all_gather", lambda: [self.pg.allgather([out], [Xc[0]], AllgatherOptions())])
            if record:
                nbytes = (n - 1) * tensor_nbytes(X)
                self.ledger.record(self.rank, (self.rank + 1) % n, nbytes, op="all_gather")
                self.ledger.record((self.rank - 1) % n, self.rank, nbytes, op="all_gather")
                self.ledger.count("all_gather")
        return _FTHandle(self, works, "all_gather", lambda: torch.stack(out),
                         lambda: Xc[0].expand(n, *Xc.shape[1:]).clone())

    def broadcast_async(self, X: torch.Tensor, src: int, *, record: bool = True) -> Handle:
        from torch.distributed import BroadcastOptions

        self._check_rows(X, "broadcast")
        src, record = self._check_src(src), record and not self._offline
        with self.ledger.phase("communicate"):
            Y = X.clone(memory_format=torch.contiguous_format)
            opts = BroadcastOptions()
            opts.rootRank = src
            works = self._post("broadcast", lambda: [self.pg.broadcast([Y], opts)]) if self.world_size > 1 else None
            if record and self.world_size > 1:
                others = [j for j in range(self.world_size) if j != src]
                self.ledger.record(src, others if self.rank == src else self.rank, tensor_nbytes(X), op="broadcast")
                self.ledger.count("broadcast")
        return _FTHandle(self, works, "broadcast", lambda: Y, lambda: X.clone())

    def _peers(self, step: int | None) -> tuple[list[int], np.ndarray, list[int], int]:
        """``(receive from, their weights, send to, tag)``: the static neighbours, or the
        in- and out-neighbours of ``W(step)`` of a time-varying topology."""
        topo = self.topology
        if not is_time_varying(topo):
            idx, w = topo.padded_neighbors()
            deg = int(np.asarray(topo.degrees)[self.rank])
            peers = np.asarray(idx, dtype=np.int64)[self.rank, :deg]
            return peers.tolist(), np.asarray(w, dtype=np.float64)[self.rank, :deg], peers.tolist(), _TAG_PAYLOAD
        graph = self._graph(step, "neighbor_exchange")
        ids, w = graph.neighbors(self.rank)
        return (np.asarray(ids).tolist(), np.asarray(w, dtype=np.float64),
                np.asarray(graph.out_neighbors(self.rank)).tolist(), _TAG_PAYLOAD + (int(step) & 1))

    def neighbor_exchange_async(self, P: torch.Tensor, *, record: bool = True, step: int | None = None) -> Handle:
        """Point-to-point sends of ``P[0]`` to the neighbours over the quorum's group."""
        if self.topology is None:
            raise ValueError("FTCommunicator.neighbor_exchange: no topology (a centralized algorithm)")
        self._check_payload(P)
        src, w_in, dst, tag = self._peers(step)
        record = record and not self._offline
        with self.ledger.phase("communicate"):
            P = P.contiguous()
            nbytes, deg = int(P.shape[1]), len(src)
            buf = torch.empty((deg, nbytes), dtype=torch.uint8)

            def start() -> list[Any]:
                works = [self.pg.recv([buf[k]], j, tag) for k, j in enumerate(src)]
                return works + [self.pg.send([P[0]], j, tag) for j in dst]

            works = self._post("neighbor_exchange", start) if deg or dst else None
            if record:
                self.ledger.record(self.rank, dst, nbytes, op="exchange")
                self.ledger.count("exchange")
        received = Received(self.nodes, buf, torch.as_tensor(src, dtype=torch.int64),
                            torch.arange(deg, dtype=torch.int64).unsqueeze(0),
                            torch.as_tensor(w_in).unsqueeze(0), torch.tensor([deg], dtype=torch.int64))

        def finish() -> Received:
            if record:
                self.ledger.record(src, self.rank, nbytes, op="exchange")
            return received

        def fallback() -> Received:
            buf.copy_(P[0].expand_as(buf))  # well-formed payloads: the discarded step decodes them
            return received

        return _FTHandle(self, works, "neighbor_exchange", finish, fallback)

    def gather_group(self, X: torch.Tensor, size: int) -> torch.Tensor | None:
        """Every member's ``X`` (a 1-D tensor, the same shape and dtype on every member),
        by the member's rank in the re-formed group of ``size`` ranks: all of the quorum's
        replicas, a duplicate replica id or a healing one included, which the live
        membership (:meth:`reconfigure`) does not count. Not counted in the ledger (the
        replicas' agreement, not the algorithm's traffic). None when it failed: the error
        is reported and the group aborted, as for any operation."""
        from torch._C._distributed_c10d import AllgatherOptions

        X = X.contiguous()
        out = [torch.empty_like(X) for _ in range(size)]
        if size == 1:
            return X.unsqueeze(0).clone()
        works = self._post("agreement", lambda: [self.pg.allgather([out], [X], AllgatherOptions())])
        if works is None or not self._wait(works, "agreement"):
            return None
        return torch.stack(out)

    def sharded_exchange_async(self, P, in_nbytes, out_nbytes, server, *, record: bool = True) -> Handle:
        raise NotImplementedError(
            "the sharded exchange is not carried under --fault-tolerance: its shards are owned by rank and a quorum "
            "change would re-assign them; use --algo-opt exchange=allgather")

    def __repr__(self) -> str:
        return (f"FTCommunicator(replica={self.replica}, members={self.members}, "
                f"topology={getattr(self.topology, 'name', None)!r})")
