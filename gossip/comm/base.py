"""What both communicators share: the interface, the received payloads, work handles.

The interface is batched (docs/internals.md): a communicator *hosts* ``m`` nodes and
every per-node value is a tensor whose first dimension is the hosted node.
"""

from __future__ import annotations

import abc
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from gossip.errors import PeerPayloadError, format_peers
from .ledger import Ledger

__all__ = ["Communicator", "Received", "Handle", "Done", "ShardServer", "ring_allreduce_bytes", "tensor_nbytes"]

Decode = Callable[[torch.Tensor], torch.Tensor]

#: values per block of rows of a many-row weighted sum (the simulation's, on the CPU): one
#: block's gathered rows and its running sum (2 x 512 KiB of float32) stay in a core's L2
#: cache (a GPU takes the whole matrix per operation: blocks would only add launches)
_SUM_BLOCK_VALUES = 1 << 17

#: the shard owner's step of a sharded exchange: ``server(j, Q)`` gets shard ``j``'s
#: ``n`` incoming messages ``Q`` (``Tensor[n, in_nbytes[j]]`` uint8, one row per sender,
#: ascending ids) and returns the reply every node receives (``Tensor[out_nbytes[j]]``
#: uint8). It is where the algorithm decodes, averages, applies the shard's own
#: server state (error feedback, majority vote) and re-compresses.
ShardServer = Callable[[int, torch.Tensor], torch.Tensor]


_PAYLOAD_ERRORS: tuple[type[BaseException], ...] | None = None


def _payload_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions from a decode callable that mean 'this payload is bad'.

    ``ValueError``, which ``gossip.compress.PayloadError`` subclasses (so stand-in
    decoders work the same way), plus ``PayloadError`` itself should it ever stop
    being one. Looked up once; the communicators do not need the compressors.
    """
    global _PAYLOAD_ERRORS
    if _PAYLOAD_ERRORS is None:
        types: list[type[BaseException]] = [ValueError]
        try:
            from gossip.compress import PayloadError  # type: ignore[attr-defined]
        except Exception:  # absent or not importable: ValueError covers the contract
            PayloadError = ValueError  # type: ignore[misc, assignment]
        if not issubclass(PayloadError, ValueError):
            types.append(PayloadError)
        _PAYLOAD_ERRORS = tuple(types)
    return _PAYLOAD_ERRORS


def _fit(buf: torch.Tensor | None, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``buf`` where it has ``shape`` and ``like``'s dtype and device, else a new tensor."""
    if buf is None or tuple(buf.shape) != shape or buf.dtype != like.dtype or buf.device != like.device:
        return like.new_empty(shape)
    return buf


