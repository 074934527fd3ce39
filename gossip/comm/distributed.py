"""One node per process over torch.distributed: NCCL on CUDA, gloo on CPU.

Neighbour exchange is point-to-point: the payload row goes to every topology
neighbour and each neighbour's payload comes back into a
buffer sized from the payload itself (every node uses the same compressor, so the
sizes agree without a round trip per exchange; see "payload sizes" below).

On CUDA (NCCL) the sends and receives are posted with ``dist.batch_isend_irecv``,
which coalesces them into one NCCL group. On CPU (gloo) ``batch_isend_irecv`` is
a plain loop over ``isend``/``irecv``; we run that loop ourselves so that an op
that cannot even be posted (the connection to a crashed peer is closed) names its
peer, and the other neighbours still get their messages.

Waiting is bounded: every wait runs against a deadline of ``timeout`` seconds and a
peer that does not answer in time raises :class:`PeerTimeoutError` naming it.

Payload sizes: gloo sizes a receive from the posted buffer. A *shorter* message
completes silently (the buffer's tail is left as it was) and a *longer* one aborts
the receiving process inside gloo (``op.preamble.length <= op.nbytes``), which no
Python code can catch. So the first time a payload size is used, the neighbours
swap their sizes in a 16-byte message (tag ``_TAG_SIZE``) and a mismatch raises
:class:`PeerPayloadError` naming the peer before any payload is sent. Sizes that
have been agreed on are not checked again.

Chunks (``chunk_bytes``): gloo runs a send only once the peer has posted the matching
receive, and a receive announces itself with a small message on the same connection as
the bulk data, queued behind whatever that peer is already sending. Two ranks that
post big all-gathers or sharded exchanges at once can therefore leave a link idle
while the announcement of its next message waits behind the other direction's data
(``experiments/bench_ddp_overlap.py`` measures it against torch's all-reduce of the
same bytes, which gloo pipelines in small segments inside one operation). With ``chunk_bytes`` each
all-gather and each stage of a sharded exchange is posted as collectives of at most
that many bytes per peer, so less data queues ahead of an announcement. Each chunk
waits for its own announcement, so chunks should carry at least the link's
bandwidth times its round-trip time, since on a high-latency link small chunks cost
more than they save. The default (None) posts every message whole, and
:meth:`DistCommunicator.tune_chunks` measures the link and picks a chunk from its
bandwidth-delay product (what the DDP hook does by default). The bytes on the wire and
the results are the same either way.
"""

from __future__ import annotations

import math
import os
import zlib
from datetime import timedelta
from time import perf_counter
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .base import (Communicator, Handle, Received, Done, ring_allreduce_bytes, tensor_nbytes, is_time_varying,
                   size_check_key, split_check_key)
from gossip.errors import PeerConnectionError, PeerPayloadError, PeerTimeoutError, format_peers
from .ledger import Ledger

__all__ = ["DistCommunicator", "init_from_env", "shutdown"]

_TAG_PAYLOAD = 0x6701
_TAG_SIZE = 0x6702
_TAG_STEP = 0x6710  # time-varying exchanges: + (step & 1), so two overlapped steps never share a tag
_MAGIC = 0x676F73736970  # "gossip": marks a size-check message
_SIZE_MSG_BYTES = 16  # two int64: magic, payload bytes
_MIN_CHUNK = 1024  # bytes: smaller chunks are all per-collective overhead
_AUTO_MIN_CHUNK = 64 * 1024  # the smallest chunk tune_chunks picks
_PROBE_BYTES = 256 * 1024  # tune_chunks' bandwidth probe

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _back(Y: torch.Tensor, home: torch.device | None) -> torch.Tensor:
    """A collective's result on the device its input came from (see ``_on_backend``)."""
    return Y if home is None else Y.to(home)


def init_from_env(
    backend: str = "auto",
    *,
    timeout: float = 1800.0,
    device: torch.device | str | None = None,
) -> torch.device:
    """Create the default process group from torchrun's environment; return the device.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (default 0), ``MASTER_ADDR`` and
    ``MASTER_PORT``. ``backend="auto"`` picks the device first (``cuda:LOCAL_RANK``
    when CUDA is available, else CPU) and then NCCL iff that device is CUDA, gloo
    otherwise. ``timeout`` (seconds) is the process group's own timeout; the
    communicators use their own, usually shorter one. If a process group already
    exists it is kept and its device returned.
    """
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"init_from_env: `backend` must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    t = float(timeout)
    if not math.isfinite(t) or t <= 0:
        raise ValueError(f"init_from_env: `timeout` must be a positive number of seconds, got {timeout}")
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_from_env: environment variable(s) {', '.join(missing)} not set; "
            "launch with torchrun (e.g. `torchrun --nproc_per_node 4 -m gossip.train ...`)"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        if backend == "gloo" or (backend == "auto" and not torch.cuda.is_available()):
            device = torch.device("cpu")
        else:
            device = torch.device("cuda", local_rank)
    device = torch.device(device)
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"init_from_env: backend 'nccl' needs a CUDA device, got {device}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("init_from_env: a CUDA device was requested but CUDA is not available")
        torch.cuda.set_device(device)  # batch_isend_irecv on NCCL hangs without it
    if dist.is_initialized():
        return device
    _preload_before_init()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = _restart_store(world, timedelta(seconds=t))
    if store is None:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                timeout=timedelta(seconds=t))
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=t))
    return device


