"""DeMo: Decoupled Momentum optimization (Peng, Quesnelle, Kingma 2024, arXiv:2411.19870).

The momentum is never all-reduced. Each worker keeps its own momentum ``delta``;
every step it extracts the momentum's "fast components" (the largest coefficients of
a chunked DCT), all-gathers them, removes them from its momentum (which therefore
acts as error feedback) and steps along the sign of their decoded average.

Worker i, gradient g_i, step size eta_t, decay beta (``compression_decay``):

1. delta_i <- beta delta_i + eta_t g_i;
2. q_i = TopK_chunk(DCT_chunk(delta_i)): each tensor cut into chunks of at most
   ``compression_chunk`` x ``compression_chunk`` values (``compression_chunk`` for
   1-D tensors), each chunk DCT-II transformed (orthonormal), the ``compression_topk``
   largest |coefficients| of every chunk kept (chunk-local index + fp32 value);
3. delta_i <- delta_i - IDCT(q_i)  (what was sent leaves the momentum);
4. all-gather the q_j of every worker;
5. Q = the coefficients of every worker at each position, averaged over the workers
   that sent that position; the gradient becomes sign(IDCT(Q));
6. the user's SGD (momentum 0) steps x <- x - eta_t sign(IDCT(Q)); its
   ``weight_decay`` wd is applied after this rewrite, x <- x (1 - eta_t wd) - eta_t
   sign(...), which is DeMo's decoupled weight decay.

Checked line by line against the reference code (github bloc97/DeMo, ``demo.py``):
step 1 is its ``delta.mul_(compression_decay).add_(grad, alpha=lr)`` with the group's
current lr; step 2 its ``TransformDCT.encode`` (orthonormal DCT-II per chunk, the basis
applied on both axes of a 2-D chunk) and ``CompressDCT.compress`` (``topk`` of |.| over
each chunk's flattened coefficients, clamped to the chunk size); step 3 its
``delta.sub_(transmit_grad)``; steps 4-6 its all-gather, ``batch_decompress``, decode
and ``grad.sign_()`` before a plain SGD step. Its decoupled weight decay multiplies
the parameters by (1 - lr wd) before the step; the user's SGD ``weight_decay`` adds
wd x to the rewritten gradient, which gives the same x (1 - eta_t wd) - eta_t sign(.).

Paper and reference code differ in step 5: the paper averages
the workers' q_j over all n workers; the code's ``scatter_reduce(..., "mean",
include_self=False)`` averages, at each coefficient, over the workers that sent it.
We follow the code. Chunk sizes follow the code too: a dimension of size s is cut in
chunks of the largest divisor of s not above ``compression_chunk`` (s itself when
s <= ``compression_chunk``); a tensor of more than two dimensions (a convolution) is
seen as (shape[0], rest), where the code handles only 1-D and 2-D tensors.

Untrusted workers (:mod:`gossip.robust`): a Byzantine worker's gradient g_i is crafted
(:class:`~gossip.robust.Adversary`) before step 1, so its momentum and the fast
components it sends are those of the crafted gradient (for ``signflip`` and
``scaled``, exactly the honest message negated or scaled). A robust ``aggregator``
(``median``, ``trimmed:f=F``, ``cclip:tau=T``) replaces step 5's mean: every worker
decodes every gathered message to a dense vector (IDCT of its coefficients, 0 where it
sent none) and applies the rule shard by shard
(:class:`~gossip.algorithms._robust.ShardedRule`), the same on every worker, before the
sign. The wire is unchanged; the cost is n inverse transforms and the rule over n x d
values on each worker, and for the median and the trimmed mean a coefficient that
fewer than half (n - 2F) of the workers sent counts as 0.

Wire: one payload per worker and step, header (32 bytes) + K chunk-local indices
(int16, int32 when a chunk holds more than 32767 values) + K fp32 values, K = the sum
over chunks of min(topk, chunk size), padded to 8 bytes. The all-gather sends
(n - 1) payloads per worker and step (the code's all-gather; it does not shrink with n).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from gossip._checks import check_float
from gossip.algorithms._common import check_int, step_tag
from gossip.algorithms._robust import ShardedRule, check_aggregator
from gossip.algorithms.base import Algorithm, ParamLayout, WireFormat
from gossip.compress import wire as _wire
from gossip.errors import PayloadError

__all__ = ["ChunkTopK", "DeMo", "DeMoConfig", "DeMoState", "dct_matrix", "smaller_split"]


# --------------------------------------------------------------------------------------
# The chunked (DCT) top-k codec, shared with SparseLoCo (without the DCT)
# --------------------------------------------------------------------------------------
def smaller_split(n: int, target: int) -> int:
    """The chunk length of a dimension of size ``n``: its largest divisor <= ``target``
    (``n`` when ``n`` <= ``target``; the smallest divisor above ``target`` if none is
    below it, i.e. never: 1 divides everything). As the reference code."""
    if n <= target:
        return n
    best = 1
    for k in range(1, math.isqrt(n) + 1):
        if n % k == 0:
            for v in (k, n // k):
                if v <= target and v > best:
                    best = v
    return best


def dct_matrix(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Orthonormal DCT-II as a matrix ``B`` (n, n): ``y = x @ B`` transforms the last
    dimension, ``x = y @ B.T`` inverts it. Computed in float64, then cast.

    Where the cosine is exactly 0 ((2 j + 1) b = n (mod 2 n), odd n) the entry is an
    exact 0, not cos's rounding residue: the sign step would otherwise turn a decoded
    exact zero into a random +-1 (the reference code's FFT-built basis has that residue)."""
    j = torch.arange(n, dtype=torch.int64).unsqueeze(1)
    b = torch.arange(n, dtype=torch.int64).unsqueeze(0)
    B = torch.cos(math.pi * ((2 * j + 1) * b).double() / (2 * n)) * math.sqrt(2.0 / n)
    B[((2 * j + 1) * b) % (2 * n) == n] = 0.0
    B[:, 0] = math.sqrt(1.0 / n)
    return B.to(dtype)


