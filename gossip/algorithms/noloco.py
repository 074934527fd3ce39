"""NoLoCo (Kolehmainen, Blagoev, Donaghy, Ersoy, Nies 2025, "NoLoCo: No-all-reduce Low
Communication Training Method for Large Models", arXiv:2506.10911).

DiLoCo without the all-reduce: after the inner steps each worker averages with the
workers of a small random group (one random peer: the ``matching`` time-varying graph,
its default topology) and takes a modified Nesterov outer step whose extra term pulls
its slow weights towards the group's.

Node i, slow weights phi_i (the round's start), outer momentum delta_i, H =
``local_steps`` inner steps of the user's optimizer, momentum alpha
(``outer_momentum``), step size beta (``outer_lr``), pull gamma (``gamma``), round r
(1, 2, ...) on the graph W(r - 1) (the group: i and its neighbours, weights W_ij; on
``matching`` the pair {i, p(i)} with weights 1/2):

1. inner: H steps of the local optimizer, x_i <- InnerOpt_H(phi_i);
2. Delta_i = phi_i - x_i (the pseudo-gradient);
3. send (phi_i, Delta_i) to the group, receive theirs: one fp32 message of 2 d values
   per neighbour (point to point, no collective);
4. delta_i <- alpha delta_i - beta sum_j W_ij Delta_j - gamma (phi_i - sum_j W_ij phi_j);
5. phi_i <- phi_i + delta_i; x_i <- phi_i.

Checked line by line against the authors' code (github.com/gensyn-ai/noloco, the
``sparse_optimizer_c`` outer step that its ``noloco_mean`` configurations run):

- the group is a random partition into groups of ``local_group_size`` = 2, redrawn
  every round: a random perfect matching, as ``matching`` draws;
- the group means are of the slow weights phi_j the round started from and of the
  pseudo-gradients (there written x_j - phi_j, added with +beta: the same sign as
  -beta Delta_j here);
- the momentum is m <- m + (alpha - 1) m + beta mean_j(x_j - phi_j) + beta (mean_j phi_j
  - phi_i), i.e. step 4 with **gamma = beta**: the code has no separate gamma. So
  ``gamma`` defaults to None, meaning ``outer_lr``; an explicit value decouples the
  pull from the step, as the paper's notation allows;
- then phi_i <- phi_i + m and the model restarts from phi_i (step 5); the inner Adam's
  state is kept across rounds, neither averaged nor reset (as here: the user's
  optimizer keeps its state);
- the configurations use H = 50, beta = 0.7, alpha = 0.5 (this module's defaults).

With an exact average (a complete graph, W = J/n) the slow weights stay equal on every
node, the gamma term vanishes and step 4 is heavy-ball momentum on the averaged
pseudo-gradient: with alpha = 0 it is DiLoCo with ``outer_momentum=0`` and
``outer_lr`` beta.

Untrusted nodes (:mod:`gossip.robust`): a Byzantine node sends a crafted pseudo-gradient
(:class:`~gossip.robust.Adversary`) beside its honest slow weights in step 3; its own
step 4 uses its honest Delta_i. There is no robust aggregation (``--aggregator``): a
group of two holds one message besides the node's own, and no rule over two values
outvotes one of them (their median is their mean, trimming needs more than 2f
members). The defence is ClippedGossip's (``robust``: He, Karimireddy and Jaggi,
"Byzantine-robust Decentralized Learning via ClippedGossip", arXiv:2202.01545, Alg. 1)
applied to step 3's mean: each node clips its neighbours' messages' differences from
its own, (phi_j, Delta_j) - (phi_i, Delta_i) as one vector, to the radius tau_i,

    sum_j W_ij (phi_j, Delta_j)  ->  (phi_i, Delta_i) + sum_{j != i} W_ij CLIP((phi_j, Delta_j) - (phi_i, Delta_i), tau_i),

so a neighbour moves a node's step by at most W_ij tau_i whatever it sends. The
adaptive radius (clip the b farthest neighbours to the distance of the next) needs more
than b neighbours: on ``matching`` (one peer) it would clip nothing and is refused; a
fixed ``clippedgossip:tau=T`` works on any graph.

Bytes per node per round: deg(i) messages of ``identity.payload_nbytes(2 d)`` (32-byte
header + 8 d bytes): one on ``matching``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gossip import compress as _compress
from gossip._checks import check_float
from gossip.algorithms._centralized import check_fraction
from gossip.algorithms._common import check_int, node_keys, step_tag
from gossip.algorithms.base import ParamLayout, WireFormat
from gossip.algorithms.decentralized import GossipBase

__all__ = ["NoLoCo", "NoLoCoConfig", "NoLoCoState"]


@dataclass(frozen=True, kw_only=True)
class NoLoCoConfig:
    """``local_steps`` H 50, ``outer_lr`` beta 0.7, ``outer_momentum`` alpha 0.5 (the
    authors' configurations); ``gamma``, the pull of the slow weights towards the group's
    mean: None (the default) takes ``outer_lr``, as the authors' code does."""

    local_steps: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.5
    gamma: float | None = None
    seed: int = 0
    #: ``clippedgossip`` (see the module): each node clips its neighbours' differences
    #: (slow weights and pseudo-gradient) before the group's mean (:mod:`gossip.robust`)
    robust: str | None = None

    def __post_init__(self) -> None:
        check_int("local_steps", self.local_steps, minimum=1)
        check_float("Arg `outer_lr`", self.outer_lr, lo=0.0, lo_open=True)
        check_fraction("outer_momentum", self.outer_momentum)
        if self.gamma is not None:
            check_float("Arg `gamma`", self.gamma, lo=0.0)
        check_int("seed", self.seed, minimum=0)
        if self.robust is not None:
            from gossip.robust import parse_robust

            try:
                parse_robust(self.robust)
            except ValueError as e:
                raise ValueError(f"Arg `robust`: {e}") from None

    @property
    def pull(self) -> float:
        """gamma as used: ``gamma``, or ``outer_lr`` where it is None."""
        return self.outer_lr if self.gamma is None else self.gamma

    @property
    def compressor(self) -> str:
        return "identity"


@dataclass
class NoLoCoState:
    """``t`` local steps taken (round r = t // H); ``start`` (m, d) phi, each node's slow
    weights; ``momentum`` (m, d) delta; ``gamma`` the pull in effect (recorded so that a
    checkpoint says which one it ran with)."""

    t: int
    start: torch.Tensor
    momentum: torch.Tensor
    gamma: float


class NoLoCo(GossipBase):
    """NoLoCo; the steps are numbered in the module docstring."""

    name = "noloco"
    Config = NoLoCoConfig
    summary = "NoLoCo: H inner (AdamW) steps, then average with one random peer and a modified Nesterov outer step"
    local_optimizer_default = "adamw"
    default_topology = "matching"
    byzantine_messages = True
    #: why ``--aggregator`` cannot be applied to its exchange (one line)
    aggregator_refusal = ("it averages with its graph neighbours only (one random peer on its matching graph), and "
                          "no rule over two messages outvotes one of them: their median is their mean, trimming "
                          "needs more than 2f; its defence is --robust clippedgossip:tau=T, which clips the "
                          "peer's model")

    def __init__(self, config: NoLoCoConfig, comm: Any) -> None:
        super().__init__(config, comm)
        self.identity = _compress.build("identity")
        from gossip.robust import parse_robust

        self.robust = parse_robust(config.robust) if config.robust is not None else None
        #: each hosted node's clipping radius tau_i of the last ClippedGossip round
        self.last_tau: torch.Tensor | None = None
        if self.robust is not None and self.robust.tau is None:
            topo = comm.topology
            graph = topo.at(0) if self._tv else topo
            most = int(max(graph.degrees)) if graph is not None else 0
            if most <= self.robust.b:
                raise ValueError(
                    f"robust {self.robust.spec}: the adaptive radius clips each node's b={self.robust.b} farthest "
                    f"neighbours to the next one's distance, and on {getattr(topo, 'name', 'this graph')} a node "
                    f"has at most {most} neighbour(s), so it would clip nothing; give a fixed radius "
                    f"(clippedgossip:tau=T) or a graph of more than {self.robust.b} neighbours per node")

    @property
    def period(self) -> int:
        return self.config.local_steps

    def wire_format(self) -> WireFormat:
        return WireFormat("fp32 (slow weights + pseudo-gradient)", 64.0)

    def set_lr(self, lr: float) -> None:
        check_float("Arg `lr`", lr, lo=0.0, lo_open=True)

    def setup(self, X: torch.Tensor, layout: ParamLayout | None = None) -> None:
        self._take_layout(X, layout)
        self.state = NoLoCoState(t=0, start=X.detach().clone(), momentum=torch.zeros_like(X),
                                 gamma=float(self.config.pull))

    def load_state_dict(self, sd: dict) -> None:
        """A state saved before ``gamma`` was recorded ran with gamma 0.5, the default then:
        it continues where that was given explicitly, and is refused in one line where
        the default is asked for (which is now ``outer_lr``)."""
        if "gamma" not in sd:
            if self.config.gamma is None:
                raise ValueError(
                    "noloco: this checkpoint was written when `gamma` defaulted to 0.5; the default is now "
                    f"`outer_lr` ({self.config.outer_lr}), as in the authors' code, so it cannot continue "
                    "unchanged: start the run again (or resume it with the version that wrote it)")
            sd = {**sd, "gamma": float(self.config.gamma)}
        super().load_state_dict(sd)

    @torch.no_grad()
    def step(self, X: torch.Tensor, U: torch.Tensor) -> None:
        st, cfg, ledger = self.state, self.config, self.comm.ledger
        X.add_(U)  # 1
        st.t += 1
        if st.t % cfg.local_steps:
            return
        r = st.t // cfg.local_steps
        d = X.shape[1]
        with ledger.phase("compute"):
            Z = torch.cat([st.start, st.start - X], 1)  # 2: (phi_i, Delta_i)
            sent = Z
            if self.adversary is not None:  # the Byzantine nodes send a crafted Delta_i, keep their own
                honest = Z[:, d:]
                bad = self.adversary.craft(honest, self.comm.nodes, r, stream="delta")
                sent = Z if bad is honest else torch.cat([st.start, bad], 1)
        if self.robust is not None:  # 3, ClippedGossip's mean of the group
            avg = self._clipped_mean(Z, sent, r)
        else:
            _, mixed, _, _ = self._gossip(sent, r, self.identity, want_own=False)  # 3
            with ledger.phase("compute"):
                avg = self._self_w(Z, r) * Z + mixed  # sum_j W_ij (phi_j, Delta_j)
        with ledger.phase("compute"):
            phi_bar, delta_bar = avg[:, :d], avg[:, d:]
            mom = st.momentum  # 4
            mom.mul_(cfg.outer_momentum).sub_(cfg.outer_lr * delta_bar).sub_(st.gamma * (st.start - phi_bar))
            st.start.add_(mom)  # 5
            X.copy_(st.start)

    def _clipped_mean(self, Z: torch.Tensor, sent: torch.Tensor, r: int) -> torch.Tensor:
        """Step 3 under ClippedGossip: send ``sent`` (the honest (phi_i, Delta_i), or an
        attacker's crafted one), receive the neighbours', and return
        Z_i + sum_{j != i} W_ij CLIP(Z_j - Z_i, tau_i) for each hosted node."""
        from gossip.robust import clipped_mix

        ledger, width = self.comm.ledger, Z.shape[1]
        tag = step_tag(r)
        with ledger.phase("compress"):
            P = self.identity.encode(sent, node_keys(self.config.seed, self.comm.nodes, r), tag=tag)
        with ledger.phase("communicate"):
            rec = self.comm.neighbor_exchange(P, **self._exchange_kw(r))
        with ledger.phase("compress"):
            D = rec.decode(lambda Q: self.identity.decode(Q, width, tag=tag)).to(Z.dtype)
        with ledger.phase("compute"):
            avg, self.last_tau = clipped_mix(Z, D, rec.index, rec.weights, rec.degrees, self.robust)
        return avg

