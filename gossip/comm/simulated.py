"""All ``n`` nodes in one process: exchange is free, collectives are row reductions.

The ledger still counts what a real run would put on the wire (docs/comm.md):
``nbytes`` per neighbour per exchange, a ring's 2(n-1)/n for an all-reduce,
(n-1) rows for an all-gather and one row per receiver for a broadcast, and the
16-byte size check per neighbour the first time a payload size is exchanged, so
that its ledger agrees with a distributed run's node by node.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .base import (Communicator, Handle, Received, Done, ring_allreduce_bytes, tensor_nbytes, is_time_varying,
                   size_check_key, split_check_key)
from .ledger import Ledger

_SIZE_MSG_BYTES = 16  # DistCommunicator's size check: two int64 each way

__all__ = ["SimulatedCommunicator"]


class SimulatedCommunicator(Communicator):
    """Hosts every node of a run in one process (``nodes = arange(n)``).

    Args:
        topology: a ``topologies.Topology`` (``n``, ``padded_neighbors()``), or None for
            a purely centralized run (then ``world_size`` is required and
            ``neighbor_exchange`` is unavailable).
        world_size: number of nodes when ``topology`` is None; must equal
            ``topology.n`` otherwise.
        device: where the index tensors live (the payloads' device is used when
            they differ).
        ledger: a ledger to record into (a fresh one by default).
        check_sizes: charge the ``control`` bytes a :class:`DistCommunicator` with the
            same setting spends agreeing on each new payload size (nothing is checked:
            all payloads of one call have one size by construction).
    """

    def __init__(
        self,
        topology: Any = None,
        *,
        world_size: int | None = None,
        device: torch.device | str = "cpu",
        ledger: Ledger | None = None,
        check_sizes: bool = True,
    ) -> None:
        if topology is None and world_size is None:
            raise ValueError(
                "SimulatedCommunicator: pass a `topology` or, for a centralized run, `world_size`"
            )
        n = int(topology.n) if topology is not None else int(world_size)  # type: ignore[arg-type]
        if world_size is not None and int(world_size) != n:
            raise ValueError(
                f"SimulatedCommunicator: `world_size` must equal topology.n = {n}, "
                f"got {world_size}"
            )
        if n < 1:
            raise ValueError(f"SimulatedCommunicator: the run needs at least 1 node, got {n}")
        self.world_size = n
        self.topology = topology
        self.device = torch.device(device)
        self.nodes = torch.arange(n, dtype=torch.int64, device=self.device)
        self.ledger = ledger if ledger is not None else Ledger(range(n), n)
        if tuple(self.ledger.nodes) != tuple(range(n)):
            raise ValueError("SimulatedCommunicator: `ledger` must host nodes 0..n-1")
        self._ring_next = (np.arange(n) + 1) % n
        self.check_sizes = bool(check_sizes)
        self._agreed: set[int] = set()
        self._agreed_splits: set[int] = set()
        self._tables: dict[torch.device, tuple[torch.Tensor, ...]] = {}
        #: time-varying topologies: (step key -> tables of W(t)), recent steps only
        self._step_tables: dict[tuple[int, torch.device], tuple[Any, ...]] = {}
        if topology is not None and is_time_varying(topology):
            if int(topology.n) != n:
                raise ValueError(f"SimulatedCommunicator: topology has n = {topology.n}, expected {n}")
        elif topology is not None:
            self._static_tables(topology, n)

    def _static_tables(self, topology: Any, n: int) -> None:
        """The fixed graph's neighbour table, checked, and its directed edges for the ledger."""
        idx, w = topology.padded_neighbors()
        # own, writable copies: topologies hands out read-only arrays
        idx = np.array(idx, dtype=np.int64).reshape(n, -1)
        w = np.array(w, dtype=np.float64).reshape(n, -1)
        deg = np.array(topology.degrees, dtype=np.int64).reshape(n)
        self._idx, self._w, self._deg = idx, w, deg
        real = np.arange(idx.shape[1])[None, :] < deg[:, None]
        # bit-identity with a distributed run rests on the ascending order
        later = np.where(real[:, 1:], idx[:, 1:], n)
        bad = (later <= idx[:, :-1]).any(axis=1) | (
            real & (idx == np.arange(n)[:, None])
        ).any(axis=1)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"SimulatedCommunicator: topology.padded_neighbors() row {i} must list "
                f"distinct neighbours other than {i} in ascending order, got "
                f"{idx[i, : deg[i]].tolist()}"
            )
        # every directed edge i -> j once, for the ledger
        self._edge_dst = idx[real]
        self._edge_src = np.broadcast_to(np.arange(n)[:, None], idx.shape)[real]

    def _table(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        t = self._tables.get(device)
        if t is None:
            t = (
                torch.as_tensor(self._idx, device=device),
                torch.as_tensor(self._w, device=device),
                torch.as_tensor(self._deg, device=device),
                self.nodes.to(device),
            )
            self._tables[device] = t
        return t

    def _step_table(self, graph: Any, device: torch.device) -> tuple[Any, ...]:
        """Tables of one step ``W(t)`` of a time-varying topology: padded in-neighbours
        (whom each node receives from, ascending) and their weights, and every
        directed edge sender -> receiver for the ledger."""
        key = (id(graph), device)
        t = self._step_tables.get(key)
        if t is None:
            n = self.world_size
            idx, w = graph.padded_neighbors()
            deg = np.array(graph.degrees, dtype=np.int64)  # own, writable copy
            real = np.arange(idx.shape[1])[None, :] < deg[:, None]
            src = idx[real]  # sender j of each received message ...
            dst = np.broadcast_to(np.arange(n)[:, None], idx.shape)[real]  # ... to receiver i
            t = (torch.as_tensor(idx, device=device), torch.as_tensor(w, device=device),
                 torch.as_tensor(deg, device=device), self.nodes.to(device), src, dst, graph)
            if len(self._step_tables) >= 64:
                self._step_tables.pop(next(iter(self._step_tables)))
            self._step_tables[key] = t
        return t

    # ---------------------------------------------------------------- exchange
    def neighbor_exchange_async(self, P: torch.Tensor, *, record: bool = True, step: int | None = None) -> Handle:
        if self.topology is None:
            raise ValueError(
                "SimulatedCommunicator.neighbor_exchange: this communicator has no topology "
                "(built for a centralized run)"
            )
        self._check_payload(P)
        if is_time_varying(self.topology):
            graph = self._graph(step, "neighbor_exchange")
            idx, w, deg, senders, edge_src, edge_dst, _ = self._step_table(graph, P.device)
        else:
            idx, w, deg, senders = self._table(P.device)
            edge_src, edge_dst = self._edge_src, self._edge_dst
        nbytes = int(P.shape[1])
        if self.check_sizes and nbytes not in self._agreed and edge_src.size:
            # what the distributed size check sends, charged once per run as there
            if self.ledger.once(size_check_key(nbytes)):
                self.ledger.record(edge_src, edge_dst, _SIZE_MSG_BYTES, op="control")
                self.ledger.count("control")
            self._agreed.add(nbytes)
        if record:
            self.ledger.record(edge_src, edge_dst, nbytes, op="exchange")
            self.ledger.count("exchange")
        return Done(Received(senders, P, senders, idx, w, deg))

    # ---------------------------------------------------------------- collectives
    def all_reduce_async(self, X: torch.Tensor, op: str = "sum", *, record: bool = True) -> Handle:
        self._check_reduce(X, op)
        S = X.sum(dim=0, keepdim=True).to(X.dtype)  # integers wrap as in the backend
        if op == "mean":
            S = S / self.world_size
        if record:
            b = ring_allreduce_bytes(tensor_nbytes(X), self.world_size)
            self._record_ring(b, "all_reduce")
        return Done(S.expand_as(X).clone())

    def all_gather_async(self, X: torch.Tensor, *, record: bool = True) -> Handle:
        self._check_rows(X, "all_gather")
        if record:
            self._record_ring((self.world_size - 1) * tensor_nbytes(X), "all_gather")
        return Done(X.clone())

    def broadcast_async(self, X: torch.Tensor, src: int, *, record: bool = True) -> Handle:
        self._check_rows(X, "broadcast")
        src = self._check_src(src)
        if record:
            others = np.delete(np.arange(self.world_size), src)
            self.ledger.record(src, others, tensor_nbytes(X), op="broadcast")
            self.ledger.count("broadcast")
        return Done(X[src : src + 1].expand_as(X).clone())

    def sharded_exchange_async(self, P, in_nbytes, out_nbytes, server, *, record: bool = True) -> Handle:
        ins, outs = self._check_sharded(P, in_nbytes, out_nbytes, server)
        if self.check_sizes and self.world_size > 1:
            key = hash((tuple(ins), tuple(outs)))
            if key not in self._agreed_splits:
                # what the distributed split check sends: one 16-byte all-gather, once per run
                if self.ledger.once(split_check_key(ins, outs)):
                    self._record_ring((self.world_size - 1) * _SIZE_MSG_BYTES, "control")
                self._agreed_splits.add(key)
        if record:
            self._sharded_records(ins, outs)
        # every node's server step, shard by shard; the senders are the rows of P,
        # ascending, as a distributed owner receives them
        replies, a = [], 0
        for j, (b_in, b_out) in enumerate(zip(ins, outs)):
            replies.append(self._serve(server, j, P[:, a:a + b_in], b_out))
            a += b_in
        return Done(torch.cat(replies) if replies else P.new_zeros(0))

    def _record_ring(self, nbytes: int, op: str) -> None:
        n = self.world_size
        if n > 1:
            self.ledger.record(np.arange(n), self._ring_next, nbytes, op=op)
        self.ledger.count(op)

    def __repr__(self) -> str:
        name = getattr(self.topology, "name", None)
        return f"SimulatedCommunicator(n={self.world_size}, topology={name!r})"
