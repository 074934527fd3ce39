"""SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky 2025, "Communication Efficient LLM
Pre-training with SparseLoCo", arXiv:2508.15706).

DiLoCo whose outer momentum is replaced by a per-worker error-feedback accumulator:
the pseudo-gradient goes into the accumulator, the accumulator's chunk-wise top-k is
quantized to a few bits and sent, and what was sent leaves the accumulator.

Worker i, round start theta (the same on every worker), H = ``local_steps`` inner
steps of the user's optimizer (AdamW by default), EF decay beta (``ef_decay``), outer
step size alpha (``outer_lr``):

1. inner: H steps of the local optimizer, x_i <- InnerOpt_H(theta);
2. Delta_i = theta - x_i (the pseudo-gradient);
3. e_i <- beta e_i + Delta_i;
4. Dhat_i = Q(TopK_chunk(e_i)): each tensor cut in chunks (``chunk`` x ``chunk`` for
   2-D tensors, ``chunk`` for 1-D, as DeMo's), the ``topk_fraction`` largest |e| of
   each chunk kept (at least one), their values quantized to ``bits`` bits with one
   fp32 scale per chunk (``bits`` = 32: fp32 values, no quantization);
5. e_i <- e_i - Dhat_i (the quantization error is fed back too);
6. all-gather the Dhat_j; Delta = (1/n) sum_j Dhat_j, the same on every worker;
7. x_i <- theta - alpha Delta; theta <- x_i.

Quantizer (our choice where the paper's text leaves it open): the 2^b levels are
evenly spaced on [-s, s], s = max |kept value| of the chunk, each value rounded to the
nearest level (deterministic, no zero level for even 2^b: 2 bits are {-s, -s/3, s/3,
s}). Aggregation: the mean over all n workers of the paper's equation, not DeMo's
mean over the workers that sent a coordinate.

The authors' code was not available to check against. Its predecessor in the same
line of work (templar's CCLoco optimizer, chunked top-k with error feedback after
bloc97/DeMo) makes two other choices, which we note without following: it averages
each coordinate over the workers that sent it (DeMo's ``scatter_reduce`` mean), and
its quantizer is statistical (values centred on their mean, bins spread over a range
of standard deviations, each bin decoded as the mean of the values it holds, that
table sent with the codes). Ours keeps the paper's mean over n and a max-scaled
uniform quantizer, whose payload is the one counted below.

Degenerate settings: ``topk_fraction=1, bits=32, ef_decay=0`` sends the exact
pseudo-gradient and is DiLoCo with ``outer_momentum=0`` and the same ``outer_lr``.

Wire per worker and round: header (32 bytes) + K chunk-local indices (int16) + K
b-bit codes (packed, 8/b per byte) + one fp32 scale per chunk, padded to 8 bytes,
all-gathered: (n - 1) payloads sent per worker and round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gossip._checks import check_float
from gossip.algorithms._common import check_int, step_tag
from gossip.algorithms.base import ParamLayout, WireFormat
from gossip.algorithms.demo import ChunkTopK
from gossip.algorithms.localsgd import _Periodic

__all__ = ["SparseLoCo", "SparseLoCoConfig", "SparseLoCoState"]

_BITS = (1, 2, 4, 8, 32)


def check_topk_fraction(value: Any) -> None:
    """``0 < topk_fraction <= 1``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"Arg `topk_fraction` must be a number, got {value!r}")
    try:
        check_float("Arg `topk_fraction`", value, lo=0.0, hi=1.0, lo_open=True)
    except ValueError:
        raise ValueError(f"Arg `topk_fraction` must be in (0, 1], got {value}") from None


