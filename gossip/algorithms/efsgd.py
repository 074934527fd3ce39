"""dist-EF-SGD, dist-EF-blockSGD, dist-EF-blockSGDM (papers/000) and the sign baselines.

Worker i, stochastic gradient g_{t,i}, step size eta_t (eta_{-1} = 0), compressor C,
worker error e_{t,i}, server error e~_t, momentum mu (Alg. 4; mu = 0 gives Alg. 2/3):

1. momentum (Alg. 4 line 4-5): m_{t,i} = mu m_{t-1,i} + g_{t,i}; v_{t,i} = mu m_{t,i} + g_{t,i}
   (v = g when mu = 0);
2. worker error feedback: p_{t,i} = v_{t,i} + (eta_{t-1}/eta_t) e_{t,i};
   Delta_{t,i} = C(p_{t,i}); e_{t+1,i} = p_{t,i} - Delta_{t,i};
3. push: the payloads C(p_{t,i}) are all-gathered (every worker receives every push);
4. server, replicated deterministically on every worker:
   p~_t = (1/M) sum_i Delta_{t,i} + (eta_{t-1}/eta_t) e~_t; Delta~_t = C(p~_t);
   e~_{t+1} = p~_t - Delta~_t (server compression uses a key shared by all workers);
5. pull: the gradient is replaced by Delta~_t, so the user's plain SGD step
   x_{t+1} = x_t - eta_t Delta~_t is Alg. 2 line 6.

``efsgd`` takes any compressor (``sign`` by default, papers/000 eq. 1);
``efblocksgd`` is ``efsgd`` with the blockwise sign compressor (Alg. 3) whose blocks
are the parameter tensors (the :class:`~gossip.algorithms.base.ParamLayout` given to
``setup``; without one the whole vector is one block); ``efblocksgdm`` adds Nesterov
momentum inside the compressed update (Alg. 4).

Steps 1, 2 and 4 are the functions :func:`ef_momentum`, :func:`ef_push` and
:func:`ef_pull`, on any slice of the vector: MergeComp (``gossip.algorithms.mergecomp``)
runs the same code group by group.

Momentum: with ``momentum`` > 0 the algorithm owns the momentum (``owns_momentum``),
so the local optimizer must have none (``GossipOptimizer`` refuses one that has some).
The step size eta_t is read every step from the local optimizer (``set_lr``), so a
learning-rate schedule rescales the memories as Alg. 2 requires.

Baselines with majority vote and no error feedback (papers/000 Sec. 4):

1. signum only: m_{t,i} = beta m_{t-1,i} + (1 - beta) g_{t,i}; v = m (signSGD: v = g);
2. push sign(v_{t,i}) (the ``sign`` compressor: 1 bit per value), all-gathered;
3. vote, replicated on every worker: Delta~_t = sign(sum_i sign(v_{t,i})) (0 on a tie);
4. G <- Delta~_t.

The full-precision momentum SGD baseline is ``allreduce`` with the user optimizer's
momentum.

What is counted: the all-gather of the pushes ((M - 1) payloads sent per worker per
step, docs/comm.md). The server's reply costs nothing here because every worker
computes it itself; docs/centralized.md compares this with a parameter server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gossip import compress as _compress
from gossip.algorithms._centralized import ErrorFeedback, _Centralized, check_fraction, check_spec
from gossip.algorithms._common import check_int, node_keys, shared_key, step_tag
from gossip.algorithms.base import ParamLayout, WireFormat
from gossip.schedule.cost import DEFAULT_ALPHA
from gossip.schedule.partition import parse_merge

__all__ = [
    "DistEFSGD",
    "EFSGDConfig",
    "EFBlockSGDConfig",
    "EFBlockSGDMConfig",
    "EFState",
    "SignSGD",
    "SignSGDConfig",
    "SignumConfig",
    "SignState",
    "ef_momentum",
    "ef_pull",
    "ef_push",
]

_WORKER_STREAM = 0
_SERVER_STREAM = 1


# --------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------
def _check_merge_options(cfg: Any, algo: str) -> None:
    """The MergeComp options of an EF Config (``merge`` None: not scheduled)."""
    if cfg.merge is not None:
        object.__setattr__(cfg, "merge", parse_merge(cfg.merge))
    check_int("merge_max_groups", cfg.merge_max_groups, minimum=1)
    a = cfg.merge_alpha
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 < a < 1:
        raise ValueError(f"Arg `merge_alpha` of {algo} must lie in (0, 1), got {a!r}")
    check_int("merge_profile_steps", cfg.merge_profile_steps, minimum=1)
    check_int("merge_trial_steps", cfg.merge_trial_steps, minimum=1)


@dataclass(frozen=True, kw_only=True)
class EFSGDConfig:
    """dist-EF-SGD (papers/000 Alg. 2) with any compressor; ``momentum`` > 0 gives the
    non-block variant of Alg. 4.

    ``merge`` (None, ``"layer"``, ``"whole"``, ``"auto"`` or a number of groups N)
    schedules it with MergeComp (papers/004, ``gossip.algorithms.mergecomp``): the
    same update, compressed and sent in groups of tensors during backward.
    ``merge_max_groups`` (Y) and ``merge_alpha`` are Alg. 2's; ``merge_profile_steps``
    and ``merge_trial_steps`` how long ``N``/``auto`` measure."""

    compressor: str = "sign"
    momentum: float = 0.0
    seed: int = 0
    merge: str | int | None = None
    merge_max_groups: int = 2
    merge_alpha: float = DEFAULT_ALPHA
    merge_profile_steps: int = 5
    merge_trial_steps: int = 4

    def __post_init__(self) -> None:
        comp = check_spec(self.compressor, "efsgd")
        check_fraction("momentum", self.momentum)
        check_int("seed", self.seed, minimum=0)
        _check_merge_options(self, "efsgd")
        if self.merge is not None and comp.name == "blocksign" and comp.spec != "blocksign":
            raise ValueError(
                "efsgd: under merge, blocksign's blocks are the parameter tensors; give plain 'blocksign', "
                f"got {self.compressor!r}"
            )


@dataclass(frozen=True, kw_only=True)
class EFBlockSGDConfig:
    """dist-EF-blockSGD (papers/000 Alg. 3): blockwise sign, one block per tensor of the
    layout given to ``setup``. The ``merge`` options are ``efsgd``'s."""

    momentum: float = 0.0
    seed: int = 0
    merge: str | int | None = None
    merge_max_groups: int = 2
    merge_alpha: float = DEFAULT_ALPHA
    merge_profile_steps: int = 5
    merge_trial_steps: int = 4

    def __post_init__(self) -> None:
        check_fraction("momentum", self.momentum)
        check_int("seed", self.seed, minimum=0)
        _check_merge_options(self, type(self)._algo)

    _algo = "efblocksgd"


