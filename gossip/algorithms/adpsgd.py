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

Under torchrun (one node per rank) the exchanges run with no barrier, on a
:class:`gossip.comm.pairs.PairChannel`. The rank's parameters ``X`` are the model
x_hat_i it read for its gradient; the node's model x_i itself is ``live``. An active
rank owns its model: at its k-th step it sends x_i to its partner, takes the mean
with the reply and applies its update. A passive rank answers its active neighbours
from a background thread at any time, each answer replying with x_j and taking the
mean into ``live`` under a lock; at its own step it applies its update to ``live``
and reads it into ``X`` for its next gradient. So a slow rank delays only the active
neighbour that exchanges with it, for that exchange (a passive one: not even that).
:meth:`ADPSGD.finish` ends the exchanges after the last step: active ranks say bye,
passive ranks wait for every active neighbour's bye and take their final model.
"""

from __future__ import annotations

import threading
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
        self._pairs: _Pairs | None = None  # under torchrun, made by setup

    @property
    def payload_compressor(self) -> Any:
        return self.compressor

    def setup(self, X: torch.Tensor, layout: Any = None) -> None:
        self._take_layout(X, layout)
        self.state = ADPSGDState(exchanges=0, rounds=0)
        if X.shape[0] == 1 and hasattr(self.comm, "pair_channel"):  # one node per rank: no barrier
            self._pairs = _Pairs(self, X)

    def choose(self, i: int, k: int) -> int:
        """The passive partner of active node ``i`` at its ``k``-th step (0-based)."""
        ps = self.partners[i]
        return ps[int(np.random.default_rng([self.config.seed, int(i), int(k)]).integers(len(ps)))]

    @torch.no_grad()
    def step(self, X: torch.Tensor, U: torch.Tensor) -> None:
        """One lockstep round (see the module's docstring); every node must be hosted."""
        if self._pairs is not None:
            self._pairs.step(X, U)
            return
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

    def finish(self, X: torch.Tensor, final: bool = True) -> None:
        """After the last step under torchrun, final or not: active ranks say bye to their
        passive neighbours, passive ranks wait for every bye and read their final model
        into ``X``. Nothing to do in the simulation."""
        if self._pairs is not None:
            self._pairs.finish(X)


class _Pairs:
    """AD-PSGD's exchanges under torchrun (see the module's docstring): this rank's
    model ``live``, the lock its serving thread and its own step share, and the replies
    the thread sent since the last step (for the ledger, which only the main thread
    writes)."""

    def __init__(self, algo: ADPSGD, X: torch.Tensor) -> None:
        comm = algo.comm
        self.algo, self.rank = algo, int(comm.rank)
        self.active = algo.active[self.rank]
        self.d = int(X.shape[1])
        self.nbytes = algo.compressor.payload_nbytes(self.d)
        self.live = X[0].detach().clone()
        self.lock = threading.Lock()
        self.replied: list[int] = []
        self.channel = comm.pair_channel()  # a collective: every rank builds its end here
        if not self.active:
            actives = [int(j) for j in comm.topology.neighbors(self.rank)[0]]
            self.channel.serve(actives, self.nbytes, self._answer)

    def _code(self, x: torch.Tensor, t: int, peer: int) -> torch.Tensor:
        """x encoded for exchange ``t`` with ``peer``: its own key stream per partner, since
        a passive rank's partners count their exchanges separately."""
        keys = node_keys(self.algo.config.seed, torch.tensor([self.rank]), t, stream=1 + peer)
        return self.algo.compressor.encode(x.unsqueeze(0).float(), keys, tag=step_tag(t))[0]

    def _decode(self, P: torch.Tensor, t: int) -> torch.Tensor:
        return self.algo.compressor.decode(P.unsqueeze(0), self.d, tag=step_tag(t))[0].to(self.live.dtype)

    def _answer(self, peer: int, t: int, P: torch.Tensor) -> torch.Tensor:
        """The serving thread: reply with x_j and take the mean with the request (the
        ledger's phase clocks are the main thread's: this time is not charged)."""
        with self.lock:
            mine = self._code(self.live, t, peer)
            self.live.mul_(0.5).add_(self._decode(P, t), alpha=0.5)
            self.replied.append(peer)
        return mine

    def _flush(self) -> None:
        ledger = self.algo.comm.ledger
        for peer in self.replied:
            ledger.record(self.rank, peer, self.nbytes, op="exchange")
        self.replied.clear()

    def step(self, X: torch.Tensor, U: torch.Tensor) -> None:
        algo, st = self.algo, self.algo.state
        self.channel.check()  # what stopped the serving thread, on this thread
        if self.active:
            t = st.rounds + 1  # this rank's exchange counter: the payloads' keys and tag
            j = algo.choose(self.rank, st.rounds)
            ledger = algo.comm.ledger
            with ledger.phase("compress"):
                mine = self._code(X[0], t, j)
            with ledger.phase("communicate"):
                theirs = self.channel.request(j, t, mine)
            ledger.record(self.rank, j, self.nbytes, op="exchange")
            ledger.count("exchange")
            with ledger.phase("compress"):
                D = self._decode(theirs, t)
            X[0].mul_(0.5).add_(D, alpha=0.5).add_(U[0])
            st.exchanges += 1
        else:
            with self.lock:
                st.exchanges += len(self.replied)
                self._flush()
                self.live.add_(U[0])
                X[0].copy_(self.live)
        st.rounds += 1

    def finish(self, X: torch.Tensor) -> None:
        if self.active:
            for j in self.algo.partners[self.rank]:
                self.channel.bye(j)
            return
        self.channel.join()
        with self.lock:
            self.algo.state.exchanges += len(self.replied)
            self._flush()
            X[0].copy_(self.live)