@dataclass(frozen=True, kw_only=True)
class SparseLoCoConfig:
    """``local_steps`` H 15, ``outer_lr`` alpha 1, ``ef_decay`` beta 0.95, ``chunk`` 64
    (64 x 64 chunks), ``topk_fraction`` 1/64 of each chunk (64 of 4096: inside the paper's
    1-3 % density), ``bits`` 2."""

    local_steps: int = 15
    outer_lr: float = 1.0
    ef_decay: float = 0.95
    topk_fraction: float = 1 / 64
    bits: int = 2
    chunk: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("local_steps", self.local_steps, minimum=1)
        check_float("Arg `outer_lr`", self.outer_lr, lo=0.0, lo_open=True)
        if isinstance(self.ef_decay, bool) or not isinstance(self.ef_decay, (int, float)):
            raise TypeError(f"Arg `ef_decay` must be a number, got {self.ef_decay!r}")
        try:
            check_float("Arg `ef_decay`", self.ef_decay, lo=0.0, hi=1.0)
        except ValueError:
            raise ValueError(f"Arg `ef_decay` must be in [0, 1], got {self.ef_decay}") from None
        check_topk_fraction(self.topk_fraction)
        if isinstance(self.bits, bool) or self.bits not in _BITS:
            raise ValueError(f"Arg `bits` must be one of {', '.join(map(str, _BITS))} (32: fp32 values), got {self.bits!r}")
        check_int("chunk", self.chunk, minimum=1)
        check_int("seed", self.seed, minimum=0)


@dataclass
class SparseLoCoState:
    """``t`` local steps taken; ``start`` (m, d) theta, the round's start; ``error`` (m, d)
    each hosted worker's accumulator e_i."""

    t: int
    start: torch.Tensor
    error: torch.Tensor


