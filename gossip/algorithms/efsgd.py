"""dist-EF-SGD, dist-EF-blockSGD, dist-EF-blockSGDM (Zheng et al. 2019, arXiv:1905.10936) and the sign baselines.

Worker i, stochastic gradient g_{t,i}, step size eta_t (eta_{-1} = 0), compressor C,
worker error e_{t,i}, server error e~_t, momentum mu (Alg. 4; mu = 0 gives Alg. 2/3):

1. momentum (Alg. 4 line 4-5): m_{t,i} = mu m_{t-1,i} + g_{t,i}; v_{t,i} = mu m_{t,i} + g_{t,i}
   (v = g when mu = 0);
2. worker error feedback: p_{t,i} = v_{t,i} + (eta_{t-1}/eta_t) e_{t,i};
   Delta_{t,i} = C(p_{t,i}); e_{t+1,i} = p_{t,i} - Delta_{t,i};
3. push: with the sharded exchange (``exchange="sharded"``, the default) node j owns
   shard j of the coordinates (``gossip.algorithms._sharded.ShardPlan``: even cuts,
   at block boundaries where the compressor has fixed blocks) and receives every
   worker's compressed slice of it; with ``exchange="allgather"`` every worker
   receives every push;
4. server: p~_t = (1/M) sum_i Delta_{t,i} + (eta_{t-1}/eta_t) e~_t; Delta~_t = C(p~_t);
   e~_{t+1} = p~_t - Delta~_t. Sharded, the owner of shard j computes it on its shard
   with its own e~ of the shard and a key of (seed, j, t), and all-gathers Delta~ of
   the shard (Zheng et al., Sec. 1: the server's compression between the
   reduce-scatter and the all-gather of a ring all-reduce); all-gathered, it is
   replicated deterministically on every worker with one shared key;
5. pull: the gradient is replaced by Delta~_t, so the user's plain SGD step
   x_{t+1} = x_t - eta_t Delta~_t is Alg. 2 line 6.

``efsgd`` takes any compressor (``sign`` by default, Zheng et al. 2019 (arXiv:1905.10936) eq. 1);
``efblocksgd`` is ``efsgd`` with the blockwise sign compressor (Alg. 3) whose blocks
are the parameter tensors (from the ``ParamLayout`` given to ``setup``);
``efblocksgdm`` adds Nesterov momentum inside the compressed update (Alg. 4).

Baselines with majority vote and no error feedback (Zheng et al. 2019, arXiv:1905.10936, Sec. 4):

1. signum only: m_{t,i} = beta m_{t-1,i} + (1 - beta) g_{t,i}; v = m (signSGD: v = g);
2. push sign(v_{t,i}) (the ``sign`` compressor: 1 bit per value and a scale);
3. vote: Delta~_t = sign(sum_i sign(v_{t,i})). Sharded (default), the owner of each
   shard counts its votes and sends back one bit per value: a tie (possible for an
   even number of workers) goes to the sign of the scale-weighted sum, then to +1.
   All-gathered, every worker counts all votes and a tie gives 0;
4. G <- Delta~_t.

The full-precision momentum SGD baseline is ``allreduce`` with the user optimizer's
momentum.

Which exchange, and why: ``sharded`` by default, because it keeps the bytes per node at
about 2 (M - 1) / M x payload whatever M (an all-gather sends (M - 1) x payload, more
than an fp32 ring all-reduce past about 8 nodes for 8-bit codes); a compressor that
cannot be sharded (a ``k=`` count of the whole vector, fewer fixed blocks than nodes)
falls back to ``allgather`` with a warning, and asking for ``sharded`` by name refuses
it in one line. ``exchange="allgather"`` keeps the replicated server of the runs made
before, bit for bit: a State written before the option existed (no ``exchange`` entry)
resumes all-gathered. The ledger records the push and the pull under ``shard_push``
and ``shard_pull`` (sharded) or the all-gather (docs/comm.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gossip import compress as _compress
from gossip.algorithms._centralized import (
    ErrorFeedback,
    Pending,
    CentralizedBase,
    check_fraction,
    check_spec,
)
from gossip.algorithms._sharded import ExchangeMixin, check_exchange
from gossip.algorithms.base import ParamLayout, WireFormat
from gossip.algorithms._common import check_int, node_keys, shared_key, step_tag

__all__ = [
    "DistEFSGD",
    "ef_momentum",
    "ef_pull",
    "ef_push",
    "EFSGDConfig",
    "EFBlockSGDConfig",
    "EFBlockSGDMConfig",
    "EFState",
    "SignSGD",
    "SignSGDConfig",
    "SignumConfig",
    "SignState",
]

_WORKER_STREAM = 0
_SERVER_STREAM = 1


# --------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class EFSGDConfig:
    """dist-EF-SGD (Zheng et al. 2019, arXiv:1905.10936, Alg. 2) with any compressor; ``momentum`` > 0 gives the
    non-block variant of Alg. 4."""

    compressor: str = "sign"
    momentum: float = 0.0
    seed: int = 0
    exchange: str | None = None

    def __post_init__(self) -> None:
        check_spec(self.compressor, "efsgd")
        check_fraction("momentum", self.momentum)
        check_int("seed", self.seed, minimum=0)
        check_exchange(self.exchange, "efsgd")

    def build_compressor(self, layout: ParamLayout | None = None) -> Any:
        return _compress.build(self.compressor)


@dataclass(frozen=True, kw_only=True)
class EFBlockSGDConfig:
    """dist-EF-blockSGD (Zheng et al. 2019, arXiv:1905.10936, Alg. 3): blockwise sign, one block per parameter
    tensor (the blocks come from the layout given to ``setup``)."""

    momentum: float = 0.0
    seed: int = 0
    exchange: str | None = None

    def __post_init__(self) -> None:
        check_fraction("momentum", self.momentum)
        check_int("seed", self.seed, minimum=0)
        check_exchange(self.exchange, "efblocksgd")

    @property
    def compressor(self) -> str:
        return "blocksign"

    def build_compressor(self, layout: ParamLayout | None = None) -> Any:
        if layout is None or len(layout.block_starts) == 1:
            return _compress.build("blocksign")
        return _compress.build("blocksign", offsets=layout.block_starts)


@dataclass(frozen=True, kw_only=True)
class EFBlockSGDMConfig(EFBlockSGDConfig):
    """dist-EF-blockSGDM (Zheng et al. 2019, arXiv:1905.10936, Alg. 4): Nesterov momentum ``0 < momentum < 1``."""

    momentum: float = 0.9

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fraction("momentum", self.momentum, lo_open=True)


@dataclass(frozen=True, kw_only=True)
class SignSGDConfig:
    """signSGD with majority vote: no momentum, no error feedback."""

    seed: int = 0
    exchange: str | None = None

    def __post_init__(self) -> None:
        check_int("seed", self.seed, minimum=0)
        check_exchange(self.exchange, "signsgd")


@dataclass(frozen=True, kw_only=True)
class SignumConfig:
    """Signum with majority vote: m = beta m + (1 - beta) g, push sign(m)."""

    momentum: float = 0.9
    seed: int = 0
    exchange: str | None = None

    def __post_init__(self) -> None:
        check_fraction("momentum", self.momentum, lo_open=True)
        check_int("seed", self.seed, minimum=0)
        check_exchange(self.exchange, "signum")


# --------------------------------------------------------------------------------------
# States
# --------------------------------------------------------------------------------------
@dataclass
class EFState:
    """``t`` counts steps from 1; ``lr`` is eta_t (set by ``set_lr``), ``prev_lr`` is
    eta_{t-1} (0 before the first step). ``error`` (m, d): the hosted workers' e_{t,i};
    ``server_error`` (1, d): e~_t, identical on every worker; ``momentum`` (m, d) or
    empty when mu = 0. Random keys are a pure function of (seed, node, t)."""

    t: int
    lr: float
    prev_lr: float
    error: torch.Tensor
    server_error: torch.Tensor
    momentum: torch.Tensor
    exchange: str = "allgather"
    shards: int = 1


@dataclass
class SignState:
    """State of ``signsgd`` and ``signum``.

    The step count, the step sizes (this and the previous step) and the local momentum
    buffer, one row per hosted node."""

    t: int
    lr: float
    prev_lr: float
    momentum: torch.Tensor
    exchange: str = "allgather"
    shards: int = 1


# --------------------------------------------------------------------------------------
# The steps on a slice of the flat vector, shared with MergeComp (which runs them group
# by group): momentum, the worker's push and the replicated server's pull
# --------------------------------------------------------------------------------------
def ef_momentum(G: torch.Tensor, momentum: torch.Tensor, mu: float) -> torch.Tensor:
    """Alg. 4 lines 4-5: ``m = mu m + g`` (in place) and ``v = g + mu m``; ``g`` if mu = 0."""
    if mu <= 0:
        return G
    momentum.mul_(mu).add_(G)
    return G + mu * momentum


def ef_push(feedback: ErrorFeedback, V: torch.Tensor, error: torch.Tensor, *, ratio: float,
            keys: torch.Tensor, tag: int) -> torch.Tensor:
    """Worker error feedback (Alg. 2 lines 4-6): the payload of ``C(v + ratio e)``, with
    ``e`` (in place) what was not sent."""
    _, payload, _ = feedback(V, error, rescale=ratio, keys=keys, tag=tag)
    return payload


def ef_pull(feedback: ErrorFeedback, pushed: torch.Tensor, server_error: torch.Tensor, *, numel: int,
            ratio: float, key: int, tag: int, dtype: torch.dtype) -> torch.Tensor:
    """The replicated server (Alg. 2 lines 8-10), the same on every worker: decode every
    worker's payload, average in a fixed order, error feedback with the shared ``key``;
    returns the pulled direction (1, numel)."""
    mean = feedback.compressor.decode(pushed, numel, tag=tag).to(dtype).mean(0, keepdim=True)
    skey = torch.full((1,), key, dtype=torch.int64)
    _, _, pulled = feedback(mean, server_error, rescale=ratio, keys=skey, tag=tag)
    return pulled


# --------------------------------------------------------------------------------------
# Algorithms
# --------------------------------------------------------------------------------------
class _TwoWay(ExchangeMixin, CentralizedBase):
    """The push/serve/pull skeleton of the two-way compressed algorithms, sharded or
    all-gathered (see the module docstring); subclasses supply the three pieces:
    ``_push(G)`` (worker side: the payload rows), ``_serve(j, Q, ctx)`` (the owner of
    shard ``j``) and ``_replicated(pushed, ctx)`` (the all-gather form's server)."""

    def _post(self, G: torch.Tensor) -> tuple[Any, Any]:
        """Compress and post the exchange; returns (handle, finish). ``finish(result)``
        writes the pulled direction into ``G``."""
        st, ledger = self.state, self.comm.ledger
        m, d = G.shape
        ctx = self._context(G)
        payload = self._push(G, ctx)
        with ledger.phase("communicate"):
            if self.plan is None:
                handle = self.comm.all_gather_async(payload)
            else:
                plan = self.plan
                handle = self.comm.sharded_exchange_async(
                    payload, plan.nbytes, plan.nbytes, lambda j, Q: self._serve(j, Q, ctx))

        def finish(result: torch.Tensor) -> torch.Tensor:
            if self.plan is None:
                pulled = self._replicated(result, ctx)
            else:
                # 5. everyone decodes every owner's reply: the same direction everywhere
                pulled = self.plan.decode(result.view(1, -1), tag=ctx["tag"]).to(G.dtype)
                pulled = self._pulled(pulled)
            G.copy_(pulled.expand(m, d))
            return G

        st.prev_lr = st.lr
        st.t += 1
        return handle, finish

    def _pulled(self, pulled: torch.Tensor) -> torch.Tensor:
        return pulled

    @torch.no_grad()
    def reduce_gradients(self, G: torch.Tensor) -> None:
        handle, finish = self._post(G)
        with self.comm.ledger.phase("communicate"):
            result = handle.wait()
        with self.comm.ledger.phase("compress"):
            finish(result)

    @torch.no_grad()
    def reduce_gradients_start(self, G: torch.Tensor) -> Pending:
        """Posted, not waited: the exchange completes on its own (torch.distributed
        works); ``wait()`` of the result decodes the direction into ``G``."""
        return Pending(*self._post(G))

    def _switch_exchange(self, exchange: str) -> None:
        self.exchange, self.plan = exchange, None
        self._build_feedback()
        self.state.exchange = exchange

    def _build_feedback(self) -> None:
        pass


class DistEFSGD(_TwoWay):
    """dist-EF-SGD / -blockSGD / -blockSGDM; see the module docstring for the steps."""

    name = "efsgd"
    fault_tolerant = True
    local_state = ("error",)  # the worker's own residual: a healed worker starts it at zero
    Config = EFSGDConfig
    mergeable = True
    summary = "dist-EF-SGD (Zheng et al. 2019, arXiv:1905.10936, Alg. 2): two-way compression with worker and server error feedback"

    def __init__(self, config: Any, comm: Any) -> None:
        super().__init__(config, comm)
        self.compressor = config.build_compressor()
        self.feedback = ErrorFeedback(self.compressor)

    @classmethod
    def momentum_of(cls, config: Any) -> float:
        return config.momentum

    @property
    def payload_compressor(self) -> Any:
        return self.compressor

    def setup(self, X: torch.Tensor, layout: ParamLayout | None = None) -> None:
        m, d = X.shape
        layout = self._take_layout(X, layout)
        self.compressor = self.config.build_compressor(layout)  # blockwise: one block per tensor
        self.compressor.payload_nbytes(d)  # a bad block layout fails here, not mid-run
        self._choose_exchange(self.compressor, d)  # a layout that cannot be sharded fails here
        self._build_feedback()
        mom = X.new_zeros(m, d) if self.config.momentum > 0 else X.new_zeros(0)
        self.state = EFState(
            t=1, lr=1.0, prev_lr=0.0, error=X.new_zeros(m, d),
            server_error=X.new_zeros(1, d), momentum=mom, **self._exchange_state(),
        )

    def _build_feedback(self) -> None:
        # the worker's error feedback wraps the plan (shard by shard) or the compressor
        self.feedback = ErrorFeedback(self.plan if self.plan is not None else self.compressor)

    def _context(self, G: torch.Tensor) -> dict:
        st = self.state
        return {"tag": step_tag(st.t), "ratio": self._lr_ratio(), "t": st.t, "dtype": G.dtype}

    def _push(self, G: torch.Tensor, ctx: dict) -> torch.Tensor:
        st, ledger = self.state, self.comm.ledger
        with ledger.phase("compute"):
            # 1. Nesterov momentum inside the compressed update (Alg. 4 lines 4-5)
            V = ef_momentum(G, st.momentum, self.config.momentum)
        with ledger.phase("compress"):
            # 2. worker error feedback, e rescaled by eta_{t-1}/eta_t
            keys = node_keys(self.config.seed, self.comm.nodes, st.t, _WORKER_STREAM)
            return ef_push(self.feedback, V, st.error, ratio=ctx["ratio"], keys=keys, tag=ctx["tag"])

    def _serve(self, j: int, Q: torch.Tensor, ctx: dict) -> torch.Tensor:
        # 4. (sharded) the owner of shard j: decode and average its n messages in sender
        #    order, error feedback with its own e~ of the shard, re-compress
        plan = self.plan
        sl = plan.shard_slice(j)
        mean = plan.decode_shard(j, Q, ctx["tag"]).to(ctx["dtype"]).mean(0, keepdim=True)
        skey = node_keys(self.config.seed, torch.tensor([j]), ctx["t"], _SERVER_STREAM)
        _, reply, _ = ErrorFeedback(plan.shard_codec(j))(
            mean, self.state.server_error[:, sl], rescale=ctx["ratio"], keys=skey, tag=ctx["tag"])
        return reply[0]

    def _replicated(self, pushed: torch.Tensor, ctx: dict) -> torch.Tensor:
        # 4. (allgather) the server's step, computed identically on every worker: same
        #    payloads, same decode, same reduction order, a key shared by all
        return ef_pull(self.feedback, pushed, self.state.server_error, numel=self.layout.dim, ratio=ctx["ratio"],
                       key=shared_key(self.config.seed, ctx["t"], _SERVER_STREAM), tag=ctx["tag"],
                       dtype=ctx["dtype"])


class EFBlockSGD(DistEFSGD):
    """dist-EF-blockSGD: dist-EF-SGD with blockwise signs, one block per tensor.

    One L1 scale per tensor; error feedback on the workers and on the server."""

    name = "efblocksgd"
    Config = EFBlockSGDConfig
    summary = "dist-EF-blockSGD (Zheng et al. 2019, arXiv:1905.10936, Alg. 3): blockwise sign per tensor, two-way error feedback"

    def wire_format(self) -> WireFormat:
        return WireFormat("blocksign", 1.0)  # one sign per value, one fp32 scale per tensor


class EFBlockSGDM(EFBlockSGD):
    """dist-EF-blockSGDM: dist-EF-blockSGD with Nesterov momentum.

    The algorithm applies the momentum itself, so the local optimizer must have none."""

    name = "efblocksgdm"
    Config = EFBlockSGDMConfig
    summary = "dist-EF-blockSGDM (Zheng et al. 2019, arXiv:1905.10936, Alg. 4): blockwise sign with Nesterov momentum and error feedback"


class SignSGD(_TwoWay):
    """signSGD (``momentum`` absent) and Signum with majority vote; see the module
    docstring for the steps."""

    name = "signsgd"
    fault_tolerant = True
    Config = SignSGDConfig
    summary = "signSGD with majority vote (baseline of Zheng et al. 2019 (arXiv:1905.10936)): 1-bit pushes, no error feedback"

    def __init__(self, config: Any, comm: Any) -> None:
        super().__init__(config, comm)
        self.compressor = _compress.build("sign")

    @property
    def payload_compressor(self) -> Any:
        return self.compressor

    def setup(self, X: torch.Tensor, layout: ParamLayout | None = None) -> None:
        m, d = X.shape
        self._take_layout(X, layout)
        self._choose_exchange(self.compressor, d)
        beta = self.own_momentum
        mom = X.new_zeros(m, d) if beta > 0 else X.new_zeros(0)
        self.state = SignState(t=1, lr=1.0, prev_lr=0.0, momentum=mom, **self._exchange_state())

    def _context(self, G: torch.Tensor) -> dict:
        return {"tag": step_tag(self.state.t), "t": self.state.t, "dtype": G.dtype}

    def _push(self, G: torch.Tensor, ctx: dict) -> torch.Tensor:
        st, ledger = self.state, self.comm.ledger
        beta = self.own_momentum
        with ledger.phase("compute"):
            # 1. Signum's momentum (an exponential average of the gradients)
            if beta > 0:
                st.momentum.mul_(beta).add_(G, alpha=1.0 - beta)
                V = st.momentum
            else:
                V = G
        with ledger.phase("compress"):
            # 2. one bit per value; sign compression is deterministic, the key is unused
            keys = node_keys(self.config.seed, self.comm.nodes, st.t)
            codec = self.plan if self.plan is not None else self.compressor
            return codec.encode(V, keys, tag=ctx["tag"])

    def _serve(self, j: int, Q: torch.Tensor, ctx: dict) -> torch.Tensor:
        # 3. (sharded) the owner counts its shard's votes and sends back one bit each:
        #    a tie (even n) goes to the sign of the scale-weighted sum, then to +1
        plan = self.plan
        decoded = plan.decode_shard(j, Q, ctx["tag"])
        votes = torch.sign(decoded).sum(0, keepdim=True)
        weighted = decoded.sum(0, keepdim=True)
        tie = torch.where(weighted < 0, -1.0, 1.0)
        vote = torch.where(votes != 0, torch.sign(votes), tie)
        key = node_keys(self.config.seed, torch.tensor([j]), ctx["t"], 1)
        return plan.encode_shard(j, vote, key, ctx["tag"])

    def _pulled(self, pulled: torch.Tensor) -> torch.Tensor:
        return torch.sign(pulled)  # scale 1 exactly: the votes are +-1

    def _replicated(self, pushed: torch.Tensor, ctx: dict) -> torch.Tensor:
        # 3. (allgather) majority vote on every worker: only the signs count, 0 on a tie
        d = self.layout.dim
        votes = torch.sign(self.compressor.decode(pushed, d, tag=ctx["tag"])).sum(0, keepdim=True)
        return torch.sign(votes).to(ctx["dtype"])

    def _switch_exchange(self, exchange: str) -> None:
        self.exchange, self.plan = exchange, None
        self.state.exchange = exchange


class Signum(SignSGD):
    """Signum with majority vote.

    The sign of each worker's local momentum is pushed (1 bit per value) and the sign
    of the sum of the votes is the direction."""

    name = "signum"
    Config = SignumConfig
    summary = "Signum with majority vote (baseline of Zheng et al. 2019 (arXiv:1905.10936)): sign of local momentum, 1-bit pushes"

    @classmethod
    def momentum_of(cls, config: Any) -> float:
        return config.momentum