class Received:
    """The payloads a communicator's hosted nodes received in one exchange.

    Attributes:
        nodes: ``Tensor[m]`` global ids of the receiving (hosted) nodes.
        payloads: ``Tensor[k, nbytes]`` uint8, the distinct payloads received, one row
            per sender (the simulation holds all ``n`` payloads, ``k = n``; a rank holds
            its neighbours', ``k = degree``).
        senders: ``Tensor[k]`` int64, the global id that sent each row of ``payloads``,
            ascending.
        index: ``Tensor[m, D]`` int64, for hosted row ``r`` the rows of ``payloads`` of
            its neighbours in ascending id order; columns past the node's degree are
            padding (they point at any row and must be ignored).
        weights: ``Tensor[m, D]`` float64, the mixing weights ``W_ij`` matching
            ``index``; padding holds 0.0.
        degrees: ``Tensor[m]`` int64, the number of real columns of each row.

    The tensors may alias the sender's payload tensor in the simulation: do not
    modify a payload tensor until the ``Received`` built from it is consumed.
    """

    __slots__ = ("nodes", "payloads", "senders", "index", "weights", "degrees")

    def __init__(
        self,
        nodes: torch.Tensor,
        payloads: torch.Tensor,
        senders: torch.Tensor,
        index: torch.Tensor,
        weights: torch.Tensor,
        degrees: torch.Tensor,
    ) -> None:
        self.nodes = nodes
        self.payloads = payloads
        self.senders = senders
        self.index = index
        self.weights = weights
        self.degrees = degrees

    def neighbors(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids Tensor[deg], payloads Tensor[deg, nbytes])`` received by hosted row ``r``."""
        deg = int(self.degrees[r])
        rows = self.index[r, :deg]
        return self.senders[rows], self.payloads[rows]

    def decode(self, decode: Decode) -> torch.Tensor:
        """``decode(payloads)`` as ``Tensor[k, d]``; a bad payload raises
        :class:`PeerPayloadError` naming its sender."""
        k = self.payloads.shape[0]
        bad_types = _payload_error_types()
        try:
            D = decode(self.payloads)
        except bad_types as exc:
            # Find the culprit(s) row by row; this path only runs after a failure.
            bad: list[int] = []
            for i in range(k):
                try:
                    decode(self.payloads[i : i + 1])
                except bad_types:
                    bad.append(int(self.senders[i]))
            if not bad:  # the batch fails but no row alone does: blame them all
                bad = [int(s) for s in self.senders]
            raise PeerPayloadError(
                f"bad payload from {format_peers(bad)} (received by "
                f"{format_peers(self.nodes.tolist())}): {exc}",
                bad,
                "neighbor_exchange",
            ) from exc
        if not isinstance(D, torch.Tensor) or D.dim() != 2 or D.shape[0] != k:
            got = tuple(D.shape) if isinstance(D, torch.Tensor) else type(D).__name__
            raise ValueError(
                f"Received.weighted_sum: `decode` must return a tensor of shape (k, d) with "
                f"k = {k} rows, one per payload row; got {got}"
            )
        return D

    def weighted_sum(
        self, decode: Decode, *, out: torch.Tensor | None = None, scratch: torch.Tensor | None = None,
        finish: Callable[[slice, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Row ``r`` = sum over the neighbours ``j`` of ``nodes[r]`` of ``W_ij * decode(P_j)``.

        The neighbours are summed in ascending id order as ``acc = w_0 * D_0;
        acc += w_1 * D_1; ...`` with the weights cast to the decoded dtype, the same
        operations in the simulation and in a distributed run, so both give
        bit-identical results. Padding columns are skipped, not multiplied by zero:
        ``0.0 * D`` would turn an accumulated ``-0.0`` into ``+0.0`` and an infinite
        ``D`` into NaN.

        ``out`` and ``scratch``: (m, d) tensors of the decoded dtype, reused across steps
        by the caller; the sum goes into ``out`` (returned) and ``scratch`` holds each
        neighbour's gathered, weighted rows, so a graph whose nodes all have the same
        degree allocates nothing in proportion to d. Without them they are allocated.

        ``finish(rows, block)``: called with each block of rows' sum as soon as it is
        complete (``rows`` a slice of the hosted rows, ``block`` their sum), while the
        block is still in cache, so that a caller's update that reads the sum once (the
        mixing step of D-PSGD) does not stream the whole ``(m, d)`` sum through memory
        again. The blocks come in ascending order and cover every row once; the whole
        sum, where it is not summed in blocks, is one block. With ``finish`` the return
        value holds only the last block's rows: read the sums in ``finish``.
        """
        D = self.decode(decode)
        m, width = self.index.shape
        w = self.weights.to(dtype=D.dtype, device=D.device)
        idx = self.index.to(D.device)
        deg = self.degrees.to(D.device)
        shape = (m, D.shape[1])
        out = _fit(out, D, shape)
        if width == 0:
            out.zero_()
        elif m > 1 and D.device.type == "cpu" and bool((deg >= width).all()) \
                and m * D.shape[1] > _SUM_BLOCK_VALUES and (scratch is None or scratch.is_contiguous()):
            return self._blocked_sum(D, idx, w, out, _fit(scratch, D, shape), width, finish)
        else:
            self._whole_sum(D, idx, w, deg, out, _fit(scratch, D, shape), width)
        if finish is not None:
            finish(slice(0, m), out)
        return out

    @staticmethod
    def _whole_sum(D: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, deg: torch.Tensor,
                   out: torch.Tensor, scratch: torch.Tensor, width: int) -> None:
        """The weighted sum of :meth:`weighted_sum` into ``out``, each operation over
        all hosted rows (a rank's one row; a GPU; rows of unequal degrees)."""
        m = out.shape[0]

        def rows(k: int) -> torch.Tensor:
            # one hosted node (a rank): its neighbour's decoded row itself, no gather
            if m == 1:
                j = int(idx[0, k])
                return D[j: j + 1]
            return torch.index_select(D, 0, idx[:, k], out=scratch)

        acc = torch.mul(rows(0), w[:, 0:1], out=out)
        if bool((deg < 1).any()):
            acc[deg < 1] = 0.0
        for k in range(1, width):
            full = deg > k
            if bool(full.all()):
                acc += torch.mul(rows(k), w[:, k : k + 1], out=scratch)
            else:
                rws = full.nonzero().squeeze(1)
                if rws.numel():
                    acc[rws] = acc[rws] + w[rws, k : k + 1] * D[idx[rws, k]]

    @staticmethod
    def _blocked_sum(D: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                     scratch: torch.Tensor, width: int,
                     finish: Callable[[slice, torch.Tensor], None] | None = None) -> torch.Tensor:
        """The weighted sum of :meth:`weighted_sum` for many hosted rows of full degree,
        a block of rows at a time: the same operations on every value (``acc = w_0 *
        D_0``, ``acc += w_k * D_k``), so the same bits, but each block's neighbour rows
        and sum stay in cache, where the whole-matrix form streams its ``(m, d)``
        scratch and sum through memory at every operation (11 passes over ``m d``
        values for a ring, 3 this way). Blocks of whole rows, so that each operation
        reads and writes contiguous memory. A block's neighbours whose rows of ``D``
        are consecutive (a single row, or a ring's or torus's shifted run) are read
        where they lie; others are gathered into the start of ``scratch``
        (contiguous), so nothing is allocated.

        With ``finish``, each block's sum goes to the start of ``out`` and ``finish``
        gets it there, in cache; otherwise block ``r`` goes to ``out``'s rows ``r``."""
        m, d = out.shape
        rows = max(1, _SUM_BLOCK_VALUES // d)
        flat = scratch.view(-1)
        cols = idx.t().tolist()  # per neighbour column, each row's row of D
        # per column, the number of breaks in its runs of consecutive rows up to each row:
        # a block reads a column's rows where they lie when none falls inside it
        breaks = np.cumsum(np.diff(idx.cpu().numpy(), axis=0) != 1, axis=0).tolist() if rows > 1 else None
        wk = [w[:, k:k + 1] for k in range(width)]
        for r in range(0, m, rows):
            e = min(m, r + rows)
            s = slice(r, e)
            oc = out[: e - r] if finish is not None else out[s]
            b = flat[:oc.numel()].view(oc.shape)
            for k in range(width):
                a = cols[k][r]
                if breaks is None or e - r == 1 or breaks[e - 2][k] == (breaks[r - 1][k] if r else 0):
                    src = D[a:a + e - r]  # consecutive rows: a view, no gather
                else:
                    src = torch.index_select(D, 0, idx[s, k], out=b)
                if k == 0:
                    torch.mul(src, wk[0][s], out=oc)
                else:
                    oc += torch.mul(src, wk[k][s], out=b)
            if finish is not None:
                finish(s, oc)
        return out

    def __repr__(self) -> str:
        return (
            f"Received(nodes={self.nodes.numel()}, payloads={tuple(self.payloads.shape)}, "
            f"max_degree={self.index.shape[1]})"
        )


class Handle:
    """A pending communication; :meth:`wait` completes it and returns its result.

    Handles of one communicator must be waited in the order they were created.
    """

    def wait(self) -> Any:  # pragma: no cover - interface
        raise NotImplementedError

    def is_completed(self) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def advance(self) -> None:
        """Post whatever later stage of the operation can be posted now (a sharded
        exchange's pull, once its push has arrived); a no-op for single-stage ones.
        Overlapping callers advance their handles in the same order on every rank."""

    def ready(self) -> bool:
        """Whether :meth:`advance` would return at once and may be called whenever this
        rank likes (its later stage has a process group of its own); True for a
        single-stage operation. Callers that advance handles as they become ready still
        advance them in order, stopping at the first that is not."""
        return True

    def future(self) -> torch.futures.Future:
        """A ``torch.futures.Future`` of :meth:`wait`'s result, for callers that chain
        work on the arrival instead of blocking (DDP communication hooks). Handles
        whose backend can complete without a wait (torch.distributed works) override
        it; by default the future is completed here, by waiting."""
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self.wait())
        return fut