class QuantChunkTopK(ChunkTopK):
    """:class:`ChunkTopK` whose values travel as ``bits``-bit codes with an fp32 scale
    per chunk (``bits`` = 32: fp32 values)."""

    def __init__(self, layout: ParamLayout, *, chunk: int, fraction: float, bits: int) -> None:
        self.bits = bits
        super().__init__(layout, chunk=chunk, fraction=fraction, dct=False, label=f"sparseloco-b{bits}")
        self.nchunks = sum(p.chunks for p in self.pieces)

    def _segments(self) -> tuple:
        if self.bits == 32:
            return super()._segments()
        per = 8 // self.bits
        nchunks = sum(p.chunks for p in self.pieces)
        return (("indices", self.index_dtype, self.K), ("codes", torch.uint8, (self.K + per - 1) // per),
                ("scales", torch.float32, nchunks))

    @property
    def ideal_nbytes(self) -> int:
        isz = torch.tensor([], dtype=self.index_dtype).element_size()
        if self.bits == 32:
            return self.K * (isz + 4)
        return self.K * isz + (self.K * self.bits + 7) // 8 + 4 * self.nchunks

    def _chunks_of(self, val: torch.Tensor) -> list[torch.Tensor]:
        out, pos = [], 0
        for p in self.pieces:
            out.append(val[:, pos:pos + p.chunks * p.k].reshape(val.shape[0], p.chunks, p.k))
            pos += p.chunks * p.k
        return out

    def quantize(self, val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes (m, K) uint8, scales (m, chunks) fp32) of the kept values."""
        L = (1 << self.bits) - 1
        codes, scales = [], []
        for v in self._chunks_of(val.to(torch.float32)):
            s = v.abs().amax(-1, keepdim=True)
            u = torch.where(s > 0, v / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(v))
            codes.append(torch.round((u + 1) * (L / 2)).clamp_(0, L).to(torch.uint8).reshape(val.shape[0], -1))
            scales.append(s.squeeze(-1))
        return torch.cat(codes, 1), torch.cat(scales, 1)

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        L = (1 << self.bits) - 1
        out, pos, cpos = [], 0, 0
        m = codes.shape[0]
        for p in self.pieces:
            c = codes[:, pos:pos + p.chunks * p.k].reshape(m, p.chunks, p.k).to(torch.float32)
            s = scales[:, cpos:cpos + p.chunks].unsqueeze(-1)
            out.append(((c * (2.0 / L) - 1.0) * s).reshape(m, -1))
            pos += p.chunks * p.k
            cpos += p.chunks
        return torch.cat(out, 1)

    def round_trip(self, val: torch.Tensor) -> torch.Tensor:
        """The values the receivers will decode: Q then Q^-1 (identity for 32 bits)."""
        if self.bits == 32:
            return val.to(torch.float32)
        return self.dequantize(*self.quantize(val))

    def _write_values(self, views: dict, val: torch.Tensor) -> None:
        if self.bits == 32:
            return super()._write_values(views, val)
        codes, scales = self.quantize(val)
        per, m = 8 // self.bits, codes.shape[0]
        pad = (-codes.shape[1]) % per
        c = torch.cat([codes, codes.new_zeros(m, pad)], 1).reshape(m, -1, per).to(torch.int32)
        shifts = torch.arange(per, dtype=torch.int32) * self.bits
        views["codes"].copy_((c << shifts).sum(-1).to(torch.uint8))
        views["scales"].copy_(scales)

    def _read_values(self, views: dict) -> torch.Tensor:
        if self.bits == 32:
            return super()._read_values(views)
        per = 8 // self.bits
        packed = views["codes"].to(torch.int32)
        shifts = torch.arange(per, dtype=torch.int32) * self.bits
        codes = ((packed.unsqueeze(-1) >> shifts) & ((1 << self.bits) - 1)).reshape(packed.shape[0], -1)
        return self.dequantize(codes[:, : self.K], views["scales"])


class SparseLoCo(_Periodic):
    """SparseLoCo; the steps are numbered in the module docstring."""

    name = "sparseloco"
    Config = SparseLoCoConfig
    summary = "SparseLoCo: H inner (AdamW) steps, error-fed chunk top-k + 2-bit pseudo-gradients, no outer momentum"
    local_optimizer_default = "adamw"

    def __init__(self, config: SparseLoCoConfig, comm: Any) -> None:
        super().__init__(config, comm)
        self.codec: QuantChunkTopK | None = None

    def setup(self, X: torch.Tensor, layout: ParamLayout | None = None) -> None:
        layout = self._take_layout(X, layout)
        cfg = self.config
        self.codec = QuantChunkTopK(layout, chunk=cfg.chunk, fraction=cfg.topk_fraction, bits=cfg.bits)
        self.state = SparseLoCoState(t=0, start=X.detach().clone(), error=torch.zeros_like(X))

    def wire_format(self) -> WireFormat:
        cfg = self.config
        d = self.layout.dim if self.layout is not None else 1
        bits = round(8.0 * self.codec.ideal_nbytes / d, 4) if self.codec is not None else 32.0
        return WireFormat(f"sparseloco:topk_fraction={cfg.topk_fraction:g},bits={cfg.bits},chunk={cfg.chunk}", bits)

    @torch.no_grad()
    def step(self, X: torch.Tensor, U: torch.Tensor) -> None:
        if not self._local(X, U):  # 1
            return
        st, cfg, ledger, codec = self.state, self.config, self.comm.ledger, self.codec
        tag = step_tag(st.t)
        with ledger.phase("compute"):
            delta = st.start - X  # 2
            st.error.mul_(cfg.ef_decay).add_(delta)  # 3
        with ledger.phase("compress"):
            idx, val = codec.encode(st.error)  # 4
            payload = codec.pack(idx, val, tag)
            sent = codec.round_trip(val).to(X.dtype)
            st.error.sub_(codec.decode_each(idx, sent))  # 5
        with ledger.phase("communicate"):
            gathered = self.comm.all_gather(payload)  # 6
        with ledger.phase("compress"):
            gi, gv = codec.unpack(gathered, tag)
            outer = codec.decode_each(gi, gv.to(X.dtype)).mean(0, keepdim=True)
        with ledger.phase("compute"):  # 7
            X.copy_(st.start - cfg.outer_lr * outer)
            st.start.copy_(X)

    def report(self) -> dict | None:
        c = self.codec
        return {"values_per_round": c.K, "payload_nbytes": c.nbytes} if c is not None else None
