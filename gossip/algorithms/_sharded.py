"""Sharded two-way compression: how a flat vector is cut into shards and put on the wire.

The communicators move the bytes (``Communicator.sharded_exchange``: each node pushes
its compressed slice of shard ``j`` to node ``j``, node ``j`` serves its shard and
pulls the reply back to everyone); this module decides what the bytes are, for the
algorithms that compress both ways (dist-EF-SGD and its block variants, signSGD and
Signum with majority vote, DiLoCo with a non-linear compressor). It follows Zheng,
Huang and Kwok, "Communication-Efficient Distributed Blockwise Momentum SGD with
Error-Feedback" (arXiv:1905.10936), Sec. 1: the server's compression sits between the
reduce-scatter and the all-gather of a ring all-reduce, so each node sends about
2 (n - 1) / n of one payload whatever n.

:class:`ShardPlan` cuts ``d`` values into ``n`` shards:

* as evenly as the compressor allows. A compressor with a fixed block size (``quant``,
  ``qsgd``, ``ternary``, ``blocksign`` with ``block=B``) is cut at multiples of ``B``,
  so its blocks stay whole and each shard's codes and scales are exactly those of the
  unsharded payload; a vector of fewer blocks than nodes cannot be sharded and is
  refused. A compressor whose scale spans the whole row (``sign``, ``quant`` without
  ``block``) gets one scale per shard. ``blocksign`` with ``offsets`` (one block per
  parameter tensor, dist-EF-blockSGD) is cut evenly too: a tensor that spans a cut is
  two blocks, one in each shard, each with its own scale (Alg. 3's guarantee holds per
  block, and a shard never waits for another's scale);
* a compressor that keeps a count ``k`` of the whole vector (``topk``, ``randk``,
  ``randomk``, ``randomblock`` with ``k=``) cannot be cut into shards that mean the same
  and is refused in one line (``p=`` works).

The wire: each shard message is the compressor's own payload of the shard without
the 16 header bytes both ends know from the plan (format, compressor id, parameter
hash, numel); the row key, the tag and the checksum travel. The receiver puts the
known words back and decodes with every check of the compressor, so a peer with
another compressor, parameters or step fails the checksum or tag check and is named.
At 64 nodes a 1-bit shard of cnn1d is about 250 bytes, where the full 32-byte header
would cost 13 %.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np
import torch

from gossip.compress import wire as _wire
from gossip.errors import PeerPayloadError, format_peers

__all__ = ["EXCHANGES", "ShardPlan", "check_exchange", "resolve_exchange"]

#: the ways a two-way compressed algorithm exchanges its payloads
EXCHANGES = ("sharded", "allgather")

#: bytes of the compressor header both ends of a shard message know (word0, numel)
_KNOWN = 16


def check_exchange(value: Any, algo: str) -> None:
    """An algorithm Config's ``exchange`` option: None (the algorithm's default) or one of
    :data:`EXCHANGES`."""
    if value is not None and value not in EXCHANGES:
        raise ValueError(f"Arg `exchange` of {algo} must be one of {', '.join(EXCHANGES)} "
                         f"(or omitted for the default), got {value!r}")


def resolve_exchange(value: str | None) -> str:
    """The exchange a Config asks for: ``sharded`` unless it says ``allgather``."""
    return "sharded" if value is None else value


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= (1 << 63) else v


def _splitmix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def shard_keys(keys: torch.Tensor, shards: range) -> torch.Tensor:
    """Keys (m * len(shards),) of every (row, shard): a pure function of the row key and
    the shard index, so shards draw independent randomness and every process agrees."""
    k = keys.detach().cpu().numpy().astype(np.int64).view(np.uint64)
    j = np.asarray(list(shards), dtype=np.uint64)
    with np.errstate(over="ignore"):
        mixed = _splitmix(k[:, None] ^ _splitmix(j + np.uint64(0x5EED))[None, :])
    return torch.from_numpy(mixed.reshape(-1).view(np.int64).copy())


def _even_cuts(total: int, n: int) -> list[int]:
    """Cut ``total`` units into ``n`` runs, the first ``total % n`` one unit longer: at most
    two lengths, so the shards encode as at most two batches."""
    q, r = divmod(total, n)
    cuts = [0]
    for j in range(n):
        cuts.append(cuts[-1] + q + (1 if j < r else 0))
    return cuts


@dataclasses.dataclass(frozen=True)
class _Run:
    """Consecutive shards ``j0 .. j1 - 1`` of equal length ``L`` and one compressor:
    encoded and decoded as one batch of rows."""

    j0: int
    j1: int
    start: int
    L: int
    comp: Any
    nbytes: int  # wire bytes per shard message


class ShardPlan:
    """``d`` values cut into ``n`` shards, each compressed by its own compressor.

    ``bounds[j] = (a, b)``: shard ``j`` holds values ``[a, b)``; ``compressors[j]``
    compresses it; ``nbytes[j]``: bytes of one shard message on the wire. The methods
    ``encode``/``decode`` work on whole rows like a compressor's (so error feedback
    wraps a plan as it wraps a compressor); ``encode_shard``/``decode_shard`` on one
    shard, as its owner does.
    """

    def __init__(self, compressor: Any, d: int, n: int, *, algo: str, layout: Any = None) -> None:
        self.compressor, self.d, self.n = compressor, int(d), int(n)
        what = f"{algo}: exchange=sharded"
        if self.d < self.n:
            raise ValueError(f"{what} cuts the {self.d} values into {self.n} shards, one per node, and needs at "
                             f"least as many values as nodes; use exchange=allgather")
        cfg = getattr(compressor, "config", None)
        name = compressor.name
        if getattr(cfg, "k", None) is not None:
            raise ValueError(f"{what}: {compressor.spec} keeps a count of k={cfg.k} values, which does not carry "
                             f"over to shards; give the fraction p= instead, or use exchange=allgather")
        block = getattr(cfg, "block", None)
        if block is not None:
            nblocks = -(-self.d // block)
            if nblocks < self.n:
                raise ValueError(f"{what}: {compressor.spec} has {nblocks} block(s) of {block} values over the "
                                 f"{self.d} values, fewer than the {self.n} nodes, so its blocks cannot be "
                                 f"shared out whole; use a smaller block, or exchange=allgather")
            cuts = [min(self.d, c * block) for c in _even_cuts(nblocks, self.n)]
        else:
            cuts = _even_cuts(self.d, self.n)
        self.bounds = [(cuts[j], cuts[j + 1]) for j in range(self.n)]
        offsets = getattr(cfg, "offsets", None) if name == "blocksign" else None
        self.compressors = [self._for_shard(a, b, offsets) for a, b in self.bounds]
        self.nbytes = [c.payload_nbytes(b - a) - _KNOWN for c, (a, b) in zip(self.compressors, self.bounds)]
        self._known = [self._known_words(c, b - a) for c, (a, b) in zip(self.compressors, self.bounds)]
        runs, j = [], 0
        while j < self.n:
            a, b = self.bounds[j]
            k = j + 1
            while k < self.n and self.bounds[k][1] - self.bounds[k][0] == b - a \
                    and self.compressors[k] == self.compressors[j]:
                k += 1
            runs.append(_Run(j, k, a, b - a, self.compressors[j], self.nbytes[j]))
            j = k
        self.runs = runs
        self.wire_offsets = np.concatenate([[0], np.cumsum(self.nbytes)]).astype(np.int64).tolist()

    def _for_shard(self, a: int, b: int, offsets: Any) -> Any:
        c = self.compressor
        if offsets is None:
            return c  # the same spec on a slice: blocks of `block` values, or one scale per shard
        # blocksign's tensor blocks: the ones that meet [a, b), re-based at the shard start
        starts = sorted({0} | {o - a for o in offsets if a < o < b})
        return type(c)(dataclasses.replace(c.config, offsets=tuple(starts)) if len(starts) > 1
                       else dataclasses.replace(c.config, offsets=None))

    @staticmethod
    def _known_words(comp: Any, numel: int) -> torch.Tensor:
        w0 = _wire.MAGIC_WORD0 | (comp.cid << 24) | (_wire.params_hash(comp.spec) << 32)
        return torch.tensor([_signed64(w0), numel], dtype=torch.int64)

    # ---------------------------------------------------------------- sizes
    @property
    def total_nbytes(self) -> int:
        """Bytes of one row's messages for all shards: what a node's payload would weigh."""
        return int(sum(self.nbytes))

    def shard_slice(self, j: int) -> slice:
        a, b = self.bounds[j]
        return slice(a, b)

    # ---------------------------------------------------------------- whole rows
    def encode(self, X: torch.Tensor, keys: torch.Tensor, tag: int = 0) -> torch.Tensor:
        """Each row of ``X`` (m, d) as its ``n`` shard messages, concatenated: (m, total)."""
        m = X.shape[0]
        out = torch.empty((m, self.total_nbytes), dtype=torch.uint8, device=X.device)
        for r in self.runs:
            k = r.j1 - r.j0
            rows = X[:, r.start: r.start + k * r.L].reshape(m * k, r.L)
            P = r.comp.encode(rows, shard_keys(keys, range(r.j0, r.j1)), tag=tag)
            a = self.wire_offsets[r.j0]
            out[:, a: a + k * r.nbytes] = P[:, _KNOWN:].reshape(m, k * r.nbytes)
        return out

    def decode(self, P: torch.Tensor, numel: int | None = None, tag: int | None = None) -> torch.Tensor:
        """Rows of concatenated shard messages (m, total) back to values (m, d)."""
        P = P.reshape(-1, self.total_nbytes)
        m = P.shape[0]
        out = torch.empty((m, self.d), dtype=torch.float32, device=P.device)
        for r in self.runs:
            k = r.j1 - r.j0
            a = self.wire_offsets[r.j0]
            msgs = P[:, a: a + k * r.nbytes].reshape(m * k, r.nbytes)
            vals = r.comp.decode(self._full(r.j0, msgs), r.L, tag=tag)
            out[:, r.start: r.start + k * r.L] = vals.reshape(m, k * r.L)
        return out

    # ---------------------------------------------------------------- one shard
    def encode_shard(self, j: int, x: torch.Tensor, key: torch.Tensor, tag: int) -> torch.Tensor:
        """Shard ``j``'s values ``x`` (1, L) as one message (nbytes[j],)."""
        P = self.compressors[j].encode(x, key, tag=tag)
        return P[0, _KNOWN:].contiguous()

    def decode_shard(self, j: int, Q: torch.Tensor, tag: int | None, senders: Any = None) -> torch.Tensor:
        """Messages ``Q`` (k, nbytes[j]) of shard ``j`` to values (k, L). A bad row raises
        :class:`PeerPayloadError` naming its sender (``senders[i]``, row ``i`` by default)."""
        a, b = self.bounds[j]
        comp = self.compressors[j]
        try:
            return comp.decode(self._full(j, Q), b - a, tag=tag)
        except ValueError as exc:
            bad = []
            for i in range(Q.shape[0]):
                try:
                    comp.decode(self._full(j, Q[i: i + 1]), b - a, tag=tag)
                except ValueError:
                    bad.append(int(senders[i]) if senders is not None else i)
            raise PeerPayloadError(f"bad shard-{j} message from {format_peers(bad or [-1])}: {exc}",
                                   bad, "sharded_exchange") from exc

    def shard_codec(self, j: int) -> _ShardCodec:
        """Shard ``j``'s compressor with this plan's wire (what error feedback wraps on
        the shard's owner)."""
        return _ShardCodec(self, j)

    def _full(self, j: int, msgs: torch.Tensor) -> torch.Tensor:
        """Shard ``j``'s messages with the 16 known header bytes put back: payload rows."""
        k = msgs.shape[0]
        full = torch.empty((k, msgs.shape[1] + _KNOWN), dtype=torch.uint8, device=msgs.device)
        full.view(torch.int64)[:, :2] = self._known[j].to(msgs.device)
        full[:, _KNOWN:] = msgs
        return full

    def __repr__(self) -> str:
        return (f"ShardPlan({self.compressor.spec}, d={self.d}, n={self.n}, "
                f"{len(self.runs)} run(s), {self.total_nbytes} bytes per row)")