class Done(Handle):
    """A handle whose result is already there (simulation, world of one)."""

    __slots__ = ("_result",)

    def __init__(self, result: Any) -> None:
        self._result = result

    def wait(self) -> Any:
        return self._result

    def is_completed(self) -> bool:
        return True


_REDUCE_OPS = ("sum", "mean")


class Communicator(abc.ABC):
    """Neighbour exchange and collectives for the nodes a process hosts.

    Subclasses implement the ``*_async`` methods; the blocking ones wait on them.
    ``record=False`` keeps an operation out of the ledger (metrics, evaluation).
    """

    world_size: int
    nodes: torch.Tensor
    topology: Any
    ledger: Ledger

    # ---------------------------------------------------------------- blocking
    def neighbor_exchange(self, P: torch.Tensor, *, record: bool = True, step: int | None = None) -> Received:
        """Send each hosted node's payload row to its neighbours; receive theirs.

        On a time-varying topology ``step`` (the graph's step index ``t >= 0``) is
        required and the exchange follows ``W(t)``: each node sends to its
        out-neighbours of ``W(t)`` and receives from its in-neighbours, whose weights
        ``W_ij(t)`` the :class:`Received` carries. On a static topology it is ignored.
        """
        return self.neighbor_exchange_async(P, record=record, step=step).wait()

    def all_reduce(self, X: torch.Tensor, op: str = "sum", *, record: bool = True) -> torch.Tensor:
        """Each row := the sum (or mean) over all ``n`` nodes' rows."""
        return self.all_reduce_async(X, op, record=record).wait()

    def all_gather(self, X: torch.Tensor, *, record: bool = True) -> torch.Tensor:
        """``Tensor[n, ...]``: every node's row, by global id."""
        return self.all_gather_async(X, record=record).wait()

    def broadcast(self, X: torch.Tensor, src: int, *, record: bool = True) -> torch.Tensor:
        """Each row := node ``src``'s row."""
        return self.broadcast_async(X, src, record=record).wait()

    def sharded_exchange(
        self,
        P: torch.Tensor,
        in_nbytes: Sequence[int],
        out_nbytes: Sequence[int],
        server: ShardServer,
        *,
        record: bool = True,
    ) -> torch.Tensor:
        """The two-way compressed all-reduce of Zheng et al. (arXiv:1905.10936, Sec. 1):
        node ``j`` owns shard ``j``.

        1. push: row ``r`` of ``P`` (``Tensor[m, sum(in_nbytes)]`` uint8) is hosted node
           ``r``'s messages for shards ``0..n-1``, concatenated in shard order; the
           message for shard ``j`` (``in_nbytes[j]`` bytes) goes to node ``j`` (an
           all-to-all of payloads, ledger kind ``shard_push``);
        2. serve: node ``j`` calls ``server(j, Q)`` on the ``n`` messages of its shard,
           one row per sender in ascending id order (its own included);
        3. pull: node ``j``'s reply (``out_nbytes[j]`` bytes) goes to every node (an
           all-gather, ledger kind ``shard_pull``).

        Returns ``Tensor[sum(out_nbytes)]`` uint8: the replies of shards ``0..n-1``
        concatenated, the same on every node. Each node sends
        ``sum_{j != i} in_nbytes[j] + (n - 1) out_nbytes[i]`` bytes, about
        ``2 (n - 1) / n`` of one whole payload when the shards are even, whatever ``n``.
        """
        return self.sharded_exchange_async(P, in_nbytes, out_nbytes, server, record=record).wait()

    # ---------------------------------------------------------------- asynchronous
    @abc.abstractmethod
    def neighbor_exchange_async(self, P: torch.Tensor, *, record: bool = True, step: int | None = None) -> Handle:
        """Post the exchange; ``.wait()`` returns the :class:`Received`. Several may be
        in flight (overlapped algorithms); they must be waited in the order posted."""

    @abc.abstractmethod
    def all_reduce_async(self, X: torch.Tensor, op: str = "sum", *, record: bool = True) -> Handle:
        """Post the all-reduce; ``.wait()`` returns the reduced ``Tensor[m, ...]``."""

    @abc.abstractmethod
    def all_gather_async(self, X: torch.Tensor, *, record: bool = True) -> Handle:
        """Post the all-gather; ``.wait()`` returns ``Tensor[n, ...]``."""

    @abc.abstractmethod
    def broadcast_async(self, X: torch.Tensor, src: int, *, record: bool = True) -> Handle:
        """Post the broadcast; ``.wait()`` returns ``Tensor[m, ...]``."""

    def sharded_exchange_async(
        self,
        P: torch.Tensor,
        in_nbytes: Sequence[int],
        out_nbytes: Sequence[int],
        server: ShardServer,
        *,
        record: bool = True,
    ) -> Handle:
        """Post :meth:`sharded_exchange`; ``.wait()`` returns its result. The bytes of
        both legs are recorded when it is posted (``server`` may run later, on the
        thread that completes the push). Both communicators implement it; a
        communicator of one's own that does not raises here."""
        raise NotImplementedError(
            f"{type(self).__name__} does not implement sharded_exchange_async; use exchange=allgather"
        )

    # ---------------------------------------------------------------- shared checks
    def _graph(self, step: int | None, what: str) -> Any:
        """The topology of this exchange: ``topology.at(step)`` on a time-varying one."""
        topo = self.topology
        if not is_time_varying(topo):
            return topo
        if step is None or isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(
                f"{type(self).__name__}.{what}: the topology {topo.name!r} is time-varying, so "
                f"`step` (the step index t >= 0 of W(t)) is required, got {step!r}"
            )
        return topo.at(int(step))

    def _check_rows(self, X: torch.Tensor, what: str, name: str = "X") -> None:
        m = int(self.nodes.numel())
        if not isinstance(X, torch.Tensor) or X.dim() < 1 or X.shape[0] != m:
            got = tuple(X.shape) if isinstance(X, torch.Tensor) else type(X).__name__
            raise ValueError(
                f"{type(self).__name__}.{what}: `{name}` must have one row per hosted node, "
                f"shape ({m}, ...), got {got}"
            )

    def _check_payload(self, P: torch.Tensor) -> None:
        self._check_rows(P, "neighbor_exchange", "P")
        if P.dtype != torch.uint8 or P.dim() != 2:
            raise ValueError(
                f"{type(self).__name__}.neighbor_exchange: `P` must be a 2-D uint8 tensor "
                f"(m, nbytes), got dtype {P.dtype} with {P.dim()} dims"
            )

    def _check_reduce(self, X: torch.Tensor, op: str) -> None:
        self._check_rows(X, "all_reduce")
        if op not in _REDUCE_OPS:
            raise ValueError(
                f"{type(self).__name__}.all_reduce: `op` must be one of {list(_REDUCE_OPS)}, "
                f"got {op!r}"
            )
        if op == "mean" and not (X.is_floating_point() or X.is_complex()):
            raise ValueError(
                f"{type(self).__name__}.all_reduce: op='mean' needs a floating-point `X`, "
                f"got dtype {X.dtype}"
            )

    def _check_sharded(
        self, P: torch.Tensor, in_nbytes: Sequence[int], out_nbytes: Sequence[int], server: Any
    ) -> tuple[list[int], list[int]]:
        """The split sizes as lists of ints, each checked; ``P`` one row per hosted node."""
        what = f"{type(self).__name__}.sharded_exchange"
        n = self.world_size
        sizes = []
        for name, v in (("in_nbytes", in_nbytes), ("out_nbytes", out_nbytes)):
            try:
                vs = [int(x) for x in v]
                ok = len(vs) == n and all(int(x) == x and x >= 0 for x in v)
            except (TypeError, ValueError):
                ok, vs = False, []
            if not ok:
                raise ValueError(f"{what}: `{name}` must list {n} non-negative byte counts (one per shard), "
                                 f"got {v!r}")
            sizes.append(vs)
        if not callable(server):
            raise TypeError(f"{what}: `server` must be callable as server(shard, payloads), got {server!r}")
        self._check_rows(P, "sharded_exchange", "P")
        if P.dtype != torch.uint8 or P.dim() != 2 or P.shape[1] != sum(sizes[0]):
            raise ValueError(
                f"{what}: `P` must be a 2-D uint8 tensor (m, sum(in_nbytes) = {sum(sizes[0])}), "
                f"got {P.dtype} of shape {tuple(P.shape)}")
        return sizes[0], sizes[1]

    def _sharded_records(self, in_nbytes: list[int], out_nbytes: list[int]) -> None:
        """Record both legs of a sharded exchange: every (sender, owner) message of the
        push and every (owner, receiver) message of the pull, one call each."""
        n = self.world_size
        if n > 1:
            src, dst = np.nonzero(~np.eye(n, dtype=bool))  # every ordered pair i != j
            self.ledger.record(src, dst, np.asarray(in_nbytes, dtype=np.int64)[dst], op="shard_push")
            self.ledger.record(src, dst, np.asarray(out_nbytes, dtype=np.int64)[src], op="shard_pull")
        self.ledger.count("shard_push")
        self.ledger.count("shard_pull")

    def _serve(self, server: ShardServer, j: int, Q: torch.Tensor, nbytes: int) -> torch.Tensor:
        R = server(j, Q)
        if not isinstance(R, torch.Tensor) or R.dtype != torch.uint8 or tuple(R.shape) != (nbytes,):
            got = f"{R.dtype} of shape {tuple(R.shape)}" if isinstance(R, torch.Tensor) else type(R).__name__
            raise ValueError(f"{type(self).__name__}.sharded_exchange: `server` must return shard {j}'s reply "
                             f"as a uint8 tensor of shape ({nbytes},), got {got}")
        return R

    def _check_src(self, src: int) -> int:
        if isinstance(src, bool) or not isinstance(src, (int, np.integer)) or not (
            0 <= int(src) < self.world_size
        ):
            raise ValueError(
                f"{type(self).__name__}.broadcast: `src` must be a node id in "
                f"[0, {self.world_size}), got {src!r}"
            )
        return int(src)