@dataclass(frozen=True, kw_only=True)
class EFBlockSGDMConfig(EFBlockSGDConfig):
    """dist-EF-blockSGDM (papers/000 Alg. 4): Nesterov momentum ``0 < momentum < 1``."""

    momentum: float = 0.9
    _algo = "efblocksgdm"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fraction("momentum", self.momentum, lo_open=True)


@dataclass(frozen=True, kw_only=True)
class SignSGDConfig:
    """signSGD with majority vote: no momentum, no error feedback."""

    seed: int = 0

    def __post_init__(self) -> None:
        check_int("seed", self.seed, minimum=0)


@dataclass(frozen=True, kw_only=True)
class SignumConfig:
    """Signum with majority vote: m = beta m + (1 - beta) g, push sign(m)."""

    momentum: float = 0.9
    seed: int = 0

    def __post_init__(self) -> None:
        check_fraction("momentum", self.momentum, lo_open=True)
        check_int("seed", self.seed, minimum=0)


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


@dataclass
class SignState:
    t: int
    lr: float
    prev_lr: float
    momentum: torch.Tensor


# --------------------------------------------------------------------------------------
# Steps 1, 2 and 4 on a slice (shared with MergeComp)
# --------------------------------------------------------------------------------------
def ef_momentum(G: torch.Tensor, momentum: torch.Tensor, mu: float) -> torch.Tensor:
    """Step 1: ``m <- mu m + g`` (in place) and the Nesterov ``v = g + mu m``; ``v = g``
    when ``mu == 0`` (``momentum`` is then unused and may be empty)."""
    if mu <= 0:
        return G
    momentum.mul_(mu).add_(G)
    return G + mu * momentum