def _preload_before_init() -> None:
    """Import ``torch.distributed.nn.functional`` before the process group exists.

    That module binds ``group.WORLD`` as a default argument when it is imported. Imported
    after ``init_process_group`` (torch._dynamo imports it on the first compiled call,
    e.g. an optimizer's first step), it keeps the gloo process group referenced after
    ``destroy_process_group``; gloo's native threads then outlive the interpreter and
    the process aborts at exit ("terminate called without an active exception",
    SIGABRT). Imported before, it binds nothing that outlives the group.
    """
    import torch.distributed.nn.functional  # noqa: F401


def shutdown() -> None:
    """Tear the default process group down so that none of its native threads outlives
    the interpreter; a no-op when there is none. Safe on every exit path (success, error,
    SIGTERM): it waits for no peer.

    Why the order matters (gloo): a collective's tensors are held by the ``AsyncWork`` on
    gloo's worker thread, which drops it a moment *after* the waiting Python thread has
    returned. If Python has let go of the tensor by then, that drop frees a Python object
    and needs the GIL. Should the worker still be alive when the interpreter finalizes,
    CPython ends the thread with ``pthread_exit`` inside that C++ destructor, and the
    forced unwind through it calls ``std::terminate``: "terminate called without an
    active exception", SIGABRT, after a run that succeeded. So the worker threads must be
    joined *here*, while the interpreter is whole: ``destroy_process_group`` does it when
    it drops the last reference to the group. References it does not know of keep the
    group (and its threads) alive; the one torch itself makes, the default arguments of
    ``torch.distributed.nn.functional`` when it was imported after the group existed
    (torch._dynamo imports it on a first compiled call), is dropped here.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    pg = dist.group.WORLD
    dist.destroy_process_group()
    _forget_group(pg)
    del pg  # the last reference: the group's destructor joins its threads here


def _forget_group(pg: Any) -> None:
    """Drop the references to a destroyed group that outlive ``destroy_process_group``:
    default arguments bound to it (``torch.distributed.nn.functional`` imported after
    ``init_process_group``) become None, i.e. "the default group at call time", which is
    what they are when that module is imported first."""
    import sys

    mod = sys.modules.get("torch.distributed.nn.functional")
    for fn in list(vars(mod).values()) if mod is not None else ():
        defaults = getattr(fn, "__defaults__", None)
        if isinstance(defaults, tuple) and any(d is pg for d in defaults):
            fn.__defaults__ = tuple(None if d is pg else d for d in defaults)


def _restart_store(world_size: int, timeout: timedelta):
    """Under torchrun's elastic agent, the agent's store with a prefix per incarnation.

    The agent may keep one TCPStore for the whole job; ``env://`` connects to it without
    a prefix, so after a restart (``--max-restarts``) the new workers read the previous
    attempt's gloo addresses and ``connectFullMesh`` fails with "Connection refused"
    or hangs. ``TORCHELASTIC_RESTART_COUNT`` cannot name the attempt: across hosts it
    differs, as an agent counts only the restarts its own workers' failures caused, not
    those it makes when another host's agent asks for a new round. Every round
    restarts every worker of every host, so each rank counts its own incarnations in
    the store (``gossip/incarnations/<rank>``): the n-th worker of every rank meets the
    others under ``gossip/incarnation_<n>``. None outside the elastic agent (``env://``).
    """
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                         is_master=False, timeout=timeout)
    incarnation = base.add(f"gossip/incarnations/{os.environ['RANK']}", 1)
    return dist.PrefixStore(f"gossip/incarnation_{incarnation}", base)


class DistCommunicator(Communicator):
    """One node per rank (``nodes = [rank]``) over an existing process group.

    Args:
        topology: a ``topologies.Topology`` with ``n == world size``; None for a purely
            centralized run (then ``neighbor_exchange`` is unavailable).
        group: the process group (default: the default group); node ids are ranks in it.
        device: device of the ``nodes`` tensor; default CUDA (current device) for an
            NCCL group, else CPU. Payloads, size checks and collectives run on the
            device of the tensors passed in.
        timeout: seconds any one exchange or collective may take once waited on
            before :class:`PeerTimeoutError` is raised. After a timeout the pending
            receives stay posted in the backend: the communicator refuses further
            work and the process group should be destroyed.
        check_sizes: agree on payload sizes with the neighbours the first time
            each size is used (see the module docstring); keep it on.
        ledger: a ledger hosting ``[rank]`` (a fresh one by default).
        pull_group: a second process group over the same ranks, for the sharded
            exchanges' pulls (their second stage). Collectives pair up by the order
            each rank posts them in a group; with the pulls in a group of their own, a
            rank may post an exchange's pull as soon as its push has arrived
            (:meth:`Handle.ready`), out of step with its peers' later pushes. Without it
            every stage goes through ``group``, in the same order on every rank.
        chunk_bytes: None (default) to post every all-gather and sharded-exchange
            stage whole, or the most bytes per peer that one collective carries (see
            "Chunks" in the module docstring; gloo links of low bandwidth and low
            latency gain, >= 1024).
    """

    def __init__(
        self,
        topology: Any = None,
        *,
        group: Any = None,
        device: torch.device | str | None = None,
        timeout: float = 300.0,
        check_sizes: bool = True,
        ledger: Ledger | None = None,
        pull_group: Any = None,
        chunk_bytes: int | None = None,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "DistCommunicator: no process group; call gossip.comm.init_from_env() "
                "(under torchrun) or torch.distributed.init_process_group() first"
            )
        t = float(timeout)
        if not math.isfinite(t) or t <= 0:
            raise ValueError(f"DistCommunicator: `timeout` must be a positive number of seconds, got {timeout}")
        self.chunk_bytes = _check_chunk(chunk_bytes)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = n = dist.get_world_size(group)
        self._pull_group = _check_pull_group(pull_group, self.rank, n)
        self.backend = str(dist.get_backend(group))
        if device is None:
            use_cuda = "nccl" in self.backend and torch.cuda.is_available()
            device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else "cpu"
        self.device = torch.device(device)
        self.timeout = t
        self.check_sizes = bool(check_sizes)
        self.topology = topology
        self.nodes = torch.tensor([self.rank], dtype=torch.int64, device=self.device)
        self.ledger = ledger if ledger is not None else Ledger([self.rank], n)
        if tuple(self.ledger.nodes) != (self.rank,) or self.ledger.world_size != n:
            raise ValueError(f"DistCommunicator: `ledger` must host exactly node {self.rank} of {n}")
        self._global = [dist.get_global_rank(group, j) if group is not None else j for j in range(n)]
        self._agreed: set[int] = set()
        self._agreed_splits: set[tuple] = set()
        self._broken: str | None = None
        self._peers = np.zeros(0, dtype=np.int64)
        self._w = np.zeros(0, dtype=np.float64)
        if topology is not None and int(topology.n) != n:
            raise ValueError(
                f"DistCommunicator: topology has n = {topology.n} nodes but the process "
                f"group has {n} ranks"
            )
        if topology is not None and not is_time_varying(topology):
            idx, w = topology.padded_neighbors()
            deg = int(np.asarray(topology.degrees)[self.rank])
            # the same rows the simulation uses, so the weights are the same numbers
            self._peers = np.asarray(idx, dtype=np.int64)[self.rank, :deg].copy()
            self._w = np.asarray(w, dtype=np.float64)[self.rank, :deg].copy()
            if deg and (np.any(np.diff(self._peers) <= 0) or self.rank in self._peers):
                raise ValueError(
                    f"DistCommunicator: topology.padded_neighbors() row {self.rank} must list "
                    f"distinct neighbours in ascending order, got {self._peers.tolist()}"
                )

    @property
    def has_pull_group(self) -> bool:
        """Whether the sharded exchanges' pulls run in a process group of their own
        (``pull_group``), so a pull can be posted while a later push is on the wire."""
        return self._pull_group is not None

    @property
    def neighbors(self) -> tuple[int, ...]:
        """This rank's neighbours, ascending (static topologies)."""
        return tuple(int(j) for j in self._peers)

    def _step_peers(self, step: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """``(receive from, their weights, send to, tag)`` of this exchange: the static
        neighbours, or this rank's in- and out-neighbours of ``W(step)``."""
        if not is_time_varying(self.topology):
            return self._peers, self._w, self._peers, _TAG_PAYLOAD
        graph = self._graph(step, "neighbor_exchange")
        ids, w = graph.neighbors(self.rank)  # the simulation's rows: same weights, same order
        return ids, w, graph.out_neighbors(self.rank), _TAG_STEP + (int(step) & 1)

    def pair_channel(self) -> Any:
        """A :class:`gossip.comm.pairs.PairChannel` over this communicator's ranks, for
        pairwise exchanges with no global barrier (AD-PSGD); a collective of every rank."""
        from .pairs import PairChannel

        self._check_usable()
        return PairChannel.create(self.group, self.timeout)

    # ---------------------------------------------------------------- exchange
    def neighbor_exchange_async(self, P: torch.Tensor, *, record: bool = True, step: int | None = None) -> Handle:
        """Post sends of ``P[0]`` to every neighbour and receives of theirs.

        ``P`` must not be modified until the handle is waited on. On a time-varying
        topology the sends go to the out-neighbours of ``W(step)`` and the receives come
        from its in-neighbours (one each on the one-peer and matching graphs).
        """
        self._check_usable()
        if self.topology is None:
            raise ValueError(
                "DistCommunicator.neighbor_exchange: this communicator has no topology "
                "(built for a centralized run)"
            )
        self._check_payload(P)
        src, w_in, dst, tag = self._step_peers(step)
        with self.ledger.phase("communicate"):
            P = P.contiguous()
            nbytes = int(P.shape[1])
            if self.check_sizes and nbytes not in self._agreed and (src.size or dst.size):
                self._agree_size(nbytes, P.device, src, dst)
            deg = int(src.size)
            buf = torch.empty((deg, nbytes), dtype=torch.uint8, device=P.device)
            recv_from, send_to = src.tolist(), dst.tolist()
            ops = [dist.P2POp(dist.irecv, buf[k], self._global[j], self.group, tag)
                   for k, j in enumerate(recv_from)]
            ops += [dist.P2POp(dist.isend, P[0], self._global[j], self.group, tag)
                    for j in send_to]
            posted = self._post(ops, recv_from + send_to, "neighbor_exchange") if ops else None
            if record:
                self.ledger.record(self.rank, dst, nbytes, op="exchange")
                self.ledger.count("exchange")
        received = Received(
            self.nodes.to(P.device),
            buf,
            torch.as_tensor(src, device=P.device),
            torch.arange(deg, dtype=torch.int64, device=P.device).unsqueeze(0),
            torch.as_tensor(w_in, device=P.device).unsqueeze(0),
            torch.tensor([deg], dtype=torch.int64, device=P.device),
        )
        if posted is None:
            return Done(received)
        return _ExchangeHandle(self, posted, received, nbytes, record, src)

    def _agree_size(self, nbytes: int, device: torch.device, src: np.ndarray, dst: np.ndarray) -> None:
        """Swap payload sizes with the neighbours (one 16-byte message each way): send
        ours to ``dst`` (whom we send payloads to), receive from ``src``."""
        peers = src.tolist()
        mine = torch.tensor([_MAGIC, nbytes], dtype=torch.int64, device=device)
        theirs = torch.zeros((len(peers), 2), dtype=torch.int64, device=device)
        ops = [dist.P2POp(dist.irecv, theirs[k], self._global[j], self.group, _TAG_SIZE)
               for k, j in enumerate(peers)]
        ops += [dist.P2POp(dist.isend, mine, self._global[j], self.group, _TAG_SIZE) for j in dst.tolist()]
        self._wait(self._post(ops, peers + dst.tolist(), "neighbor_exchange (payload size check)"))
        if self.ledger.once(size_check_key(nbytes)):  # once per run: a resumed process checks again
            self.ledger.record(self.rank, dst, _SIZE_MSG_BYTES, op="control")
            self.ledger.record(src, self.rank, _SIZE_MSG_BYTES, op="control")
            self.ledger.count("control")
        got = theirs.cpu().tolist()
        bad = [(j, g) for j, g in zip(peers, got) if g[0] != _MAGIC or g[1] != nbytes]
        if bad:
            detail = ", ".join(
                f"rank {j} sends {g[1]} bytes" if g[0] == _MAGIC else f"rank {j} sent no size header"
                for j, g in bad
            )
            raise PeerPayloadError(
                f"payload size mismatch at rank {self.rank}: it sends {nbytes} bytes per payload "
                f"but {detail} (different compressor, parameters or model size?)",
                [j for j, _ in bad],
                "neighbor_exchange",
            )
        self._agreed.add(nbytes)

    # ---------------------------------------------------------------- collectives
    def all_reduce_async(self, X: torch.Tensor, op: str = "sum", *, record: bool = True) -> Handle:
        """Sum (then divide by ``n`` for ``"mean"``) over all ranks; gloo has no AVG."""
        self._check_usable()
        self._check_reduce(X, op)
        with self.ledger.phase("communicate"):
            Y, home = self._on_backend(X)
            Y = Y.clone(memory_format=torch.contiguous_format)
            work = self._post_collective(
                "all_reduce", lambda: dist.all_reduce(Y, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            )
            if record:
                self._record_ring(ring_allreduce_bytes(tensor_nbytes(X), self.world_size), "all_reduce")
        n = self.world_size
        finish = (lambda: _back(Y.div_(n), home)) if op == "mean" else (lambda: _back(Y, home))
        return _CollectiveHandle(self, work, "all_reduce", finish)

    def _on_backend(self, X: torch.Tensor) -> tuple[torch.Tensor, torch.device | None]:
        """NCCL carries CUDA tensors only: a CPU tensor (the training loop's agreement and
        control flags) travels through the communicator's device; returns the tensor to
        send and the device to bring the result back to (None: no move)."""
        if X.device.type == "cpu" and self.device.type == "cuda" and "nccl" in self.backend:
            return X.to(self.device), X.device
        return X, None

    def all_gather_async(self, X: torch.Tensor, *, record: bool = True) -> Handle:
        self._check_usable()
        self._check_rows(X, "all_gather")
        with self.ledger.phase("communicate"):
            Xc, home = self._on_backend(X)
            Xc = Xc.contiguous()
            out = torch.empty((self.world_size, *X.shape[1:]), dtype=X.dtype, device=Xc.device)
            work = self._post_collective("all_gather", lambda: self._all_gather(out, Xc))
            if record:
                self._record_ring((self.world_size - 1) * tensor_nbytes(X), "all_gather")
        return _CollectiveHandle(self, work, "all_gather", lambda: _back(out, home))

    def broadcast_async(self, X: torch.Tensor, src: int, *, record: bool = True) -> Handle:
        self._check_usable()
        self._check_rows(X, "broadcast")
        src = self._check_src(src)
        with self.ledger.phase("communicate"):
            Y, home = self._on_backend(X)
            Y = Y.clone(memory_format=torch.contiguous_format)
            work = self._post_collective(
                "broadcast", lambda: dist.broadcast(Y, src=self._global[src], group=self.group, async_op=True)
            )
            if record:
                b = tensor_nbytes(X)
                if self.rank == src:
                    others = np.delete(np.arange(self.world_size), src)
                    self.ledger.record(src, others, b, op="broadcast")
                else:
                    self.ledger.record(src, self.rank, b, op="broadcast")
                self.ledger.count("broadcast")
        return _CollectiveHandle(self, work, "broadcast", lambda: _back(Y, home))

    def sharded_exchange_async(self, P, in_nbytes, out_nbytes, server, *, record: bool = True) -> Handle:
        """Post the push (``all_to_all_single`` with this rank's message of every shard);
        the handle serves this rank's shard when the push has arrived, then posts and
        waits the pull (a second ``all_to_all_single`` carrying the reply to every rank)."""
        self._check_usable()
        ins, outs = self._check_sharded(P, in_nbytes, out_nbytes, server)
        n, r = self.world_size, self.rank
        with self.ledger.phase("communicate"):
            src = P[0].contiguous()
            if self.check_sizes and n > 1:
                self._agree_splits(ins, outs, src.device)
            pushed = torch.empty((n, ins[r]), dtype=torch.uint8, device=src.device)
            work = None
            if n > 1:
                work = self._post_collective("sharded_exchange (push)", lambda: self._all_to_all(
                    pushed.view(-1), src, [ins[r]] * n, ins, self.group))
            else:
                pushed.copy_(src.view(1, -1))
            if record:
                self._sharded_records(ins, outs)
        return _ShardedHandle(self, work, pushed, server, outs)

    def tune_chunks(self) -> int | None:
        """Measure the link and set :attr:`chunk_bytes` from it (gloo only: NCCL and a
        world of one keep whole messages); returns the setting. Every rank of the group
        must call it at the same point, like a collective. Three 1-byte all-reduces give
        the round trip (their fastest), one of :data:`_PROBE_BYTES` the bandwidth; the
        chunk is :func:`auto_chunk_bytes` of the two, the largest any rank found, so
        every rank cuts its messages alike. The probes are not in the ledger."""
        if self.world_size < 2 or "gloo" not in self.backend:
            self.chunk_bytes = None
            return None
        self._check_usable()
        n = self.world_size
        tiny, big = torch.zeros(1, dtype=torch.uint8), torch.zeros(_PROBE_BYTES, dtype=torch.uint8)
        rtt = math.inf
        for _ in range(3):
            rtt = min(rtt, self._probe(tiny))
        seconds = max(self._probe(big) - rtt, 1e-6)
        bandwidth = 2 * (n - 1) / n * _PROBE_BYTES / seconds  # a ring all-reduce's bytes per rank
        chunk = torch.tensor([auto_chunk_bytes(bandwidth, rtt)], dtype=torch.int64)
        self._probe(chunk, dist.ReduceOp.MAX)
        self.chunk_bytes = int(chunk)
        return self.chunk_bytes

    def _probe(self, X: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> float:
        """Seconds for one all-reduce of ``X`` (in place), not in the ledger, waited within
        the timeout like any collective (a peer that is gone is named)."""
        others = [j for j in range(self.world_size) if j != self.rank]
        t0 = perf_counter()
        work = self._post_collective("tune_chunks", lambda: dist.all_reduce(X, op=op, group=self.group,
                                                                            async_op=True))
        self._wait(_Posted([work], [others], "tune_chunks"))
        return perf_counter() - t0

    def _pieces(self, nbytes: int) -> int:
        """How many collectives carry a message of ``nbytes`` per peer (``chunk_bytes``)."""
        if self.chunk_bytes is None or nbytes <= self.chunk_bytes:
            return 1
        return -(-nbytes // self.chunk_bytes)

    def _all_gather(self, out: torch.Tensor, X: torch.Tensor) -> Any:
        """Post the all-gather of the row ``X`` into ``out`` (one row per rank): whole, or
        in ``chunk_bytes`` pieces written straight into their places in ``out``."""
        pieces = self._pieces(tensor_nbytes(X))
        if pieces == 1:
            return _all_gather_single(out, X, group=self.group, async_op=True)
        flat, rows = X.reshape(-1), out.view(self.world_size, -1)
        cuts = _cuts(flat.numel(), min(pieces, flat.numel()))
        return _Chunked([dist.all_gather([rows[j, a:b] for j in range(self.world_size)], flat[a:b],
                                         group=self.group, async_op=True) for a, b in zip(cuts, cuts[1:])])

    def _all_to_all(self, out: torch.Tensor, src: torch.Tensor, out_splits: list[int], in_splits: list[int],
                    group: Any) -> Any:
        """Post ``all_to_all_single`` of the flat uint8 ``src`` into ``out``: whole, or as
        collectives carrying a ``chunk_bytes`` piece of every peer's split each. The
        number of pieces comes from the largest split, which every rank knows alike
        (the splits are the same shard plan everywhere); the pieces received are copied
        into their places in ``out`` once they have all arrived."""
        pieces = self._pieces(max(in_splits + out_splits))
        if pieces == 1:
            return dist.all_to_all_single(out, src, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                          group=group, async_op=True)
        in_at, out_at = np.cumsum([0, *in_splits]).tolist(), np.cumsum([0, *out_splits]).tolist()
        in_cuts, out_cuts = [_cuts(k, pieces) for k in in_splits], [_cuts(k, pieces) for k in out_splits]
        works, received = [], []
        for c in range(pieces):
            ins_c = [cut[c + 1] - cut[c] for cut in in_cuts]
            outs_c = [cut[c + 1] - cut[c] for cut in out_cuts]
            part = torch.cat([src[in_at[j] + cut[c]:in_at[j] + cut[c + 1]] for j, cut in enumerate(in_cuts)])
            got = torch.empty(sum(outs_c), dtype=out.dtype, device=out.device)
            works.append(dist.all_to_all_single(got, part, output_split_sizes=outs_c, input_split_sizes=ins_c,
                                                group=group, async_op=True))
            received.append((c, got))

        def place() -> None:
            for c, got in received:
                at = 0
                for j, cut in enumerate(out_cuts):
                    k = cut[c + 1] - cut[c]
                    out[out_at[j] + cut[c]:out_at[j] + cut[c + 1]].copy_(got[at:at + k])
                    at += k

        return _Chunked(works, place)

    def _sharded_records(self, in_nbytes: list[int], out_nbytes: list[int]) -> None:
        # only the messages this rank sends or receives (the others are foreign anyway)
        n, r = self.world_size, self.rank
        if n > 1:
            others = np.delete(np.arange(n), r)
            ins, outs = np.asarray(in_nbytes, dtype=np.int64), np.asarray(out_nbytes, dtype=np.int64)
            self.ledger.record(r, others, ins[others], op="shard_push")
            self.ledger.record(others, r, ins[r], op="shard_push")
            self.ledger.record(r, others, outs[r], op="shard_pull")
            self.ledger.record(others, r, outs[others], op="shard_pull")
        self.ledger.count("shard_push")
        self.ledger.count("shard_pull")

    def _agree_splits(self, ins: list[int], outs: list[int], device: torch.device) -> None:
        """The first time a split signature is used, every rank checks that all ranks use
        it: gloo aborts the process on a message longer than its buffer, so a rank with
        another compressor or model is named before any payload moves (16 bytes each)."""
        sig = (tuple(ins), tuple(outs))
        if sig in self._agreed_splits:
            return
        digest = zlib.crc32(np.asarray(ins + outs, dtype=np.int64).tobytes())
        mine = torch.tensor([[_MAGIC, digest]], dtype=torch.int64, device=device)
        everyone = self.all_gather(mine, record=False)
        if self.ledger.once(split_check_key(ins, outs)):
            self._record_ring((self.world_size - 1) * _SIZE_MSG_BYTES, "control")
        bad = [j for j, (mg, dg) in enumerate(everyone.cpu().tolist()) if mg != _MAGIC or dg != digest]
        if bad:
            raise PeerPayloadError(
                f"sharded exchange at rank {self.rank}: {format_peers(bad)} cut the payloads into other "
                f"shard sizes than this rank ({sum(ins)} bytes pushed in {len(ins)} shards; different "
                "compressor, parameters or model size?)",
                bad, "sharded_exchange")
        self._agreed_splits.add(sig)

    def _record_ring(self, nbytes: int, op: str) -> None:
        n, r = self.world_size, self.rank
        if n > 1:  # ring model: to the successor, from the predecessor
            self.ledger.record(r, (r + 1) % n, nbytes, op=op)
            self.ledger.record((r - 1) % n, r, nbytes, op=op)
        self.ledger.count(op)

    # ---------------------------------------------------------------- posting, waiting
    def _post(self, ops: list[Any], peers: list[int], what: str) -> _Posted:
        """Post point-to-point ops; ``peers[i]`` is the peer of ``ops[i]``."""
        if ops[0].tensor.device.type == "cuda":
            try:
                works = dist.batch_isend_irecv(ops)
            except RuntimeError as exc:  # one NCCL group: cannot tell which peer
                if _peer_failure(exc) is None:
                    raise
                return _Posted([], [], what, set(peers), exc)
            if len(works) == len(ops):
                return _Posted(works, [[j] for j in peers], what)
            return _Posted(works, [sorted(set(peers))] * len(works), what)
        works, work_peers, lost, first = [], [], set(), None
        for op, j in zip(ops, peers):
            try:
                works.append(op.op(op.tensor, op.peer, op.group, op.tag))
                work_peers.append([j])
            except RuntimeError as exc:  # e.g. "Connection closed by peer": keep posting
                if _peer_failure(exc) is None:
                    raise
                lost.add(j)
                first = first or exc
        return _Posted(works, work_peers, what, lost, first)

    def _post_collective(self, what: str, start: Any) -> Any:
        try:
            return start()
        except RuntimeError as exc:
            if _peer_failure(exc) is None:  # a usage error, not a peer's fault
                raise
            others = [j for j in range(self.world_size) if j != self.rank]
            self._wait(_Posted([], [], what, set(others), exc))  # raises, naming them
            raise

    def _wait(self, posted: _Posted) -> None:
        """Wait for every posted work within one deadline; name the peers that failed."""
        what = posted.what
        deadline = perf_counter() + self.timeout
        late: set[int] = set()
        lost: set[int] = set(posted.lost)
        first: BaseException | None = posted.first
        for work, ps in zip(posted.works, posted.peers):
            remaining = max(deadline - perf_counter(), 1e-3)
            try:
                ok = work.wait(timeout=timedelta(seconds=remaining))
            except RuntimeError as exc:  # gloo: "Timed out waiting ...", "Connection closed ..."
                first = first or exc
                (late if _peer_failure(exc) == "late" else lost).update(ps)
            else:
                if ok is False:
                    late.update(ps)
        detail = str(first) if first is not None else ""
        if lost:
            # gloo closes all of a rank's connections when one of its own waits fails, so
            # a closed connection is no proof that this peer is the one at fault
            also = f"; no answer from {format_peers(late - lost)} either" if late - lost else ""
            msg = (
                f"{what}: rank {self.rank} lost the connection to {format_peers(lost)}, which closed it "
                f"(crashed or killed, or stopped after a failure of its own or of a rank it waits on){also}"
            )
            self._broken = msg
            raise PeerConnectionError(msg, lost, what, detail) from first
        if late:
            waited = sorted({p for ps in posted.peers for p in ps})
            msg = (
                f"{what}: rank {self.rank} got no answer from {format_peers(late)} within "
                f"{self.timeout:g} s (waited for {format_peers(waited)})"
            )
            self._broken = msg
            raise PeerTimeoutError(msg, late, what, detail) from first

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise RuntimeError(
                f"DistCommunicator: unusable after an earlier failure ({self._broken}); "
                "destroy the process group and restart"
            )

    def __repr__(self) -> str:
        name = getattr(self.topology, "name", None)
        return (
            f"DistCommunicator(rank={self.rank}, world_size={self.world_size}, "
            f"backend={self.backend!r}, topology={name!r}, timeout={self.timeout:g})"
        )


def _check_pull_group(pull_group: Any, rank: int, n: int) -> Any:
    """``pull_group`` where it holds the communicator's ``n`` ranks with this one as
    ``rank``; else a ValueError saying what it holds."""
    if pull_group is not None and (dist.get_world_size(pull_group) != n or dist.get_rank(pull_group) != rank):
        raise ValueError(f"DistCommunicator: `pull_group` must hold the same ranks as `group`, in the same "
                         f"order; it has {dist.get_world_size(pull_group)} ranks, this one is rank "
                         f"{dist.get_rank(pull_group)} in it (rank {rank} of {n} in `group`)")
    return pull_group


def _peer_failure(exc: BaseException) -> str | None:
    """'late' for a timeout, 'lost' for a broken connection, None for anything else."""
    text = str(exc).lower()
    if "timed out" in text or "timeout" in text:
        return "late"
    if any(w in text for w in ("connection", "closed", "reset by peer", "broken pipe", "socket")):
        return "lost"
    return None


def auto_chunk_bytes(bandwidth: float, rtt: float) -> int:
    """The chunk :meth:`DistCommunicator.tune_chunks` picks for a link of ``bandwidth``
    bytes/s and round trip ``rtt`` s: four times their product, at least
    :data:`_AUTO_MIN_CHUNK`. gloo runs two collectives of a group at a time, each
    waiting half a round trip for its receiver's announcement, so two chunks keep the
    link busy once each carries half the bandwidth-delay product; four times leaves
    room for an underestimate of either figure. A link of large bandwidth-delay
    product gets chunks larger than its messages: whole messages."""
    return max(_AUTO_MIN_CHUNK, int(4 * bandwidth * rtt) // 1024 * 1024)


def _check_chunk(chunk_bytes: Any) -> int | None:
    if chunk_bytes is not None and (isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int)
                                    or chunk_bytes < _MIN_CHUNK):
        raise ValueError(f"DistCommunicator: `chunk_bytes` must be None (whole messages) or an int >= "
                         f"{_MIN_CHUNK}, got {chunk_bytes!r}")
    return chunk_bytes


def _cuts(size: int, pieces: int) -> list[int]:
    """Even cuts of ``size`` into ``pieces`` (some may be empty when size < pieces)."""
    return [size * c // pieces for c in range(pieces + 1)]


class _Chunked:
    """Several collectives that carry one message, waited as one work (the part of
    torch's ``Work`` that :meth:`DistCommunicator._wait` and the handles use).
    ``then`` runs once, on the waiting thread, after every piece has arrived."""

    __slots__ = ("works", "_then")

    def __init__(self, works: list[Any], then: Any = None) -> None:
        self.works, self._then = works, then

    def wait(self, timeout: timedelta | None = None) -> bool:
        end = None if timeout is None else perf_counter() + timeout.total_seconds()
        for w in self.works:
            ok = w.wait() if end is None else w.wait(timeout=timedelta(seconds=max(end - perf_counter(), 1e-3)))
            if ok is False:
                return False
        self._placed()
        return True

    def _placed(self) -> None:
        then, self._then = self._then, None
        if then is not None:
            then()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def get_future(self) -> torch.futures.Future:
        def placed(f: torch.futures.Future) -> None:
            f.wait()
            self._placed()

        return torch.futures.collect_all([w.get_future() for w in self.works]).then(placed)


class _Posted:
    """Works of one operation, the peers each one involves, and posting failures."""

    __slots__ = ("works", "peers", "what", "lost", "first")

    def __init__(
        self,
        works: list[Any],
        peers: list[list[int]],
        what: str,
        lost: set[int] | None = None,
        first: BaseException | None = None,
    ) -> None:
        self.works, self.peers, self.what = works, peers, what
        self.lost, self.first = lost or set(), first


class _ExchangeHandle(Handle):
    __slots__ = ("_comm", "_posted", "_received", "_nbytes", "_record", "_done", "_src")

    def __init__(
        self, comm: DistCommunicator, posted: _Posted, received: Received, nbytes: int, record: bool,
        src: np.ndarray,
    ) -> None:
        self._comm, self._posted, self._received = comm, posted, received
        self._nbytes, self._record, self._done, self._src = nbytes, record, False, src

    def wait(self) -> Received:
        if not self._done:
            comm = self._comm
            with comm.ledger.phase("wait"):  # blocked until the neighbours' payloads are here
                comm._wait(self._posted)
            if self._record:
                comm.ledger.record(self._src, comm.rank, self._nbytes, op="exchange")
            self._done = True
        return self._received

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._posted.works)


class _CollectiveHandle(Handle):
    __slots__ = ("_comm", "_work", "_what", "_finish", "_result")

    def __init__(self, comm: DistCommunicator, work: Any, what: str, finish: Any) -> None:
        self._comm, self._work, self._what, self._finish = comm, work, what, finish
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            comm = self._comm
            others = [j for j in range(comm.world_size) if j != comm.rank]
            with comm.ledger.phase("wait"):
                comm._wait(_Posted([self._work], [others], self._what))
            self._result = self._finish()
        return self._result

    def is_completed(self) -> bool:
        return self._result is not None or self._work.is_completed()

    def future(self) -> torch.futures.Future:
        """Completes with the result when the collective arrives, without blocking."""
        if self._result is not None:
            return super().future()
        finish = self._finish

        def done(f: torch.futures.Future) -> torch.Tensor:
            f.wait()
            return finish()

        return self._work.get_future().then(done)


class _ShardedHandle(Handle):
    """A sharded exchange in flight: the push is posted. :meth:`advance` waits for it,
    serves this rank's shard and posts the pull; :meth:`wait` completes everything.

    Every collective is posted by the thread that calls these methods, never from a
    future's callback: gloo pairs collectives by the order they are posted on each rank
    in a group, so a pull posted in the pushes' group whenever a push happened to
    complete could meet another bucket's push on a peer. Callers that overlap (DDP
    hooks) advance their exchanges in the same order on every rank; with the
    communicator's ``pull_group`` they may advance an exchange whenever it is
    :meth:`ready`, in that order."""

    __slots__ = ("_comm", "_work", "_pushed", "_server", "_outs", "_pull", "_out", "_result")

    def __init__(self, comm: DistCommunicator, work: Any, pushed: torch.Tensor, server: Any,
                 outs: list[int]) -> None:
        self._comm, self._work, self._pushed, self._server, self._outs = comm, work, pushed, server, outs
        self._pull: Any = None
        self._out: torch.Tensor | None = None
        self._result: torch.Tensor | None = None

    def _others(self) -> list[int]:
        c = self._comm
        return [j for j in range(c.world_size) if j != c.rank]

    def advance(self) -> None:
        """Wait for the push, serve this rank's shard and post the pull (once)."""
        if self._out is not None:
            return
        c, outs = self._comm, self._outs
        n, r = c.world_size, c.rank
        if self._work is not None:
            with c.ledger.phase("wait"):
                c._wait(_Posted([self._work], [self._others()], "sharded_exchange (push)"))
        with c.ledger.phase("compress"):
            reply = c._serve(self._server, r, self._pushed, outs[r])
        out = torch.empty(sum(outs), dtype=torch.uint8, device=reply.device)
        if n == 1:
            out.copy_(reply)
        else:
            with c.ledger.phase("communicate"):
                sent = reply.repeat(n)  # the same reply to every rank, one slot each
                self._pull = c._post_collective("sharded_exchange (pull)", lambda: c._all_to_all(
                    out, sent, outs, [outs[r]] * n, c._pull_group if c._pull_group is not None else c.group))
        self._out = out

    def ready(self) -> bool:
        """True when :meth:`advance` neither waits nor has to be called in step with the
        peers: it has run, or the pulls have a group of their own and the push has
        arrived."""
        return self._out is not None or (self._comm._pull_group is not None
                                         and (self._work is None or self._work.is_completed()))

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self.advance()
            c = self._comm
            if self._pull is not None:
                with c.ledger.phase("wait"):
                    c._wait(_Posted([self._pull], [self._others()], "sharded_exchange (pull)"))
            self._result = self._out
        return self._result

    def is_completed(self) -> bool:
        return self._result is not None

    def future(self) -> torch.futures.Future:
        """Advances (if not yet done: that waits for the push) and returns a future that
        completes when the pull has arrived, without waiting for it."""
        self.advance()
        if self._pull is None or self._result is not None:
            return super().future()
        out = self._out

        def done(f: torch.futures.Future) -> torch.Tensor:
            f.wait()
            return out

        return self._pull.get_future().then(done)
