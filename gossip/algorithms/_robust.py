"""A robust aggregator applied shard by shard: the one rule that ``allreduce`` and the
periodic methods (``diloco``/``muloco``, ``sparseloco``, ``demo``) share.

A robust rule (:class:`gossip.robust.Aggregator`: the coordinate-wise median and
trimmed mean of Yin et al., arXiv:1803.01498; centered clipping of Karimireddy, He and
Jaggi, arXiv:2012.10333) is not a sum, so it cannot be reduced inside a ring. The
``d`` values of a message are cut into ``n`` shards, one per node; shard ``j``'s rule
sees one row per node. :class:`ShardedRule` holds the cut, the rule and (centered
clipping) its centre, the previous aggregate of each shard, and runs it two ways:

* :meth:`ShardedRule.exchange` / :meth:`ShardedRule.post`: fp32 messages through the
  sharded layout (``Communicator.sharded_exchange``: node ``j`` receives every node's
  slice ``j``, applies the rule, all-gathers the result). Each node sends
  2 (n - 1)/n x 4d bytes, what a ring all-reduce of the same fp32 values sends;
  centered clipping adds the distances below;
* :meth:`ShardedRule.serve`: the rule on shard ``j``'s messages alone, for an owner
  whose messages arrive compressed through a :class:`~gossip.algorithms._sharded.ShardPlan`
  (it decodes them, applies the rule, re-compresses the aggregate);
* :meth:`ShardedRule.local`: the same rule, shard by shard, over every node's message
  already held by every node (an all-gather of sparse payloads whose indices differ
  from node to node, decoded to dense rows): no byte more than the all-gather.

The same messages give the same aggregate whichever way (a test checks it).

Centered clipping clips each sender's *whole* difference from the centre, as the paper's
rule does: ``v <- v + mean_i clip(m_i - v, tau)`` with ``||m_i - v||`` over all ``d``
values. No owner sees a whole message, so each owner ``j`` computes every sender's
squared distance over its shard, and the nodes add them up:

* :meth:`~ShardedRule.post`: the owners' replies to the push are these distances
  (``n`` floats each, ledger kind ``shard_pull``); every node sums them, each owner
  clips its shard with the whole distances, and the owners' aggregates are all-gathered
  (``all_gather``, shards padded to the longest, one value at most). Each further
  iteration (``iters``) all-gathers the owners' new distances (``n`` floats each).
  Each node sends ``4 n (n - 1)`` bytes more per iteration than the mean's exchange;
* :meth:`~ShardedRule.local`: the same sums over the messages held here.

An owner of compressed shards (:meth:`~ShardedRule.serve`, the periodic methods'
quantized sharded exchange) has no such round: it clips its shard alone, to the
shard's share of the radius, ``tau sqrt(L / d)`` (:meth:`gossip.robust.Aggregator.radius`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ShardedRule", "check_aggregator", "even_bounds"]


def check_aggregator(spec: Any, algo: str) -> Any:
    """A periodic method's ``aggregator`` option as a :class:`gossip.robust.Aggregator`; a
    bad spec raises one line naming the option, as does centered clipping's ``beta`` (the
    workers' momentum, which only ``allreduce``'s gradient messages take)."""
    from gossip.robust import parse_aggregator

    try:
        agg = parse_aggregator(spec)
    except ValueError as e:
        raise ValueError(f"Arg `aggregator` of {algo}: {e}") from None
    if agg.params.get("beta", 0.0) > 0:
        raise ValueError(f"Arg `aggregator` of {algo}: cclip's beta is the workers' momentum over allreduce's "
                         f"gradients (arXiv:2012.10333, Alg. 2); {algo}'s messages are not gradients of one step: "
                         f"drop beta (cclip, or cclip:tau=T for a fixed radius)")
    return agg


def even_bounds(d: int, n: int) -> list[tuple[int, int]]:
    """``d`` values in ``n`` consecutive shards, the first ``d % n`` one value longer."""
    q, r = divmod(d, n)
    cuts = [0]
    for j in range(n):
        cuts.append(cuts[-1] + q + (1 if j < r else 0))
    return [(cuts[j], cuts[j + 1]) for j in range(n)]


class ShardedRule:
    """``aggregator`` over the shards ``bounds`` (``(a, b)`` per node, in order).

    ``center`` (d,) float32: centered clipping's previous aggregate, updated in place
    (a view into the algorithm's State, so checkpoints carry it); None for the rules
    without one. An owner keeps at least its own shard of it current."""

    def __init__(self, aggregator: Any, bounds: list[tuple[int, int]], center: torch.Tensor | None = None) -> None:
        self.aggregator, self.bounds = aggregator, list(bounds)
        d = sum(b - a for a, b in self.bounds)
        # cclip's tau is the whole message's radius (an owner of compressed shards clips to its share)
        aggregator.dim = d
        self.whole = aggregator.name == "cclip"
        if self.whole and center is None:
            center = torch.zeros(d, dtype=torch.float32)
        self.center = center if self.whole else None
        self.nbytes = [4 * (b - a) for a, b in self.bounds]

    @classmethod
    def even(cls, aggregator: Any, d: int, n: int, *, what: str, center: torch.Tensor | None = None) -> "ShardedRule":
        """The ``d`` values cut evenly among ``n`` nodes; fewer values than nodes is refused."""
        if d < n:
            raise ValueError(f"{what}: aggregator={aggregator.spec} cuts the {d} values into {n} shards, one per "
                             f"node, and needs at least as many values as nodes")
        return cls(aggregator, even_bounds(d, n), center)

    @classmethod
    def on_state(cls, aggregator: Any, state: Any, X: torch.Tensor, n: int, *, what: str) -> "ShardedRule":
        """:meth:`even` over ``X``'s columns, with cclip's centre made in ``state.center``
        (1, d) so that checkpoints carry it (rules without a centre leave it empty)."""
        if aggregator.name == "cclip":
            state.center = torch.zeros(1, X.shape[1], dtype=torch.float32, device=X.device)
        center = state.center[0] if state.center.numel() else None
        return cls.even(aggregator, X.shape[1], n, what=what, center=center)

    @torch.no_grad()
    def serve(self, j: int, Q: torch.Tensor) -> torch.Tensor:
        """Shard ``j``'s aggregate (L,) float32 of its messages ``Q`` (k, L), one row per sender."""
        agg = self.aggregator
        a, b = self.bounds[j]
        if self.center is not None:
            agg.center[j] = self.center[a:b].to(Q.device)
        v = agg(Q, j)
        if self.center is not None:
            self.center[a:b] = v.to(self.center.device)
        return v

    def _distances(self, j: int, Q: torch.Tensor) -> torch.Tensor:
        """(k,) float32: each sender's squared distance from the centre over shard ``j``."""
        a, b = self.bounds[j]
        return (Q - self.center[a:b].to(Q.device)).square().sum(1)

    def _clip(self, j: int, Q: torch.Tensor, scale: torch.Tensor) -> None:
        """Shard ``j`` of the centre: ``v + mean_i scale_i (Q_i - v)``."""
        a, b = self.bounds[j]
        v = self.center[a:b].to(Q.device)
        self.center[a:b] = (v + ((Q - v) * scale).mean(0)).to(self.center.device)

    def _whole_clip(self, shards: dict[int, torch.Tensor], S: torch.Tensor, gather: Any) -> None:
        """``iters`` steps of centered clipping of the held ``shards`` (owner -> (k, L)),
        from ``S`` (n owners, k senders), every owner's squared distances; ``gather``
        all-gathers the held owners' next ones (m, k) -> (n, k)."""
        agg = self.aggregator
        for it in range(int(agg.params["iters"])):
            if it:
                S = gather(torch.stack([self._distances(j, Q) for j, Q in shards.items()]))
            scale = agg.scales(S.sum(0)).to(self.center.device)
            for j, Q in shards.items():
                self._clip(j, Q, scale.to(Q.device))

    def post(self, comm: Any, M: torch.Tensor) -> Any:
        """Post the sharded exchange of the hosted rows' fp32 messages ``M`` (m, d); the
        handle's ``wait()`` gives the replies' bytes, :meth:`finish` the aggregate."""
        # the shards are consecutive runs of values: a row's bytes are its messages in shard order
        P = M.to(torch.float32).contiguous().view(torch.uint8)
        if self.whole:
            return _WholeClip(self, comm, P)

        def serve(j: int, Q: torch.Tensor) -> torch.Tensor:
            return self.serve(j, Q.contiguous().view(torch.float32)).contiguous().view(torch.uint8)

        return comm.sharded_exchange_async(P, self.nbytes, self.nbytes, serve)

    def finish(self, R: torch.Tensor, device: Any) -> torch.Tensor:
        """The aggregate (d,) from the replies ``R`` of :meth:`post`; every node holds the
        whole of it, centered clipping's centre included."""
        out = R.view(torch.float32).to(device)
        if self.center is not None:
            self.center.copy_(out.to(self.center.device))
        return out

    def exchange(self, comm: Any, M: torch.Tensor) -> torch.Tensor:
        """:meth:`post` and :meth:`finish` at once: the aggregate (d,) of ``M`` (m, d)."""
        return self.finish(self.post(comm, M).wait(), M.device)

    @torch.no_grad()
    def local(self, D: torch.Tensor) -> torch.Tensor:
        """The aggregate (d,) float32 of every node's message ``D`` (n, d), held here."""
        D = D.to(torch.float32)
        if self.whole:
            shards = {j: D[:, a:b] for j, (a, b) in enumerate(self.bounds)}
            S = torch.stack([self._distances(j, Q) for j, Q in shards.items()])
            self._whole_clip(shards, S, gather=lambda X: X)
            return self.center.to(D.device, torch.float32).clone()
        return torch.cat([self.serve(j, D[:, a:b]) for j, (a, b) in enumerate(self.bounds)])


class _WholeClip:
    """Centered clipping's exchange in the sharded layout (see the module): the push,
    whose replies are every owner's distances; the clipping of the held shards; the
    all-gather of the owners' aggregates. ``wait()`` gives the aggregate's bytes, as the
    mean's handle gives its replies'."""

    def __init__(self, rule: ShardedRule, comm: Any, P: torch.Tensor) -> None:
        self.rule, self.comm, self.held = rule, comm, {}
        self.k = int(comm.world_size)
        self._result: torch.Tensor | None = None

        def serve(j: int, Q: torch.Tensor) -> torch.Tensor:
            Q = Q.contiguous().view(torch.float32)
            self.held[j] = Q
            return rule._distances(j, Q).contiguous().view(torch.uint8)

        self.handle = comm.sharded_exchange_async(P, rule.nbytes, [4 * self.k] * self.k, serve)

    @torch.no_grad()
    def wait(self) -> torch.Tensor:
        if self._result is not None:
            return self._result
        rule, comm = self.rule, self.comm
        R = self.handle.wait()
        S = R.view(torch.float32).view(self.k, self.k)
        owners = [int(j) for j in comm.nodes.tolist()]
        shards = {j: self.held[j] for j in owners}
        rule._whole_clip(shards, S, gather=comm.all_gather)
        width = max(b - a for a, b in rule.bounds)
        V = torch.zeros(len(owners), width, dtype=torch.float32, device=S.device)
        for r, j in enumerate(owners):
            a, b = rule.bounds[j]
            V[r, : b - a] = rule.center[a:b].to(V.device)
        G = comm.all_gather(V)
        out = torch.cat([G[j, : b - a] for j, (a, b) in enumerate(rule.bounds)])
        self._result = out.contiguous().view(torch.uint8)
        return self._result