class _ShardCodec:
    """One shard of a plan, with a compressor's ``encode``/``decode``."""

    __slots__ = ("plan", "j")

    def __init__(self, plan: ShardPlan, j: int) -> None:
        self.plan, self.j = plan, j

    def encode(self, X: torch.Tensor, keys: torch.Tensor, tag: int = 0) -> torch.Tensor:
        return self.plan.encode_shard(self.j, X, keys, tag).view(1, -1)

    def decode(self, P: torch.Tensor, numel: int | None = None, tag: int | None = None) -> torch.Tensor:
        return self.plan.decode_shard(self.j, P, tag)


class ExchangeMixin:
    """What an algorithm with an ``exchange`` option shares: the plan, the choice, and
    the resume rules of its State's ``exchange`` and ``shards`` entries.

    The State records ``exchange`` (``"sharded"`` or ``"allgather"``) and ``shards``
    (the number of shard owners, the world size). A state written before the sharded
    exchange existed has neither: it all-gathered, so the algorithm switches to
    ``allgather`` (unless the Config asks for ``sharded`` explicitly, which is refused
    in one line) and continues exactly as the run that wrote it would have.
    """

    exchange: str = "allgather"
    plan: ShardPlan | None = None
    #: State entries that states written before the sharded exchange lack (besides
    #: ``exchange`` and ``shards``); they keep their fresh values
    _new_state_fields: tuple[str, ...] = ()

    def _choose_exchange(self, compressor: Any, d: int, *, wanted: str | None = None) -> None:
        asked = self.config.exchange if wanted is None else wanted
        self.exchange = resolve_exchange(asked)
        n = int(self.comm.world_size) if self.comm is not None else 1
        self.plan = None
        if self.exchange == "sharded":
            try:
                self.plan = ShardPlan(compressor, d, n, algo=self.name)
            except ValueError as exc:
                if asked is not None:  # asked for by name: refused in one line
                    raise
                # the default: a compressor or size that cannot be sharded all-gathers,
                # as every run did before the sharded exchange, and says so once
                warnings.warn(f"{exc}; this run all-gathers its payloads (exchange=allgather)", stacklevel=3)
                self.exchange = "allgather"

    def _exchange_state(self) -> dict:
        n = int(self.comm.world_size) if self.comm is not None else 1
        return {"exchange": self.exchange, "shards": n}

    def load_state_dict(self, sd: dict) -> None:
        sd = dict(sd)
        if "exchange" not in sd:  # written before the sharded exchange: it all-gathered
            if self.config.exchange == "sharded":
                raise ValueError(f"{self.name}: the state was written before the sharded exchange existed "
                                 f"(its run all-gathered); resume it without exchange=sharded, or with "
                                 f"exchange=allgather")
            if self.exchange != "allgather":
                self._switch_exchange("allgather")
            sd.update(self._exchange_state())
            for k in self._new_state_fields:  # entries added with the sharded exchange
                sd.setdefault(k, getattr(self.state, k))
        elif sd["exchange"] != self.exchange and self.config.exchange is None and sd["exchange"] == "allgather":
            # a run continued from a state of before the option (or one that asked for
            # allgather) keeps all-gathering when its config leaves the choice open
            self._switch_exchange("allgather")
        elif sd["exchange"] != self.exchange:
            raise ValueError(f"{self.name}: the state was written with exchange={sd['exchange']}, this run "
                             f"uses exchange={self.exchange}; resume with exchange={sd['exchange']}")
        elif self.exchange == "sharded" and int(sd["shards"]) != self._exchange_state()["shards"]:
            raise ValueError(f"{self.name}: the server state is sharded over {int(sd['shards'])} nodes, this run "
                             f"has {self._exchange_state()['shards']}; resume on {int(sd['shards'])} nodes")
        super().load_state_dict(sd)  # type: ignore[misc]

    def _switch_exchange(self, exchange: str) -> None:  # pragma: no cover - overridden
        raise NotImplementedError
