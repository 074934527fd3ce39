"""Error-feedback SGD with momentum (Vogels et al. 2019, arXiv:1905.13727, Alg. 2) around the compressors that
Vogels et al. 2019 (arXiv:1905.13727) compares with PowerSGD (Table 4, Appendix G): Random Block (G.1), Random K
(G.2), Sign+Norm (G.3) and Top K (G.4); ``identity`` is accepted as the uncompressed
reference.

The flat vector is cut into blocks (one per parameter tensor of the layout given to
``setup``, as the paper compresses each update matrix M separately) and every
block is compressed on its own with the spec's parameters: ``p`` is the fraction kept
of each block, ``k`` the count kept per block (a block smaller than k is kept whole).

One step on worker w with gradient g_w (Alg. 2, steps numbered as in the code):

1. error feedback: Delta_w = g_w + e_w (line 7);
2. compress every block: C(Delta_w) (line 8). The key of block b at step t is the
   same on every worker (``seed``, b, t), so Random Block / Random K keep the same
   coordinates everywhere;
3. memorise the local error e_w = Delta_w - decompress(C(Delta_w)), the worker's own
   decompressed message (line 9);
4. aggregate (line 10):

   * linear compressors (``randomblock``, ``randomk``, ``identity``): one all-reduce of
     the mean of the kept fp32 values only (G.1/G.2 line 9); their positions follow
     from the shared key, so no index or header travels;
   * ``sign``, ``topk``: by default the sharded two-way exchange
     (``exchange="sharded"``, docs/centralized.md): node j owns shard j, averages its
     shard's messages, compresses the mean again with error feedback of its own
     (a second compression the paper does not have: what keeps the bytes per worker
     at about 2 (W - 1) / W of a payload whatever W) and all-gathers it; the worker
     compresses shard by shard (``sign``: one scale per tensor block within each
     shard; ``topk``: the fraction ``p`` of each shard; a count ``k`` cannot be
     sharded and falls back to the all-gather). With ``exchange="allgather"``, one
     all-gather of the packed payloads per tensor (sign bits + one fp32 L1 scale per
     block; fp32 values + int32 indices), as G.3/G.4 do with NCCL; a State written
     before the option resumes that way;

5. decompress (line 11): Delta' = the mean over workers of the decompressed
   messages (for the linear ones: the mean values placed at the shared positions);
6. momentum after decompression (lines 12-13), as ``powersgd``: m = lambda m + Delta'
   and the direction Delta' + lambda m (Nesterov, as torch.optim.SGD(nesterov=True);
   see docs/centralized.md for the paper box's "Delta' + m"), or m with
   ``nesterov=False``;
7. G <- direction, so the user's plain SGD step is x <- x - gamma * direction.

Bytes per worker per step (ledger): linear compressors, a ring all-reduce of
4 sum_b k_b bytes (2 (W - 1) / W of it); the others, an all-gather of
(W - 1) sum_b payload_nbytes(d_b) bytes (each payload carries our 32-byte header and
is padded to 8 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gossip.algorithms._centralized import (
    ErrorFeedback,
    CentralizedBase,
    check_fraction,
    check_spec,
)
from gossip.algorithms._sharded import ExchangeMixin, check_exchange
from gossip.algorithms.base import ParamLayout
from gossip.algorithms._common import check_int, node_keys, step_tag
from gossip.compress import build as _build_compressor
from gossip.compress import wire as _wire

__all__ = ["EFMomentum", "EFMomentumConfig", "EFMomentumState"]

#: all-reduced (linear, positions from the shared key) and all-gathered compressors
_LINEAR = ("randomblock", "randomk", "identity")
_GATHERED = ("sign", "topk")
_BLOCK_STREAM = 5
_SERVER_STREAM = 6


@dataclass(frozen=True, kw_only=True)
class EFMomentumConfig:
    """``compressor``: ``randomblock``, ``randomk``, ``sign``, ``topk`` (Vogels et al. 2019 (arXiv:1905.13727)
    G.1-G.4) or ``identity``, with its parameters (``topk:p=0.01``). Every parameter
    tensor of the layout given to ``setup`` is a block of its own."""

    compressor: str = "topk"
    momentum: float = 0.9
    nesterov: bool = True
    seed: int = 0
    exchange: str | None = None

    def __post_init__(self) -> None:
        check_exchange(self.exchange, "efmomentum")
        c = check_spec(self.compressor, "efmomentum")
        if c.name not in _LINEAR + _GATHERED:
            raise ValueError(
                "Arg `compressor` of efmomentum must be one of randomblock, randomk, sign, "
                f"topk (Vogels et al. 2019, arXiv:1905.13727, G.1-G.4) or identity, got {self.compressor!r}"
            )
        check_fraction("momentum", self.momentum)
        if not isinstance(self.nesterov, bool):
            raise TypeError(f"Arg `nesterov` must be a bool, got {self.nesterov!r}")
        check_int("seed", self.seed, minimum=0)


@dataclass
class EFMomentumState:
    """``t`` counts steps from 1; ``lr`` is the step size last set (the update does not
    depend on it). ``error`` (m, d): e_w; ``momentum`` (m, d): m, identical on every
    worker (empty when lambda = 0). Keys are a pure function of (seed, block, t)."""

    t: int
    lr: float
    error: torch.Tensor
    momentum: torch.Tensor
    #: (1, d) the shard owners' error feedback of the second compression (sharded
    #: exchange, sign and topk; this node's shard of it), empty otherwise
    server_error: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    exchange: str = "allgather"
    shards: int = 1


@dataclass(frozen=True)
class _Block:
    start: int
    stop: int
    compressor: Any
    feedback: ErrorFeedback
    nbytes: int  # one payload
    kept: int  # fp32 values all-reduced (linear compressors)


class EFMomentum(ExchangeMixin, CentralizedBase):
    """Error-feedback SGD with momentum around a compared compressor; steps in the
    module docstring."""

    name = "efmomentum"
    fault_tolerant = True
    local_state = ("error",)  # the worker's own residual: a healed worker starts it at zero
    Config = EFMomentumConfig
    summary = (
        "EF-SGD with momentum (Vogels et al. 2019, arXiv:1905.13727, Alg. 2) around Random Block, Random K, "
        "Sign+Norm or Top K (Table 4, App. G)"
    )

    _new_state_fields = ("server_error",)

    def __init__(self, config: EFMomentumConfig, comm: Any) -> None:
        super().__init__(config, comm)
        self.compressor = _build_compressor(config.compressor)
        self.linear = self.compressor.name in _LINEAR
        self.blocks: list[_Block] = []

    @property
    def collective(self) -> str:
        """``"all_reduce"`` (linear compressors), ``"sharded"`` or ``"all_gather"``."""
        if self.linear:
            return "all_reduce"
        return "sharded" if self.plan is not None else "all_gather"

    @property
    def message_nbytes(self) -> int:
        """Bytes each worker puts into its collective per step (before the ring's
        2 (W - 1) / W for an all-reduce, times W - 1 for an all-gather)."""
        if not self.blocks:
            raise RuntimeError(f"{self.name}: call setup() before message_nbytes")
        if self.linear:
            return 4 * sum(b.kept for b in self.blocks)
        return sum(b.nbytes for b in self.blocks)

    def _block_compressor(self, numel: int) -> Any:
        k = getattr(self.compressor.config, "k", None)
        if k is not None and k > numel:  # a tensor smaller than k travels whole
            return _build_compressor(self.compressor.spec, k=numel)
        return self.compressor

    @classmethod
    def momentum_of(cls, config: Any) -> float:
        return config.momentum

    def setup(self, X: torch.Tensor, layout: ParamLayout | None = None) -> None:
        m, d = X.shape
        starts = self._take_layout(X, layout).block_starts
        self.blocks = []
        for a, b in zip(starts, starts[1:] + (d,)):
            c = self._block_compressor(b - a)
            kept = 0
            if self.linear:
                segs = c.layout(b - a).segments
                # the body is the kept values alone: what the all-reduce sums
                if len(segs) != 1 or segs[0][:2] != ("values", torch.float32):
                    raise RuntimeError(f"efmomentum: {c.spec} has no plain fp32 value body")
                kept = segs[0][2]
            self.blocks.append(_Block(a, b, c, ErrorFeedback(c), c.payload_nbytes(b - a), kept))
        self.exchange, self.plan = "allgather", None
        if not self.linear:
            # sharded: sign keeps its tensor blocks inside each shard (blocksign), topk
            # keeps the fraction p of each shard
            whole = (_build_compressor("blocksign", offsets=starts) if len(starts) > 1
                     else _build_compressor("sign")) if self.compressor.name == "sign" else self.compressor
            self._choose_exchange(whole, d)
        mom = X.new_zeros(m, d) if self.config.momentum > 0 else X.new_zeros(0)
        server = X.new_zeros(1, d) if self.plan is not None else X.new_zeros(0)
        self.state = EFMomentumState(t=1, lr=1.0, error=X.new_zeros(m, d), momentum=mom,
                                     server_error=server, **self._exchange_state())

    def _switch_exchange(self, exchange: str) -> None:
        self.exchange, self.plan = exchange, None
        self.state.exchange = exchange
        self.state.server_error = self.state.server_error.new_zeros(0)

    def _sharded(self, G: torch.Tensor, tag: int) -> torch.Tensor:
        """Steps 1-5 through the sharded exchange: worker error feedback over the shards,
        each owner averages its shard, compresses it again with error feedback of its
        own (the second compression) and all-gathers it; returns the mean (1, d)."""
        st, plan, ledger = self.state, self.plan, self.comm.ledger
        with ledger.phase("compress"):
            keys = node_keys(self.config.seed, self.comm.nodes, st.t, _BLOCK_STREAM)
            _, payload, _ = ErrorFeedback(plan)(G, st.error, rescale=1.0, keys=keys, tag=tag)

        def serve(j: int, Q: torch.Tensor) -> torch.Tensor:
            mean = plan.decode_shard(j, Q, tag).to(G.dtype).mean(0, keepdim=True)
            skey = node_keys(self.config.seed, torch.tensor([j]), st.t, _SERVER_STREAM)
            _, reply, _ = ErrorFeedback(plan.shard_codec(j))(
                mean, st.server_error[:, plan.shard_slice(j)], rescale=1.0, keys=skey, tag=tag)
            return reply[0]

        with ledger.phase("communicate"):
            replies = self.comm.sharded_exchange(payload, plan.nbytes, plan.nbytes, serve)
        with ledger.phase("compress"):
            return plan.decode(replies.view(1, -1), tag=tag).to(G.dtype)

    def _keys(self, m: int) -> torch.Tensor:
        """(blocks, m): the key of every block, the same on every worker and row."""
        k = node_keys(self.config.seed, torch.arange(len(self.blocks)), self.state.t, _BLOCK_STREAM)
        return k.view(-1, 1).expand(-1, m).contiguous()

    @torch.no_grad()
    def reduce_gradients(self, G: torch.Tensor) -> None:
        st, cfg, ledger = self.state, self.config, self.comm.ledger
        m, d = G.shape
        tag = step_tag(st.t)
        if self.plan is not None:
            out = self._sharded(G, tag)
            self._step_momentum(G, out)
            return
        with ledger.phase("compress"):
            keys = self._keys(m)
            payloads = []
            for i, blk in enumerate(self.blocks):
                # 1.-3. Delta = g + e, compress, e <- Delta - decompress(C(Delta))
                _, payload, _ = blk.feedback(
                    G[:, blk.start : blk.stop], st.error[:, blk.start : blk.stop],
                    rescale=1.0, keys=keys[i], tag=tag,
                )
                payloads.append(payload)
        out = G.new_empty(1, d)
        if self.linear:
            with ledger.phase("compress"):
                views = [self._values(blk, p) for blk, p in zip(self.blocks, payloads)]
                values = torch.cat(views, dim=1)
            with ledger.phase("communicate"):
                # 4. the kept values alone, averaged over the workers
                values = self.comm.all_reduce(values, op="mean")
            with ledger.phase("compress"):
                # 5. the mean values at the shared positions: our own payload's frame
                #    (same compressor and key) holding the mean, re-sealed and decoded
                s = 0
                for i, (blk, p) in enumerate(zip(self.blocks, payloads)):
                    agg = p[:1].clone()
                    self._values(blk, agg).copy_(values[:1, s : s + blk.kept])
                    c = blk.compressor
                    _wire.write_header(
                        agg, c.cid, _wire.params_hash(c.spec), blk.stop - blk.start, keys[i, :1], tag
                    )
                    out[:, blk.start : blk.stop] = c.decode(agg, blk.stop - blk.start, tag=tag)
                    s += blk.kept
        else:
            with ledger.phase("compress"):
                message = torch.cat(payloads, dim=1) if len(payloads) > 1 else payloads[0]
            with ledger.phase("communicate"):
                # 4. every worker receives every worker's packed payloads
                gathered = self.comm.all_gather(message)
            with ledger.phase("compress"):
                # 5. the mean of the decoded messages, the same on every worker
                s = 0
                for blk in self.blocks:
                    dec = blk.compressor.decode(gathered[:, s : s + blk.nbytes], blk.stop - blk.start, tag=tag)
                    out[:, blk.start : blk.stop] = dec.mean(0, keepdim=True)
                    s += blk.nbytes
        self._step_momentum(G, out)

    def _step_momentum(self, G: torch.Tensor, out: torch.Tensor) -> None:
        st, cfg = self.state, self.config
        with self.comm.ledger.phase("compute"):
            # 6. momentum after decompression
            lam = cfg.momentum
            if lam > 0:
                st.momentum.mul_(lam).add_(out)
                direction = out + lam * st.momentum if cfg.nesterov else st.momentum
            else:
                direction = out
            # 7. the direction replaces the gradient
            G.copy_(direction)
        st.t += 1

    @staticmethod
    def _values(blk: _Block, payload: torch.Tensor) -> torch.Tensor:
        """The fp32 value body of a linear compressor's payload rows (a view)."""
        return blk.compressor.layout(blk.stop - blk.start).views(payload)["values"]

    def set_lr(self, lr: float) -> None:
        """Recorded only: the memories are in gradient units (Vogels et al. 2019, arXiv:1905.13727, Alg. 2)."""
        super().set_lr(lr)