@dataclass(frozen=True)
class _Piece:
    """One tensor: flat offset, 2-D view (r, c) (c = 0 for 1-D), chunk (n1, n2), k."""

    offset: int
    r: int
    c: int
    n1: int
    n2: int
    k: int

    @property
    def numel(self) -> int:
        return self.r * max(self.c, 1)

    @property
    def chunks(self) -> int:
        return (self.r // self.n1) * ((self.c // self.n2) if self.c else 1)

    @property
    def chunk_numel(self) -> int:
        return self.n1 * (self.n2 if self.c else 1)


class ChunkTopK:
    """Chunked top-k of a flat parameter-shaped vector, optionally in the DCT domain.

    ``encode(X)`` (m, d) -> (indices (m, K) int64 chunk-local, values (m, K) fp32),
    chunk by chunk in tensor order; ``coeffs(indices, values)`` rebuilds the dense
    transformed rows with each position averaged over the rows (workers) that sent it;
    ``decode`` inverts the transform. ``pack``/``unpack`` put (indices, values) on the
    wire with the shared 32-byte header and checksum.
    """

    #: header compressor id of these payloads: no registry compressor uses 0
    CID = 0

    def __init__(self, layout: ParamLayout, *, chunk: int, topk: int | None = None, fraction: float | None = None,
                 dct: bool, label: str) -> None:
        """``topk`` coefficients per chunk (DeMo), or ``fraction`` of every chunk's values,
        at least one (SparseLoCo)."""
        self.dct = dct
        self.pieces: list[_Piece] = []
        for (off, numel), shape in zip(layout.blocks, layout.shapes):
            if numel == 0:
                continue
            if len(shape) >= 2:
                r, c = shape[0], numel // shape[0]
                n1, n2 = smaller_split(r, chunk), smaller_split(c, chunk)
                cn = n1 * n2
            else:
                r, c = numel, 0
                n1, n2 = smaller_split(r, chunk), 1
                cn = n1
            k = topk if topk is not None else max(1, round(fraction * cn))
            self.pieces.append(_Piece(off, r, c, n1, n2, min(k, cn)))
        self.dim = layout.dim
        self.K = sum(p.chunks * p.k for p in self.pieces)
        big = max(p.chunk_numel for p in self.pieces)
        self.index_dtype = torch.int16 if big <= 32767 else torch.int32
        self.layout = _wire.Layout(self._segments())
        shapes = ";".join(f"{p.r}x{p.c}" for p in self.pieces)
        self.spec = f"{label}:chunk={chunk},topk={topk},fraction={fraction},dct={int(dct)},shapes={shapes}"
        self._phash = _wire.params_hash(self.spec)
        self._basis: dict[int, torch.Tensor] = {}

    def _segments(self) -> tuple:
        return (("indices", self.index_dtype, self.K), ("values", torch.float32, self.K))

    # ---- sizes ---------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of one payload: header, indices, values, padding."""
        return self.layout.nbytes

    @property
    def ideal_nbytes(self) -> int:
        """Index and value bytes, no header or padding."""
        return self.K * (torch.tensor([], dtype=self.index_dtype).element_size() + 4)

    # ---- the transform, per piece ----------------------------------------------------
    def _B(self, n: int, X: torch.Tensor) -> torch.Tensor:
        B = self._basis.get(n)
        if B is None or B.device != X.device or B.dtype != X.dtype:
            B = self._basis[n] = dct_matrix(n, X.dtype).to(X.device)
        return B

    def _chunked(self, p: _Piece, X: torch.Tensor) -> torch.Tensor:
        """(m, chunks, chunk_numel): the piece's chunks, transformed if ``dct``."""
        m = X.shape[0]
        x = X[:, p.offset:p.offset + p.numel]
        if p.c:
            x = x.reshape(m, p.r // p.n1, p.n1, p.c // p.n2, p.n2)
            if self.dct:
                x = torch.einsum("myhxw,hb,wd->myxbd", x, self._B(p.n1, X), self._B(p.n2, X))
            else:
                x = x.permute(0, 1, 3, 2, 4)
            return x.reshape(m, p.chunks, p.chunk_numel)
        x = x.reshape(m, p.r // p.n1, p.n1)
        return x @ self._B(p.n1, X) if self.dct else x

    def _unchunk(self, p: _Piece, y: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`_chunked`: (m, chunks, chunk_numel) -> (m, numel)."""
        m = y.shape[0]
        if p.c:
            y = y.reshape(m, p.r // p.n1, p.c // p.n2, p.n1, p.n2)
            if self.dct:
                y = torch.einsum("myxbd,hb,wd->myhxw", y, self._B(p.n1, y), self._B(p.n2, y))
            else:
                y = y.permute(0, 1, 3, 2, 4)
            return y.reshape(m, p.numel)
        if self.dct:
            y = y @ self._B(p.n1, y).T
        return y.reshape(m, p.numel)

    # ---- encode / decode -----------------------------------------------------------
    def encode(self, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx, val = [], []
        for p in self.pieces:
            y = self._chunked(p, X)
            i = torch.topk(y.abs(), k=p.k, dim=-1, largest=True, sorted=False).indices
            idx.append(i.reshape(X.shape[0], -1))
            val.append(torch.gather(y, -1, i).reshape(X.shape[0], -1))
        return torch.cat(idx, 1), torch.cat(val, 1)

    def coeffs(self, idx: torch.Tensor, val: torch.Tensor) -> list[torch.Tensor]:
        """Per piece, the (1, chunks, chunk_numel) transformed values: at each position
        the mean of the values the rows sent there (0 where none did), as the reference
        code's ``scatter_reduce(mean, include_self=False)`` over the rows in order."""
        out, pos = [], 0
        n = idx.shape[0]
        for p in self.pieces:
            cnt = p.chunks * p.k
            i = idx[:, pos:pos + cnt].reshape(n, p.chunks, p.k).permute(1, 0, 2).reshape(p.chunks, n * p.k)
            v = val[:, pos:pos + cnt].reshape(n, p.chunks, p.k).permute(1, 0, 2).reshape(p.chunks, n * p.k)
            y = torch.zeros(p.chunks, p.chunk_numel, dtype=val.dtype, device=val.device)
            y.scatter_reduce_(-1, i, v, reduce="mean", include_self=False)
            out.append(y.unsqueeze(0))
            pos += cnt
        return out

    def decode(self, coeffs: list[torch.Tensor]) -> torch.Tensor:
        """The (m, d) rows back from per-piece (m, chunks, chunk_numel) coefficients."""
        parts = [self._unchunk(p, y) for p, y in zip(self.pieces, coeffs)]
        return torch.cat(parts, 1)

    def decode_each(self, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
        """Every row decoded on its own (each row's own indices are distinct)."""
        rows = [self.decode(self.coeffs(idx[r:r + 1], val[r:r + 1])) for r in range(idx.shape[0])]
        return torch.cat(rows, 0)

    # ---- the wire ----------------------------------------------------------------------
    def pack(self, idx: torch.Tensor, val: torch.Tensor, tag: int) -> torch.Tensor:
        m = idx.shape[0]
        P = torch.zeros(m, self.nbytes, dtype=torch.uint8, device=idx.device)
        views = self.layout.views(P)
        views["indices"].copy_(idx.to(self.index_dtype))
        self._write_values(views, val)
        _wire.write_header(P, self.CID, self._phash, self.dim, torch.zeros(m, dtype=torch.int64), tag)
        return P

    def unpack(self, P: torch.Tensor, tag: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices int64, values fp32) of every row; a row of another format, size, step
        or a damaged one raises :class:`~gossip.errors.PayloadError` naming the row."""
        if P.dim() != 2 or P.shape[1] != self.nbytes:
            raise PayloadError(0, "size", f"expected {self.nbytes} bytes ({self.spec}), got {tuple(P.shape)}")
        f = _wire.header_fields(P)
        word0 = _wire.MAGIC_WORD0 | (self.CID << 24)
        checks = (
            ((f["word0"] != word0) | (f["phash"] != self._phash) | (f["numel"] != self.dim), "format",
             lambda r: f"not a {self.spec} payload of {self.dim} values"),
            (f["tag"] != tag, "tag", lambda r: f"expected {tag}, got {int(f['tag'][r])}"),
            (_wire.checksum(P) != f["checksum"], "checksum", lambda r: "damaged payload"),
        )
        for bad, what, detail in checks:  # in this order: one vectorised test each
            rows = bad.nonzero()
            if rows.numel():
                r = int(rows[0])
                raise PayloadError(r, what, detail(r))
        views = self.layout.views(P)
        return views["indices"].to(torch.int64), self._read_values(views)

    def _write_values(self, views: dict, val: torch.Tensor) -> None:
        views["values"].copy_(val.to(torch.float32))

    def _read_values(self, views: dict) -> torch.Tensor:
        return views["values"].clone()


# --------------------------------------------------------------------------------------
# DeMo
# --------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class DeMoConfig:
    """The reference code's names and defaults: ``compression_decay`` beta 0.999 (the
    momentum's decay), ``compression_topk`` 32 coefficients kept per chunk,
    ``compression_chunk`` 64 (chunks of up to 64 x 64 values)."""

    compression_decay: float = 0.999
    compression_topk: int = 32
    compression_chunk: int = 64
    seed: int = 0
    #: the rule over the workers' messages in place of step 5's mean (``--aggregator``)
    aggregator: str = "mean"

    def __post_init__(self) -> None:
        if isinstance(self.compression_decay, bool) or not isinstance(self.compression_decay, (int, float)):
            raise TypeError(f"Arg `compression_decay` must be a number, got {self.compression_decay!r}")
        try:
            check_float("Arg `compression_decay`", self.compression_decay, lo=0.0, hi=1.0, hi_open=True)
        except ValueError:
            raise ValueError(
                f"Arg `compression_decay` must satisfy 0 <= compression_decay < 1, got {self.compression_decay}"
            ) from None
        check_int("compression_topk", self.compression_topk, minimum=1)
        check_int("compression_chunk", self.compression_chunk, minimum=1)
        check_int("seed", self.seed, minimum=0)
        check_aggregator(self.aggregator, "demo")

    @property
    def momentum(self) -> float:
        """DeMo's momentum is its decay beta (named in the momentum-conflict message)."""
        return self.compression_decay


@dataclass
class DeMoState:
    """``t`` counts steps from 1; ``lr`` the coming step's eta_t; ``delta`` (m, d) each
    hosted worker's momentum (the part not yet sent)."""

    t: int
    lr: float
    delta: torch.Tensor
    #: (1, d) centered clipping's previous aggregate (``aggregator`` ``cclip``), empty otherwise
    center: torch.Tensor = field(default_factory=lambda: torch.zeros(0))


class DeMo(Algorithm):
    """DeMo; the steps are numbered in the module docstring."""

    name = "demo"
    Config = DeMoConfig
    summary = "DeMo: local momentum, all-gather of its top DCT coefficients per chunk, sign step"
    acts_on = "gradient"
    decentralized = False
    local_momentum_default = 0.0
    byzantine_messages = True

    @classmethod
    def momentum_of(cls, config: Any) -> float:
        return config.momentum  # the decay beta of the momentum it keeps (step 1)

    def __init__(self, config: DeMoConfig, comm: Any) -> None:
        super().__init__(config, comm)
        self.codec: ChunkTopK | None = None
        self.aggregator = check_aggregator(config.aggregator, self.name)
        #: the robust rule of step 5 (None: the mean)
        self.rule: ShardedRule | None = None
        if not self.aggregator.is_mean:
            self.aggregator.check_nodes(int(comm.world_size), "Arg `aggregator`")

    def set_lr(self, lr: float) -> None:
        check_float("Arg `lr`", lr, lo=0.0, lo_open=True)
        if self.state is None:
            raise RuntimeError(f"{self.name}: call setup() before set_lr()")
        self.state.lr = float(lr)

    def setup(self, X: torch.Tensor, layout: ParamLayout | None = None) -> None:
        layout = self._take_layout(X, layout)
        cfg = self.config
        self.codec = ChunkTopK(layout, chunk=cfg.compression_chunk, topk=cfg.compression_topk, dct=True,
                               label="demo")
        self.state = DeMoState(t=1, lr=1.0, delta=torch.zeros_like(X))
        if not self.aggregator.is_mean:
            self.rule = ShardedRule.on_state(self.aggregator, self.state, X, int(self.comm.world_size), what=self.name)

    def state_dict(self) -> dict:
        sd = super().state_dict()
        if not sd["center"].numel():  # as before the option existed
            sd.pop("center")
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if self.state is not None and "center" not in sd and not self.state.center.numel():
            sd = {**sd, "center": self.state.center}
        super().load_state_dict(sd)

    def wire_format(self) -> WireFormat:
        cfg = self.config
        d = self.layout.dim if self.layout is not None else 1
        bits = round(8.0 * self.codec.ideal_nbytes / d, 4) if self.codec is not None else 32.0
        return WireFormat(f"demo:chunk={cfg.compression_chunk},topk={cfg.compression_topk}", bits)

    @torch.no_grad()
    def reduce_gradients(self, G: torch.Tensor) -> None:
        st, cfg, ledger, codec = self.state, self.config, self.comm.ledger, self.codec
        tag = step_tag(st.t)
        with ledger.phase("compute"):  # 1
            # the Byzantine workers' gradients are crafted (G itself takes the direction below)
            g = G if self.adversary is None else self.adversary.craft(G, self.comm.nodes, st.t, stream="grad")
            st.delta.mul_(cfg.compression_decay).add_(g.to(st.delta.dtype), alpha=st.lr)
        with ledger.phase("compress"):
            idx, val = codec.encode(st.delta)  # 2
            payload = codec.pack(idx, val, tag)
            st.delta.sub_(codec.decode_each(idx, val).to(st.delta.dtype))  # 3
        with ledger.phase("communicate"):
            gathered = self.comm.all_gather(payload)  # 4
        with ledger.phase("compress"):  # 5
            gi, gv = codec.unpack(gathered, tag)
            if self.rule is not None:  # the robust rule over every worker's decoded message
                direction = torch.sign(self.rule.local(codec.decode_each(gi, gv)).view(1, -1))
            else:
                direction = torch.sign(codec.decode(codec.coeffs(gi, gv)))
            G.copy_(direction.to(G.dtype).expand_as(G))
        st.t += 1

    def report(self) -> dict | None:
        c = self.codec
        return {"coefficients_per_step": c.K, "payload_nbytes": c.nbytes,
                "chunks": [[p.n1, p.n2 if p.c else 0] for p in c.pieces]} if c is not None else None
