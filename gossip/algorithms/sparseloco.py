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
   2-D tensors, ``chunk`` for 1-D, each side the largest divisor of the dimension not
   above ``chunk``, as DeMo's), the k = max(1, round(``topk_fraction`` x chunk size))
   largest |e| of each chunk kept, their values quantized to ``bits`` bits
   (``bits`` = 32: fp32 values, no quantization);
5. e_i <- e_i - Dhat_i (the quantization error is fed back too);
6. all-gather the Dhat_j; Delta = at each coordinate, the mean of the values the
   workers that sent it sent (``aggregate="senders"``; 0 where none did), the same on
   every worker;
7. x_i <- theta - alpha Delta; theta <- x_i.

The quantizer Q (``quantizer="statistical"``), per tensor and worker, on the tensor's
kept values v (all its chunks): mu = mean(v), c = v - mu, sigma = ||c|| / sqrt(n - 1)
(0 for one value), s = ``quant_range`` sigma / 2^b (1 where that is 0 or not finite);
code = clamp(round(c / s + 2^(b-1)), 0, 2^b - 1); each code decodes to mu plus the mean
of the c that fell in its bin (0 for an empty bin). The codes travel with mu and the
2^b bin means of every tensor.

Checked against the authors' code. The paper's released reference (github
tplr-ai/SparseLoCo, ``src/tplr/sparseloco.py``, the ``SparseLoCo`` optimizer and its
``TopKCompressor``, no DCT in the SparseLoCo strategy) and the Templar network's
production code (github tplr-ai/templar v2.1.3, ``src/tplr/compress.py``,
``src/tplr/neurons.py``) agree on every point below:

- steps 3-5 are their ``error_buffer.mul_(decay).add_(grad, alpha=lr)``, chunk top-k
  of |e| (``torch.topk(..., sorted=False)``), statistical quantization with 2^b bins
  over ``quant_range`` = 6 standard deviations, and ``error_buffer.sub_`` of the
  dequantized values;
- step 6 is their ``scatter_reduce(reduce="mean", include_self=False)`` over the
  gathered indices: the paper's equation averages over all R workers,
  Delta = (1/R) sum_r Dhat_r, which differs wherever the workers' supports differ. We
  follow the code, whose results the paper reports; ``aggregate="workers"`` gives the
  paper's equation;
- step 7 is a plain SGD step (momentum 0, no sign, no weight decay in the LoCo
  setting).

Where we differ from the code, and why:

- the code adds alpha Delta_i, not Delta_i, to the accumulator (DeMo's ``alpha=lr``)
  and then steps alpha again. Top-k and Q commute with a positive scale, so the code at
  outer rate alpha is this rule at alpha^2 (to rounding); at the paper's alpha = 1 they
  coincide. We keep the paper's step 3, which keeps ``outer_lr`` the step size;
- the code's k for a 64 x 64 chunk is ``top_k`` (k / 4096 = ``topk_fraction``), scaled
  to smaller chunks by their size: the same rule as ours. The production code
  additionally rounds k to an even number of at least 2 (for its 12-bit index packing)
  and clips each peer's values to the median peer norm before averaging (a guard
  against untrusted peers on an open network); neither is part of the method and
  neither is done here;
- indices travel as int16 (int32 for chunks over 32767 values), where the production
  code packs 12 bits.

Defaults: the production code's ``topk_compression`` 64 of a 64 x 64 chunk (1/64),
2 bits (``quantization_bins`` 4), range 6, decay 0.95, alpha 1; the reference's
released 512M sweep uses 128 (1/32), the same otherwise, with H = 15.

``quantizer="uniform"``, ``aggregate="workers"`` is this module's earlier rule (2^b
levels evenly spaced on [-s, s], s = the chunk's largest |kept value|, one fp32 scale
per chunk; mean over all n workers), kept so that runs checkpointed under it resume.

Degenerate settings: ``topk_fraction=1, bits=32, ef_decay=0`` sends the exact
pseudo-gradient and is DiLoCo with ``outer_momentum=0`` and the same ``outer_lr``.

