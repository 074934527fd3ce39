"""C-PSGD: the centralized all-reduce baseline of Tang et al. 2018 (arXiv:1803.06443).

Step I:   all-reduce the mean of the nodes' gradients (full precision).
Step II:  the local optimizer steps with the averaged gradient on every node, so the
          models stay identical: x_{t+1} = x_t - gamma * mean_i g_i for plain SGD.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gossip.algorithms._common import check_int
from gossip.algorithms.base import Algorithm

__all__ = ["AllReduce", "AllReduceConfig", "AllReduceState"]


@dataclass(frozen=True, kw_only=True)
class AllReduceConfig:
    """Options of ``allreduce``: only the seed (kept for a uniform interface)."""

    seed: int = 0

    def __post_init__(self) -> None:
        check_int("seed", self.seed, minimum=0)


@dataclass
class AllReduceState:
    """The step count ``t`` (1 before the first step)."""

    t: int


class AllReduce(Algorithm):
    """C-PSGD: all-reduce the mean of the full-precision gradients.

    Every node then takes the same local optimizer step, so the models stay identical
    (see the module)."""

    shards_flat = True

    fault_tolerant = True

    name = "allreduce"
    Config = AllReduceConfig
    state_copies = 5
    acts_on = "gradient"
    decentralized = False
    summary = "C-PSGD: all-reduce the full-precision gradients (centralized baseline)"

    def __init__(self, config: AllReduceConfig, comm: Any) -> None:
        super().__init__(config, comm)

    def setup(self, X: torch.Tensor, layout: Any = None) -> None:
        self._take_layout(X, layout)
        self.state = AllReduceState(t=1)

    def reduce_gradients(self, G: torch.Tensor) -> None:
        with self.comm.ledger.phase("communicate"):
            G.copy_(self.comm.all_reduce(G, op="mean"))
        self.state.t += 1