def ef_push(
    feedback: ErrorFeedback, V: torch.Tensor, error: torch.Tensor, *, ratio: float,
    seed: int, nodes: torch.Tensor, t: int, stream: int,
) -> torch.Tensor:
    """Step 2: the worker's payload ``C(v + ratio e)``; ``error`` becomes what was not
    sent. Keys: (seed, node, t, stream), one per hosted worker."""
    keys = node_keys(seed, nodes, t, stream)
    _, payload, _ = feedback(V, error, rescale=ratio, keys=keys, tag=step_tag(t))
    return payload


def ef_pull(
    feedback: ErrorFeedback, pushed: torch.Tensor, numel: int, server_error: torch.Tensor, *,
    ratio: float, seed: int, t: int, stream: int, dtype: torch.dtype,
) -> torch.Tensor:
    """Step 4, the server, computed identically on every worker (same payloads, same
    decode, same reduction order, a key shared by all): ``p~ = mean_i C(p_i) + ratio e~``,
    returns ``Delta~ = C(p~)`` (shape ``(1, numel)``) and keeps ``e~ = p~ - Delta~``."""
    tag = step_tag(t)
    mean = feedback.compressor.decode(pushed, numel, tag=tag).to(dtype).mean(0, keepdim=True)
    skey = torch.full((1,), shared_key(seed, t, stream), dtype=torch.int64)
    _, _, pulled = feedback(mean, server_error, rescale=ratio, keys=skey, tag=tag)
    return pulled


# --------------------------------------------------------------------------------------
# Algorithms
# --------------------------------------------------------------------------------------
class DistEFSGD(_Centralized):
    """dist-EF-SGD / -blockSGD / -blockSGDM; see the module docstring for the steps."""

    name = "efsgd"
    summary = "dist-EF-SGD (papers/000 Alg. 2): two-way compression with worker and server error feedback"

    def __init__(self, config: Any, comm: Any) -> None:
        super().__init__(config, comm)
        self.compressor = self._make_compressor(None)
        self.feedback = ErrorFeedback(self.compressor)

    def _make_compressor(self, layout: ParamLayout | None) -> Any:
        """The compressor of the pushes and the pull (efblocksgd: one block per tensor)."""
        return _compress.build(self.config.compressor)

    @property
    def payload_compressor(self) -> Any:
        return self.compressor

    def wire_format(self) -> WireFormat:
        return WireFormat.of_compressor(
            self.compressor, self.layout.dim if self.layout else 1 << 20,
            "each worker's error-corrected payload, all-gathered; the server's reply computed on every worker",
        )

    def _setup(self, X: torch.Tensor, layout: ParamLayout) -> None:
        m, d = X.shape
        self.compressor = self._make_compressor(layout)
        self.feedback = ErrorFeedback(self.compressor)
        self.compressor.payload_nbytes(d)  # a bad block layout fails here, not mid-run
        mom = X.new_zeros(m, d) if self.config.momentum > 0 else X.new_zeros(0)
        self.state = EFState(
            t=1, lr=1.0, prev_lr=0.0, error=X.new_zeros(m, d),
            server_error=X.new_zeros(1, d), momentum=mom,
        )

    @torch.no_grad()
    def reduce_gradients(self, G: torch.Tensor) -> None:
        st, cfg, ledger = self.state, self.config, self.comm.ledger
        m, d = G.shape
        ratio = self._lr_ratio()
        with ledger.phase("compute"):
            # 1. Nesterov momentum inside the compressed update (Alg. 4 lines 4-5)
            V = ef_momentum(G, st.momentum, cfg.momentum)
        with ledger.phase("compress"):
            # 2. worker error feedback, e rescaled by eta_{t-1}/eta_t
            payload = ef_push(self.feedback, V, st.error, ratio=ratio, seed=cfg.seed,
                              nodes=self.comm.nodes, t=st.t, stream=_WORKER_STREAM)
        with ledger.phase("communicate"):
            # 3. push: every worker receives every worker's payload
            pushed = self.comm.all_gather(payload)
        with ledger.phase("compress"):
            # 4. the server's step, replicated on every worker
            pulled = ef_pull(self.feedback, pushed, d, st.server_error, ratio=ratio, seed=cfg.seed,
                             t=st.t, stream=_SERVER_STREAM, dtype=G.dtype)
        # 5. the pulled direction replaces the gradient: x <- x - eta_t Delta~_t
        G.copy_(pulled.expand(m, d))
        st.prev_lr = st.lr
        st.t += 1