Untrusted workers (:mod:`gossip.robust`): a Byzantine worker's pseudo-gradient Delta_i is
crafted (:class:`~gossip.robust.Adversary`) after step 2 and goes through steps 3-5 as an
honest one's. A robust ``aggregator`` (``median``, ``trimmed:f=F``, ``cclip:tau=T``)
replaces step 6's mean: every worker decodes every gathered message to a dense vector
(0 where that worker sent nothing) and applies the rule shard by shard
(:class:`~gossip.algorithms._robust.ShardedRule`), the same on every worker. The wire
is unchanged (the all-gather already hands every message to every worker); the cost is
n dense decodes and the rule over n x d values on each worker, and, for the median and
the trimmed mean, a coordinate that fewer than half (n - 2F) of the workers sent
aggregates to 0 (its mass stays out of the update, not in the senders' accumulators).
``aggregate`` then plays no part.

Wire per worker and round: header (32 bytes) + K chunk-local indices (int16) + K
b-bit codes (packed, 8/b per byte) + per tensor 1 + 2^b fp32 (mu and the bin means;
``uniform``: one fp32 scale per chunk), padded to 8 bytes, all-gathered: (n - 1)
payloads sent per worker and round.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from gossip._checks import check_float
from gossip.algorithms._common import check_int, step_tag
from gossip.algorithms._robust import ShardedRule, check_aggregator
from gossip.algorithms.base import ParamLayout, WireFormat
from gossip.algorithms.demo import ChunkTopK
from gossip.algorithms.localsgd import PeriodicBase

__all__ = ["SparseLoCo", "SparseLoCoConfig", "SparseLoCoState"]

_BITS = (1, 2, 4, 8, 32)
_QUANTIZERS = ("statistical", "uniform")
_AGGREGATES = ("senders", "workers")
#: what a checkpoint written before the rule was recorded ran with
_EARLIER_RULE = {"quantizer": "uniform", "aggregate": "workers"}


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
    (64 x 64 chunks), ``topk_fraction`` 1/64 of each chunk (64 of 4096, the authors'
    production setting: inside the paper's 1-3 % density), ``bits`` 2, ``quantizer``
    "statistical" over ``quant_range`` 6 standard deviations and ``aggregate``
    "senders" (the authors' code; see the module docstring for the alternatives)."""

    local_steps: int = 15
    outer_lr: float = 1.0
    ef_decay: float = 0.95
    topk_fraction: float = 1 / 64
    bits: int = 2
    chunk: int = 64
    quantizer: str = "statistical"
    quant_range: float = 6.0
    aggregate: str = "senders"
    seed: int = 0
    #: DiLoCo's ``outer_delay``, refused unless 0 (see ``__post_init__``)
    outer_delay: int = 0
    #: the rule over the workers' messages in place of step 6's mean (``--aggregator``)
    aggregator: str = "mean"

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
        if self.quantizer not in _QUANTIZERS:
            raise ValueError(f"Arg `quantizer` must be one of {', '.join(_QUANTIZERS)}, got {self.quantizer!r}")
        if isinstance(self.quant_range, bool) or not isinstance(self.quant_range, (int, float)):
            raise TypeError(f"Arg `quant_range` must be a number, got {self.quant_range!r}")
        check_float("Arg `quant_range`", self.quant_range, lo=0.0, lo_open=True)
        if self.aggregate not in _AGGREGATES:
            raise ValueError(f"Arg `aggregate` must be one of {', '.join(_AGGREGATES)}, got {self.aggregate!r}")
        check_int("seed", self.seed, minimum=0)
        check_aggregator(self.aggregator, "sparseloco")
        if self.outer_delay != 0:
            # The eager overlap (Kale et al. 2025, arXiv:2502.12996) swaps the node's stale
            # 1/n share of the mean for its fresh pseudo-gradient and leans on the outer
            # momentum; SparseLoCo has neither: the mean is over each coordinate's senders,
            # the accumulator (not a momentum) carries what is not yet sent, and its paper
            # synchronises every round.
            raise ValueError(f"Arg `outer_delay` must be 0 for sparseloco, got {self.outer_delay!r}: its paper "
                             f"has no delayed outer step, and the eager correction (swap the node's 1/n share "
                             f"of the mean for its fresh pseudo-gradient) is undefined for its per-coordinate "
                             f"mean over senders with error feedback in place of outer momentum; use diloco or "
                             f"muloco with outer_delay=1")
        if self.quant_range != 6.0 and (self.quantizer != "statistical" or self.bits == 32):
            warnings.warn(f"sparseloco: `quant_range` {self.quant_range} has no effect with quantizer="
                          f"{self.quantizer!r}, bits={self.bits} (only the statistical quantizer uses it)",
                          stacklevel=3)


@dataclass
class SparseLoCoState:
    """``t`` local steps taken; ``start`` (m, d) theta, the round's start; ``error`` (m, d)
    each hosted worker's accumulator e_i; ``quantizer`` and ``aggregate`` the rule the
    accumulators were built under (a resume under another rule is refused)."""

    t: int
    start: torch.Tensor
    error: torch.Tensor
    quantizer: str = "statistical"
    aggregate: str = "senders"
    #: (1, d) centered clipping's previous aggregate (``aggregator`` ``cclip``), empty otherwise
    center: torch.Tensor = field(default_factory=lambda: torch.zeros(0))


class QuantChunkTopK(ChunkTopK):
    """:class:`ChunkTopK` whose values travel as ``bits``-bit codes (``bits`` = 32: fp32
    values): ``statistical``, per tensor the mean and the 2^b bin means in fp32 beside
    the codes; ``uniform``, one fp32 scale per chunk."""

    def __init__(self, layout: ParamLayout, *, chunk: int, fraction: float, bits: int,
                 quantizer: str = "statistical", quant_range: float = 6.0) -> None:
        self.bits, self.quantizer, self.quant_range = bits, quantizer, float(quant_range)
        label = f"sparseloco-b{bits}" if bits == 32 else (
            f"sparseloco-b{bits}-statistical-r{self.quant_range:g}" if quantizer == "statistical"
            else f"sparseloco-b{bits}")
        super().__init__(layout, chunk=chunk, fraction=fraction, dct=False, label=label)
        self.nchunks = sum(p.chunks for p in self.pieces)

    @property
    def _nstats(self) -> int:
        """fp32 values sent beside the codes."""
        if self.quantizer == "statistical":
            return len(self.pieces) * (1 + (1 << self.bits))
        return sum(p.chunks for p in self.pieces)

    def _segments(self) -> tuple:
        if self.bits == 32:
            return super()._segments()
        per = 8 // self.bits
        stats = "stats" if self.quantizer == "statistical" else "scales"
        return (("indices", self.index_dtype, self.K), ("codes", torch.uint8, (self.K + per - 1) // per),
                (stats, torch.float32, self._nstats))

    @property
    def ideal_nbytes(self) -> int:
        isz = torch.tensor([], dtype=self.index_dtype).element_size()
        if self.bits == 32:
            return self.K * (isz + 4)
        return self.K * isz + (self.K * self.bits + 7) // 8 + 4 * self._nstats

    def _of_pieces(self, val: torch.Tensor) -> list[torch.Tensor]:
        """The (m, chunks * k) kept values of each tensor."""
        out, pos = [], 0
        for p in self.pieces:
            out.append(val[:, pos:pos + p.chunks * p.k])
            pos += p.chunks * p.k
        return out

    # ---- the statistical quantizer (the authors' code) ------------------------------
    def _stat_quantize(self, val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes (m, K) uint8, stats (m, pieces * (1 + 2^b)) fp32: per tensor mu, then
        the bin means of the centred values)."""
        bins = 1 << self.bits
        codes, stats = [], []
        for v in self._of_pieces(val.to(torch.float32)):
            m, n = v.shape
            mu = v.mean(-1, keepdim=True)
            c = v - mu
            if n > 1:
                sigma = torch.linalg.vector_norm(c, dim=-1, keepdim=True) / math.sqrt(n - 1)
            else:
                sigma = torch.zeros_like(mu)
            s = self.quant_range * sigma / bins
            s = torch.where((s == 0) | ~torch.isfinite(s), torch.ones_like(s), s)
            code = (c / s + bins // 2).round().clamp(0, bins - 1).to(torch.uint8)
            ci = code.long()
            sums = torch.zeros(m, bins, dtype=torch.float32, device=v.device).scatter_add_(1, ci, c)
            counts = torch.zeros(m, bins, dtype=torch.float32, device=v.device).scatter_add_(1, ci, torch.ones_like(c))
            means = torch.where(counts > 0, sums / torch.where(counts > 0, counts, torch.ones_like(counts)),
                                torch.zeros_like(sums))
            codes.append(code)
            stats.append(torch.cat([mu, means], 1))
        return torch.cat(codes, 1), torch.cat(stats, 1)

    def _stat_dequantize(self, codes: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
        w = 1 + (1 << self.bits)
        out, pos = [], 0
        for j, p in enumerate(self.pieces):
            cnt = p.chunks * p.k
            st = stats[:, j * w:(j + 1) * w]
            out.append(torch.gather(st[:, 1:], 1, codes[:, pos:pos + cnt].long()) + st[:, :1])
            pos += cnt
        return torch.cat(out, 1)

    # ---- the uniform quantizer (this module's earlier rule) -------------------------
    def _chunks_of(self, val: torch.Tensor) -> list[torch.Tensor]:
        return [v.reshape(val.shape[0], p.chunks, p.k) for p, v in zip(self.pieces, self._of_pieces(val))]

    def _uni_quantize(self, val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes (m, K) uint8, scales (m, chunks) fp32) of the kept values."""
        L = (1 << self.bits) - 1
        codes, scales = [], []
        for v in self._chunks_of(val.to(torch.float32)):
            s = v.abs().amax(-1, keepdim=True)
            u = torch.where(s > 0, v / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(v))
            codes.append(torch.round((u + 1) * (L / 2)).clamp_(0, L).to(torch.uint8).reshape(val.shape[0], -1))
            scales.append(s.squeeze(-1))
        return torch.cat(codes, 1), torch.cat(scales, 1)

    def _uni_dequantize(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
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

    # ---- either --------------------------------------------------------------------
    def quantize(self, val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes (m, K) uint8, the fp32 values sent beside them)."""
        return self._stat_quantize(val) if self.quantizer == "statistical" else self._uni_quantize(val)

    def dequantize(self, codes: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
        if self.quantizer == "statistical":
            return self._stat_dequantize(codes, side)
        return self._uni_dequantize(codes, side)

    def round_trip(self, val: torch.Tensor) -> torch.Tensor:
        """The values the receivers will decode: Q then Q^-1 (identity for 32 bits)."""
        if self.bits == 32:
            return val.to(torch.float32)
        return self.dequantize(*self.quantize(val))

    def _write_values(self, views: dict, val: torch.Tensor) -> None:
        if self.bits == 32:
            return super()._write_values(views, val)
        codes, side = self.quantize(val)
        per, m = 8 // self.bits, codes.shape[0]
        pad = (-codes.shape[1]) % per
        c = torch.cat([codes, codes.new_zeros(m, pad)], 1).reshape(m, -1, per).to(torch.int32)
        shifts = torch.arange(per, dtype=torch.int32) * self.bits
        views["codes"].copy_((c << shifts).sum(-1).to(torch.uint8))
        views["stats" if self.quantizer == "statistical" else "scales"].copy_(side)

    def _read_values(self, views: dict) -> torch.Tensor:
        if self.bits == 32:
            return super()._read_values(views)
        per = 8 // self.bits
        packed = views["codes"].to(torch.int32)
        shifts = torch.arange(per, dtype=torch.int32) * self.bits
        codes = ((packed.unsqueeze(-1) >> shifts) & ((1 << self.bits) - 1)).reshape(packed.shape[0], -1)
        side = views["stats" if self.quantizer == "statistical" else "scales"]
        return self.dequantize(codes[:, : self.K], side)


class SparseLoCo(PeriodicBase):
    """SparseLoCo; the steps are numbered in the module docstring."""

    shards_flat = False  # its chunks are cut in the tensors

    name = "sparseloco"
    Config = SparseLoCoConfig
    summary = "SparseLoCo: H inner (AdamW) steps, error-fed chunk top-k + 2-bit pseudo-gradients, no outer momentum"
    local_optimizer_default = "adamw"
    byzantine_messages = True

    def __init__(self, config: SparseLoCoConfig, comm: Any) -> None:
        super().__init__(config, comm)
        self.codec: QuantChunkTopK | None = None
        self.aggregator = check_aggregator(config.aggregator, self.name)
        #: the robust rule of step 6 (None: the mean)
        self.rule: ShardedRule | None = None
        if not self.aggregator.is_mean:
            self.aggregator.check_nodes(int(comm.world_size), "Arg `aggregator`")

    def setup(self, X: torch.Tensor, layout: ParamLayout | None = None) -> None:
        layout = self._take_layout(X, layout)
        cfg = self.config
        self.codec = QuantChunkTopK(layout, chunk=cfg.chunk, fraction=cfg.topk_fraction, bits=cfg.bits,
                                    quantizer=cfg.quantizer, quant_range=cfg.quant_range)
        self.state = SparseLoCoState(t=0, start=X.detach().clone(), error=torch.zeros_like(X),
                                     quantizer=cfg.quantizer, aggregate=cfg.aggregate)
        if not self.aggregator.is_mean:
            self.rule = ShardedRule.on_state(self.aggregator, self.state, X, int(self.comm.world_size), what=self.name)

    def load_state_dict(self, sd: dict) -> None:
        """A state saved before the rule was recorded ran with the earlier uniform
        quantizer and mean over all workers: it continues where those are asked for and
        is refused in one line otherwise, as is any state of another rule."""
        if "quantizer" not in sd and "aggregate" not in sd:
            sd = {**sd, **_EARLIER_RULE}
            old = True
        else:
            old = False
        cfg = self.config
        if sd.get("quantizer") != cfg.quantizer or sd.get("aggregate") != cfg.aggregate:
            when = ("was written before SparseLoCo followed the authors' code" if old
                    else f"was written with quantizer={sd.get('quantizer')!r}, aggregate={sd.get('aggregate')!r}")
            raise ValueError(
                f"sparseloco: this checkpoint {when}; this run asks for quantizer={cfg.quantizer!r}, "
                f"aggregate={cfg.aggregate!r}: resume it with quantizer={sd.get('quantizer')!r} and "
                f"aggregate={sd.get('aggregate')!r}, or start the run again")
        if self.state is not None and "center" not in sd and not self.state.center.numel():  # as before cclip
            sd = {**sd, "center": self.state.center}
        super().load_state_dict(sd)

    def state_dict(self) -> dict:
        sd = super().state_dict()
        if not sd["center"].numel():  # as before the option existed
            sd.pop("center")
        return sd

    def wire_format(self) -> WireFormat:
        cfg = self.config
        d = self.layout.dim if self.layout is not None else 1
        bits = round(8.0 * self.codec.ideal_nbytes / d, 4) if self.codec is not None else 32.0
        label = f"sparseloco:topk_fraction={cfg.topk_fraction:g},bits={cfg.bits},chunk={cfg.chunk}"
        if cfg.bits != 32:
            label += f",quantizer={cfg.quantizer}"
            if cfg.quantizer == "statistical":
                label += f",quant_range={cfg.quant_range:g}"
        return WireFormat(label + f",aggregate={cfg.aggregate}", bits)

    @torch.no_grad()
    def step(self, X: torch.Tensor, U: torch.Tensor) -> None:
        if not self._local(X, U):  # 1
            return
        st, cfg, ledger, codec = self.state, self.config, self.comm.ledger, self.codec
        tag = step_tag(st.t)
        with ledger.phase("compute"):
            delta = st.start - X  # 2
            if self.adversary is not None:  # the Byzantine workers' pseudo-gradients, crafted
                delta = self.adversary.craft(delta, self.comm.nodes, st.t // cfg.local_steps, stream="delta")
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
            gv = gv.to(X.dtype)
            if self.rule is not None:  # the robust rule over every worker's decoded message (0 where unsent)
                outer = self.rule.local(codec.decode_each(gi, gv)).view(1, -1).to(X.dtype)
            elif cfg.aggregate == "senders":  # the authors' code: per coordinate, over who sent it
                outer = codec.decode(codec.coeffs(gi, gv))
            else:  # the paper's equation: over all n workers
                outer = codec.decode_each(gi, gv).mean(0, keepdim=True)
        with ledger.phase("compute"):  # 7
            X.copy_(st.start - cfg.outer_lr * outer)
            st.start.copy_(X)

    def report(self) -> dict | None:
        c = self.codec
        return {"values_per_round": c.K, "payload_nbytes": c.nbytes} if c is not None else None
