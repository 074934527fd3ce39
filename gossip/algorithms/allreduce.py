"""C-PSGD: the centralized all-reduce baseline of Tang et al. 2018 (arXiv:1803.06443).

Step I:   all-reduce the mean of the nodes' gradients (full precision).
Step II:  the local optimizer steps with the averaged gradient on every node, so the
          models stay identical: x_{t+1} = x_t - gamma * mean_i g_i for plain SGD.

With a robust ``aggregator`` (:mod:`gossip.robust`: ``median``, ``trimmed:f=F``,
``cclip:tau=T``) the mean of Step I becomes that rule, which is not a sum and cannot be
reduced inside a ring. Step I then runs in the sharded layout of the two-way
compressed all-reduce (Zheng et al., arXiv:1905.10936, Sec. 1), with fp32 messages:

Step Ia:  node i's gradient is cut into n shards; shard j goes to node j (the
          reduce-scatter's traffic, ledger kind ``shard_push``);
Step Ib:  node j applies the rule to the n messages of its shard, coordinate-wise
          (median, trimmed mean);
Step Ic:  node j's aggregate goes to every node (the all-gather, ``shard_pull``).

Each node sends 2 (n - 1)/n x 4d bytes, as the ring all-reduce does: the cost of
robustness is not in bytes but in the owner's work and in a rule that sees each
sender's message alone.

Centered clipping clips each sender's whole difference from the previous aggregate,
as the paper's rule does, though no owner holds a whole message: in Step Ib node j
replies with every sender's squared distance over its shard (n floats, in place of the
aggregate); every node adds the n owners' replies up, node j clips its shard with
these whole distances, and the owners' aggregates are all-gathered (Step Ic, ledger
kind ``all_gather``). That is 4n(n - 1) bytes per node more than the mean's, and as
much again for each further iteration (:mod:`gossip.algorithms._robust`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gossip.algorithms._common import check_int
from gossip.algorithms._robust import ShardedRule
from gossip.algorithms.base import Algorithm

__all__ = ["AllReduce", "AllReduceConfig", "AllReduceState", "RobustAllReduceState"]


@dataclass(frozen=True, kw_only=True)
class AllReduceConfig:
    """Options of ``allreduce``: the seed (kept for a uniform interface) and the
    ``aggregator`` of the gradients (``mean``; ``median``, ``trimmed:f=F``,
    ``cclip:tau=T[,iters=L]`` for training among untrusted nodes)."""

    seed: int = 0
    aggregator: str = "mean"

    def __post_init__(self) -> None:
        check_int("seed", self.seed, minimum=0)
        from gossip.robust import parse_aggregator

        try:
            parse_aggregator(self.aggregator)
        except ValueError as e:
            raise ValueError(f"Arg `aggregator`: {e}") from None


@dataclass
class AllReduceState:
    """The step count ``t`` (1 before the first step)."""

    t: int


@dataclass
class RobustAllReduceState:
    """The step count ``t``; for ``cclip``, the previous aggregate ``center`` (d,)
    (every node holds it whole: the all-gather hands every shard's aggregate to all)
    and the hosted workers' momenta ``momentum`` (m, d) where ``beta`` > 0."""

    t: int
    center: torch.Tensor
    momentum: torch.Tensor


class AllReduce(Algorithm):
    """C-PSGD: all-reduce the mean of the full-precision gradients.

    Every node then takes the same local optimizer step, so the models stay identical
    (see the module)."""

    shards_flat = True

    fault_tolerant = True
    byzantine_messages = True

    name = "allreduce"
    Config = AllReduceConfig
    state_copies = 5
    acts_on = "gradient"
    decentralized = False
    summary = "C-PSGD: all-reduce the full-precision gradients (centralized baseline)"

    def __init__(self, config: AllReduceConfig, comm: Any) -> None:
        super().__init__(config, comm)
        from gossip.robust import parse_aggregator

        self.aggregator = parse_aggregator(config.aggregator)
        if not self.aggregator.is_mean:
            self.aggregator.check_nodes(int(comm.world_size), "Arg `aggregator`")
            # the sharded exchange's owners: each node holds its own shard's rule
            self.fault_tolerant = False

    def setup(self, X: torch.Tensor, layout: Any = None) -> None:
        self._take_layout(X, layout)
        if self.aggregator.is_mean:
            self.state = AllReduceState(t=1)
        else:
            d = X.shape[1]
            beta = self.aggregator.params.get("beta", 0.0)
            mom = torch.zeros_like(X) if beta > 0 else X.new_zeros(0)
            self.state = RobustAllReduceState(t=1, center=torch.zeros(d, dtype=torch.float32), momentum=mom)
            self._rule = ShardedRule.even(self.aggregator, d, int(self.comm.world_size), what="allreduce",
                                          center=self.state.center)

    @classmethod
    def momentum_of(cls, config: AllReduceConfig) -> float:
        """The workers' momentum of ``cclip:...,beta=B`` (arXiv:2012.10333, Alg. 2): the
        message is the momentum, so the local optimizer must have none."""
        from gossip.robust import parse_aggregator

        return float(parse_aggregator(config.aggregator).params.get("beta", 0.0))

    def reduce_gradients(self, G: torch.Tensor) -> None:
        adv = self.adversary
        M = G
        if not self.aggregator.is_mean and self.state.momentum.numel():
            # the workers' momentum m <- beta m + g is the message (arXiv:2012.10333, Alg. 2)
            M = self.state.momentum.mul_(self.aggregator.params["beta"]).add_(G)
        M = M if adv is None else adv.craft(M, self.comm.nodes, self.state.t)
        if self.aggregator.is_mean:
            with self.comm.ledger.phase("communicate"):
                G.copy_(self.comm.all_reduce(M, op="mean"))
        else:
            with self.comm.ledger.phase("communicate"):  # Steps Ia-Ic
                out = self._rule.exchange(self.comm, M)
            G.copy_(out.to(G.dtype).unsqueeze(0).expand_as(G))
        self.state.t += 1