class EFBlockSGD(DistEFSGD):
    name = "efblocksgd"
    summary = "dist-EF-blockSGD (papers/000 Alg. 3): blockwise sign per tensor, two-way error feedback"

    def _make_compressor(self, layout: ParamLayout | None) -> Any:
        if layout is None or len(layout.block_starts) == 1:
            return _compress.build("blocksign")
        return _compress.build("blocksign", offsets=layout.block_starts)

    def wire_format(self) -> WireFormat:
        return WireFormat(
            "blocksign", 1.0,
            "1-bit signs and one fp32 scale per tensor from each worker, all-gathered; "
            "the server's reply computed on every worker",
        )


class EFBlockSGDM(EFBlockSGD):
    name = "efblocksgdm"
    summary = "dist-EF-blockSGDM (papers/000 Alg. 4): blockwise sign with Nesterov momentum and error feedback"


class SignSGD(_Centralized):
    """signSGD (``momentum`` absent) and Signum with majority vote; see the module
    docstring for the steps."""

    name = "signsgd"
    summary = "signSGD with majority vote (baseline of papers/000): 1-bit pushes, no error feedback"

    def __init__(self, config: Any, comm: Any) -> None:
        super().__init__(config, comm)
        self.compressor = _compress.build("sign")

    @property
    def payload_compressor(self) -> Any:
        return self.compressor

    def wire_format(self) -> WireFormat:
        return WireFormat("sign", 1.0, "1-bit signs (and one fp32 scale) from each worker, all-gathered; majority vote")

    def _setup(self, X: torch.Tensor, layout: ParamLayout) -> None:
        m, d = X.shape
        beta = getattr(self.config, "momentum", 0.0)
        mom = X.new_zeros(m, d) if beta > 0 else X.new_zeros(0)
        self.state = SignState(t=1, lr=1.0, prev_lr=0.0, momentum=mom)

    @torch.no_grad()
    def reduce_gradients(self, G: torch.Tensor) -> None:
        st, ledger = self.state, self.comm.ledger
        beta = getattr(self.config, "momentum", 0.0)
        m, d = G.shape
        tag = step_tag(st.t)
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
            payload = self.compressor.encode(V, keys, tag=tag)
        with ledger.phase("communicate"):
            pushed = self.comm.all_gather(payload)
        with ledger.phase("compress"):
            # 3. majority vote: the decoded values are scale * (+-1); only the signs count
            votes = torch.sign(self.compressor.decode(pushed, d, tag=tag)).sum(0, keepdim=True)
            G.copy_(torch.sign(votes).to(G.dtype).expand(m, d))
        st.prev_lr = st.lr
        st.t += 1


class Signum(SignSGD):
    name = "signum"
    summary = "Signum with majority vote (baseline of papers/000): sign of local momentum, 1-bit pushes"