def is_time_varying(topology: Any) -> bool:
    """Whether ``topology`` is a ``topologies.TimeVaryingTopology`` (its ``time_varying``
    flag; a stand-in topology object without the flag is static)."""
    return bool(getattr(topology, "time_varying", False))


def ring_allreduce_bytes(nbytes: int, n: int) -> int:
    """Bytes one node sends (and receives) in a ring all-reduce of ``nbytes``:
    2(n-1)/n x nbytes, rounded half up in exact integer arithmetic."""
    return 0 if n <= 1 else (2 * (n - 1) * nbytes + n // 2) // n


def tensor_nbytes(X: torch.Tensor) -> int:
    """Bytes of one row of ``X``."""
    return int(X[0].numel() * X.element_size()) if X.shape[0] else 0


def size_check_key(nbytes: int) -> str:
    """The ledger's key (:meth:`Ledger.once`) of the size check of ``nbytes``-byte payloads."""
    return f"size check {int(nbytes)}"


def split_check_key(in_nbytes: Sequence[int], out_nbytes: Sequence[int]) -> str:
    """The ledger's key (:meth:`Ledger.once`) of the check of one split of a sharded exchange."""
    digest = zlib.crc32(np.asarray(list(in_nbytes) + list(out_nbytes), dtype=np.int64).tobytes())
    return f"split check {len(in_nbytes)}:{digest:08x}"
