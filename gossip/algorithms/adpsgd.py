"""AD-PSGD: asynchronous decentralized parallel SGD (Lian, Zhang, Zhang, Liu,
*Asynchronous Decentralized Parallel Stochastic Gradient Descent*, arXiv:1710.06952).

Each node loops on its own, with no global barrier (the paper's Alg. 1, node i):

1. read its model x_hat_i = x_i and sample a batch;
2. compute the stochastic gradient at x_hat_i (meanwhile x_i may change: the
   neighbours that average with it);
3. average with one neighbour j chosen at random: x_i, x_j <- (x_i + x_j) / 2, reading
   x_j as it is at that moment (an atomic pairwise exchange);
4. apply the update computed at x_hat_i: x_i <- x_i + u_i (``-gamma g(x_hat_i)`` for
   plain SGD, the local optimizer's step otherwise).

The active/passive split (the paper's implementation, Sec. 5): the graph is
bipartite; the nodes of one side (*active*, the side of node 0) start every exchange
and only with nodes of the other side (*passive*), which answer and never start one.
Two nodes never wait on each other in a cycle, so the exchanges cannot deadlock, and a
slow node holds up only the neighbour it is exchanging with, for that exchange. A graph
that is not bipartite (a ring of odd length, a complete graph) is refused.

A compressor (``compressor=``, default ``identity``) may carry the two models: each
side then takes half of its own model and half of the other's decoded one,
x_i <- (x_i + C(x_j)) / 2 and x_j <- (x_j + C(x_i)) / 2, which keeps the average only
in expectation for an unbiased compressor; with ``identity`` it is the paper's step.

The partner of active node i at its k-th step is drawn uniformly from its passive
neighbours by a generator seeded with (seed, i, k) (:meth:`ADPSGD.choose`): a pure
function, so the event clock and the algorithm draw the same partners.

The order of the steps comes from the caller's clock: in the simulation the training
loop takes the events of :class:`gossip.clock.EventClock` one at a time and calls
:meth:`ADPSGD.average_pair` for each exchange. :meth:`ADPSGD.step` (the
:class:`gossip.runtime.GossipOptimizer` contract, every node hosted) is the lockstep
round of equal nodes on an instant link: every node's update computed at the models
of the round's start, then in ascending id order each active node averages with its
partner and each node applies its update.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gossip import compress as _compress
from gossip.algorithms._common import check_int, node_keys, step_tag
from gossip.algorithms.base import Algorithm

__all__ = ["ADPSGD", "ADPSGDConfig", "ADPSGDState", "bipartite_sides"]


@dataclass(frozen=True, kw_only=True)
class ADPSGDConfig:
    """AD-PSGD: the compressor of the exchanged models (``identity``: full precision)
    and the seed of its random keys and of the partners' draws."""

    compressor: str = "identity"
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.compressor, str) or not self.compressor:
            raise TypeError(f"Arg `compressor` must be a compressor spec string, got {self.compressor!r}")
        _compress.build(self.compressor)  # a ValueError naming what is accepted
        check_int("seed", self.seed, minimum=0)


@dataclass
class ADPSGDState:
    """``exchanges``: pairwise averagings done so far (the payloads' tag counter);
    ``rounds``: lockstep rounds taken by :meth:`ADPSGD.step`."""

    exchanges: int
    rounds: int


def bipartite_sides(topo: Any) -> list[bool] | None:
    """The two sides of a connected graph (True: the side of node 0), or None where it is
    not bipartite (an edge inside one side)."""
    n = topo.n
    side: list[bool | None] = [None] * n
    side[0] = True
    todo = deque([0])
    while todo:
        i = todo.popleft()
        for j in topo.neighbors(i)[0]:
            j = int(j)
            if side[j] is None:
                side[j] = not side[i]
                todo.append(j)
            elif side[j] == side[i]:
                return None
    return [bool(s) for s in side]


class ADPSGD(Algorithm):
    """AD-PSGD (see the module's docstring): pairwise averaging on an event clock."""

    name = "adpsgd"
    Config = ADPSGDConfig
    needs_static_graph = True
    asynchronous = True
    summary = "AD-PSGD: asynchronous pairwise averaging with one neighbour, active/passive split (arXiv:1710.06952)"

    def __init__(self, config: ADPSGDConfig, comm: Any) -> None:
        super().__init__(config, comm)
        topo = comm.topology
        if topo is None or comm.world_size < 2:
            raise ValueError("adpsgd is decentralized and needs a topology of at least 2 nodes")
        sides = bipartite_sides(topo)
        if sides is None:
            raise ValueError(f"adpsgd splits the nodes into active and passive sides, which needs a bipartite "
                             f"graph; {topo.name} on {topo.n} nodes is not (use a ring of even length, a torus "
                             f"of even sides or a hypercube)")
        self.compressor = _compress.build(config.compressor)
        #: which nodes start exchanges, and the passive neighbours each may choose
        self.active = sides
        self.partners = [[int(j) for j in topo.neighbors(i)[0]] if sides[i] else [] for i in range(topo.n)]

    @property
    def payload_compressor(self) -> Any:
        return self.compressor

    def setup(self, X: torch.Tensor, layout: Any = None) -> None:
        self._take_layout(X, layout)
        self.state = ADPSGDState(exchanges=0, rounds=0)

    def choose(self, i: int, k: int) -> int:
        """The passive partner of active node ``i`` at its ``k``-th step (0-based)."""
        ps = self.partners[i]
        return ps[int(np.random.default_rng([self.config.seed, int(i), int(k)]).integers(len(ps)))]

    @torch.no_grad()
    def step(self, X: torch.Tensor, U: torch.Tensor) -> None:
        """One lockstep round (see the module's docstring); every node must be hosted."""
        n = self.comm.world_size
        if X.shape[0] != n:
            raise ValueError(f"adpsgd's lockstep round needs every node hosted ({n}), got {X.shape[0]}; "
                             f"its asynchronous form runs on the event clock (python -m gossip.train --simulate N)")
        k = self.state.rounds
        for i in range(n):
            if self.active[i]:
                self.average_pair(X, i, self.choose(i, k))
            X[i] += U[i]
        self.state.rounds += 1

    @torch.no_grad()
    def average_pair(self, X: torch.Tensor, i: int, j: int) -> None:
        """Step 3 for rows ``i`` (active) and ``j`` (passive) of ``X`` (every node hosted):
        each sends its model to the other and both take the mean (with a compressor,
        their own model and the other's decoded one)."""
        self.state.exchanges += 1
        t = self.state.exchanges
        ledger, c, d = self.comm.ledger, self.compressor, X.shape[1]
        pair = torch.tensor([i, j], dtype=torch.int64)
        rows = X[pair]
        with ledger.phase("compress"):
            P = c.encode(rows.float(), node_keys(self.config.seed, pair, t), tag=step_tag(t))
        ledger.record([i, j], [j, i], P.shape[1], op="exchange")
        ledger.count("exchange")
        with ledger.phase("compress"):
            D = c.decode(P, d, tag=step_tag(t)).to(X.dtype)
        X[i] = 0.5 * (rows[0] + D[1])
        X[j] = 0.5 * (rows[1] + D[0])
