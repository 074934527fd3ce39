"""Groups: full-precision data parallelism inside a group, an algorithm between groups.

A run of ``N`` ranks is cut into ``N / G`` groups of ``G`` consecutive ranks (ranks
``kG .. kG + G - 1`` form group ``k``; a rank's place in its group is its *member*
index). Inside a group the members average their gradients in full precision every
step (an all-reduce over the group's process group, as DDP does), so the members of
one group always hold the same model. Between groups the chosen algorithm runs with
each group as one node of its topology.

**Sharded across the group** (the HSDP layout): the flat parameter vector (or, for a
gradient algorithm, the gradient) is cut into ``G`` equal slices, and member ``j`` of
every group runs the algorithm on slice ``j`` only, with the members ``j`` of the other
groups as its peers (:func:`slice_bounds`). Each member therefore sends ``1/G`` of its
group's inter-group traffic over its own link and keeps the algorithm's state for its
slice only; after the exchange the members all-gather their slices inside the group.
The cut is at equal element counts, so an algorithm that treats the coordinates one by
one (D-PSGD, local SGD, DiLoCo, the all-reduce) gives exactly the result the whole
vector would; one that computes a statistic of the vector it is given (a quantizer's
scale over the whole row, a sign compressor's mean magnitude) computes it per slice.

An algorithm whose exchange needs the model's tensor shapes (PowerSGD's matrices,
DeMo's and SparseLoCo's chunks, the sketches, Streaming DiLoCo's fragments:
``Algorithm.shards_flat`` is False) is not sliced: member 0 of each group runs it on
the whole vector with the members 0 of the other groups, and broadcasts the result
inside its group (:attr:`Grouped.sharded` says which form runs).

:class:`Grouped` is the algorithm that does this around any other; :func:`init_groups`
builds, under torchrun, the group's process group and the inter-group communicator
for the user's own loop (docs/hierarchical.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from gossip.algorithms.base import Algorithm, ParamLayout, WireFormat

__all__ = ["DistGroups", "GroupPlan", "Grouped", "SliceLedger", "init_groups", "slice_bounds", "slice_layout"]


@dataclass(frozen=True)
class GroupPlan:
    """``world_size`` ranks in groups of ``group_size`` consecutive ranks.

    Raises:
        ValueError: one line, where ``group_size`` is not a positive integer, is larger
            than ``world_size`` or does not divide it.
    """

    world_size: int
    group_size: int

    def __post_init__(self) -> None:
        n, g = self.world_size, self.group_size
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"group size must be a positive integer, got {g!r}")
        if g > n:
            raise ValueError(f"group size {g} is larger than the world size {n}")
        if n % g:
            raise ValueError(f"group size {g} does not divide the world size {n} (accepted: a divisor of {n}: "
                             f"{', '.join(str(k) for k in range(1, n + 1) if n % k == 0)})")

    @property
    def groups(self) -> int:
        """How many groups: the number of nodes of the inter-group algorithm."""
        return self.world_size // self.group_size

    def group_of(self, rank: int) -> int:
        return rank // self.group_size

    def member_of(self, rank: int) -> int:
        return rank % self.group_size

    def group_ranks(self, group: int) -> list[int]:
        """The ranks of group ``group``, by member index."""
        return list(range(group * self.group_size, (group + 1) * self.group_size))

    def slice_ranks(self, member: int) -> list[int]:
        """The ranks that hold member index ``member`` in every group, by group."""
        return [member + k * self.group_size for k in range(self.groups)]


def slice_bounds(d: int, parts: int) -> tuple[tuple[int, int], ...]:
    """``(offset, numel)`` of ``parts`` consecutive slices of ``d`` values, as equal as
    they can be (the first ``d % parts`` one value longer)."""
    if parts < 1 or d < parts:
        raise ValueError(f"cannot cut {d} parameters into {parts} non-empty slices")
    base, extra = divmod(d, parts)
    out, off = [], 0
    for j in range(parts):
        n = base + (j < extra)
        out.append((off, n))
        off += n
    return tuple(out)


def slice_layout(layout: ParamLayout, offset: int, numel: int) -> ParamLayout:
    """The part of ``layout`` in ``[offset, offset + numel)``: the tensors it holds whole
    keep their shapes, a tensor it cuts is the 1-D piece it holds (named ``name[a:b]``)."""
    shapes, names = [], []
    end = offset + numel
    for name, shape, (o, n) in zip(layout.names, layout.shapes, layout.blocks):
        a, b = max(o, offset), min(o + n, end)
        if b <= a:
            continue
        if a == o and b == o + n:
            shapes.append(shape)
            names.append(name)
        else:
            shapes.append((b - a,))
            names.append(f"{name}[{a - o}:{b - o}]")
    return ParamLayout(tuple(shapes), tuple(names))


class SliceLedger:
    """The simulation's view of the run's ledger for the communicator of slice ``j``:
    the same ledger (every count and byte lands in it), except that a one-off cost
    (:meth:`gossip.comm.Ledger.once`: the payload size check) is charged for each
    slice, as under torchrun, where each member's own communicator pays it once.
    ``base`` is the ledger itself."""

    def __init__(self, base: Any, j: int) -> None:
        self.base, self.slice = base, int(j)

    def once(self, key: str) -> bool:
        return self.base.once(key if self.slice == 0 else f"{key} (slice {self.slice})")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)


class Grouped(Algorithm):
    """An inter-group algorithm run between groups, sharded across each group's members.

    Args:
        build: builds the inner algorithm on a communicator whose nodes are the groups.
        comm: the communicator of the hosted rows (:class:`gossip.runtime.GossipOptimizer`
            takes ``m`` and the start's check from it): one row per hosted group.
        inter: the inner algorithm's communicator of each slice this process runs
            (``{slice: comm}``): in the simulation every slice's, under torchrun the
            member's own (sharded) or, unsharded, member 0's alone. Each communicator's
            nodes are the groups, its topology the groups' graph.
        intra: the communicator of the members of the group(s): its hosted nodes are
            the members this process holds (all ``G`` in the simulation, one under
            torchrun); the slices are all-gathered (unsharded: broadcast from member 0)
            over it after every step that exchanged between the groups.
        group_size: ``G``.
        sharded: None: sharded where the inner algorithm allows it (``shards_flat``);
            False: the unsharded form (member 0 exchanges, then broadcasts), for any
            algorithm; True: refuse an algorithm that cannot be sliced.
        template: where this process runs no slice (a member other than 0 of an
            unsharded run): an inner algorithm built on some communicator, never set
            up, that answers what the algorithm is (name, wire format, momentum).
    """

    @classmethod
    def hosted(cls, build: Callable[[Any], Algorithm], comm: Any, *, inter: Any, member: int, intra: Any,
               group_size: int, sharded: bool | None = None) -> "Grouped":
        """As one process of a group hosts it under torchrun: the inner algorithm between
        the groups on ``inter`` (the ranks of this ``member`` index in every group), run
        by this member on its own slice where the algorithm can be sliced (``sharded``
        None: where ``shards_flat`` says so), else by member 0 alone on the whole vector,
        the other members holding a template built on ``inter`` and never set up."""
        template = build(inter)
        can = template.shards_flat if sharded is None else sharded
        runs = {member: inter} if can else ({0: inter} if member == 0 else {})
        return cls(build, comm, inter=runs, intra=intra, group_size=group_size, sharded=bool(can), template=template)

    def __init__(self, build: Callable[[Any], Algorithm], comm: Any, *, inter: Mapping[int, Any], intra: Any,
                 group_size: int, sharded: bool | None = None, template: Algorithm | None = None) -> None:
        self.inners: dict[int, Algorithm] = {j: build(c) for j, c in sorted(inter.items())}
        first = next(iter(self.inners.values()), template)
        if first is None:
            raise ValueError("Grouped: give at least one inter-group communicator or a template algorithm")
        if first.name == "mergecomp" or isinstance(first, Grouped):
            raise ValueError(f"{first.name} schedules the layers of the backward pass of one node per process "
                             "and cannot run between groups")
        can = bool(first.shards_flat)
        if sharded and not can:
            raise ValueError(f"{first.name} cannot be sliced across the members of a group (its exchange needs "
                             "the model's tensor shapes); run it unsharded")
        self.sharded = can if sharded is None else bool(sharded)
        self.group_size = G = int(group_size)
        self.slices_count = G if self.sharded else 1
        bad = [j for j in self.inners if not 0 <= j < self.slices_count]
        if bad:
            raise ValueError(f"Grouped: slices {bad} out of range for {self.slices_count} slice(s)")
        self.template = first
        super().__init__(first.config, comm)
        self.intra = intra
        # what the algorithm is: its own
        self.name = first.name
        self.acts_on = first.acts_on
        self.decentralized = first.decentralized
        self.needs_static_graph = first.needs_static_graph
        self.state_copies = first.state_copies
        self.local_optimizer_default = first.local_optimizer_default
        self.local_momentum_default = first.local_momentum_default
        self.summary = first.summary
        self.bounds: tuple[tuple[int, int], ...] = ()
        self._parts: dict[int, torch.Tensor] = {}
        self._uparts: dict[int, torch.Tensor] = {}
        self.t = 0  # steps taken (model algorithms): which of them are local only

    @property
    def own_momentum(self) -> float:
        return self.template.own_momentum

    # --- lifecycle -----------------------------------------------------------------
    def setup(self, X: torch.Tensor, layout: ParamLayout | None = None) -> None:
        layout = self._take_layout(X, layout)
        if len(self.intra.nodes) not in (1, self.group_size):
            raise ValueError(f"Grouped: the intra-group communicator hosts {len(self.intra.nodes)} members, "
                             f"expected 1 or {self.group_size}")
        self.bounds = slice_bounds(X.shape[1], self.slices_count)
        self.state = True
        for j, inner in self.inners.items():
            off, n = self.bounds[j]
            self._parts[j] = X[:, off:off + n].clone(memory_format=torch.contiguous_format)  # its own buffer
            sub = layout if self.slices_count == 1 else slice_layout(layout, off, n)
            ledger = inner.comm.ledger
            if getattr(ledger, "base", ledger) is self.comm.ledger:  # already counted as setup by the caller
                inner.setup(self._parts[j], sub)
            else:
                with ledger.setup():
                    inner.setup(self._parts[j], sub)

    @torch.no_grad()
    def step(self, X: torch.Tensor, U: torch.Tensor) -> None:
        """Step I: each slice this process runs takes the inner algorithm's step on its
        columns of ``x_t`` and ``u_t``. Step II: the members share their slices; on a
        step the algorithm takes locally (``local_only``: a periodic method's local
        steps, ``x <- x + u``) every member applies it to the whole vector instead, the
        same values the slices hold, and nothing crosses the group's links."""
        self.t += 1
        local = self.template.local_only(self.t)
        for j, inner in self.inners.items():
            off, n = self.bounds[j]
            xs = self._parts[j]
            xs.copy_(X[:, off:off + n])
            us = self._uparts.get(j)
            if us is None or us.shape != xs.shape:
                us = self._uparts[j] = torch.empty_like(xs)
            us.copy_(U[:, off:off + n])
            inner.step(xs, us)
        if local:
            with self.comm.ledger.phase("compute"):
                X.add_(U)
        else:
            self._share(X)

    @torch.no_grad()
    def reduce_gradients(self, G: torch.Tensor) -> None:
        """Step I: the inner algorithm reduces this process's slices of the (group-averaged)
        gradient between the groups. Step II: the members share their slices."""
        for j, inner in self.inners.items():
            off, n = self.bounds[j]
            gs = self._parts[j]
            gs.copy_(G[:, off:off + n])
            inner.reduce_gradients(gs)
        self._share(G)

    def _share(self, X: torch.Tensor) -> None:
        """Every member's slices into ``X``, for every hosted group: an all-gather of the
        slices inside the group (sharded), or member 0's result broadcast (unsharded)."""
        hosted = [int(i) for i in self.intra.nodes]  # members held here
        m, d = X.shape
        with self.comm.ledger.phase("communicate"):
            if self.sharded:
                width = max(n for _, n in self.bounds)
                P = X.new_zeros((len(hosted), m, width))
                for r, j in enumerate(hosted):
                    off, n = self.bounds[j]
                    P[r, :, :n] = self._parts[j]
                got = self.intra.all_gather(P)  # (G, m, width): slice j from member j
                for j, (off, n) in enumerate(self.bounds):
                    X[:, off:off + n] = got[j, :, :n]
            else:
                P = X.new_zeros((len(hosted), m, d))
                if 0 in self.inners:
                    P[hosted.index(0)] = self._parts[0]
                got = self.intra.broadcast(P, 0)
                X.copy_(got[0])

    # --- hooks: the inner algorithm's --------------------------------------------------
    def set_lr(self, lr: float) -> None:
        for inner in self.inners.values():
            inner.set_lr(lr)

    def on_step_end(self, step: int) -> None:
        for inner in self.inners.values():
            inner.on_step_end(step)

    def on_epoch_end(self, epoch: int) -> None:
        for inner in self.inners.values():
            inner.on_epoch_end(epoch)

    def set_event_sink(self, fn: Callable[[str], None] | None) -> None:
        super().set_event_sink(fn)
        for j, inner in self.inners.items():
            inner.set_event_sink(fn if j == min(self.inners) else None)

    def report(self) -> dict | None:
        return self.template.report()

    def summary_fields(self) -> dict[str, Any]:
        return self.template.summary_fields()

    def wire_format(self) -> WireFormat:
        return self.template.wire_format()

    @property
    def payload_compressor(self) -> Any:
        return self.template.payload_compressor

    @property
    def period(self) -> int:
        return self.template.period

    def state_dict(self) -> dict:
        if self.state is None:
            raise RuntimeError(f"{self.name}: call setup() before state_dict()")
        return {"slices": {j: inner.state_dict() for j, inner in self.inners.items()}, "t": self.t}

    def load_state_dict(self, sd: dict) -> None:
        got = sd.get("slices") if isinstance(sd, dict) else None
        if not isinstance(got, dict) or set(got) != set(self.inners):
            raise ValueError(f"{self.name} between groups: state holds slices "
                             f"{sorted(got) if isinstance(got, dict) else got!r}, expected {sorted(self.inners)}")
        for j, inner in self.inners.items():
            inner.load_state_dict(got[j])
        self.t = int(sd.get("t", 0))

    def __repr__(self) -> str:
        return (f"Grouped({self.template!r}, group_size={self.group_size}, "
                f"{'sharded' if self.sharded else 'unsharded'})")


class DistGroups:
    """Under torchrun, the process groups of a grouped run (:func:`init_groups`).

    ``plan`` (:class:`GroupPlan`), this rank's ``group`` and ``member`` index,
    ``group_pg`` (the process group of this rank's group: hand it to DDP as its
    ``process_group``, or build a device mesh over it) and ``inter_pg`` (the ranks
    that hold this member index in every group: the inter-group algorithm's).
    """

    def __init__(self, plan: GroupPlan, rank: int, group_pg: Any, inter_pg: Any) -> None:
        self.plan, self.rank = plan, rank
        self.group, self.member = plan.group_of(rank), plan.member_of(rank)
        self.group_pg, self.inter_pg = group_pg, inter_pg

    def intra_comm(self, *, timeout: float = 300.0, device: Any = None) -> Any:
        """A communicator over this rank's group (node ids: member indices) with a ledger
        of its own: the intra-group traffic."""
        from gossip.comm import DistCommunicator, Ledger

        return DistCommunicator(None, group=self.group_pg, timeout=timeout, device=device,
                                ledger=Ledger([self.member], self.plan.group_size))

    def inter_comm(self, topology: Any = None, *, timeout: float = 300.0, device: Any = None) -> Any:
        """A communicator between the groups (node ids: group indices) over the ranks
        that hold this rank's member index in every group, with a
        ledger of its own: the inter-group traffic. ``topology``: the groups' graph
        (``N / G`` nodes) for a decentralized algorithm."""
        from gossip.comm import DistCommunicator, Ledger

        return DistCommunicator(topology, group=self.inter_pg, timeout=timeout, device=device,
                                ledger=Ledger([self.group], self.plan.groups))

    def algorithm(self, name: str, topology: Any = None, *, sharded: bool | None = None, timeout: float = 300.0,
                  device: Any = None, comm: Any = None, **options: Any) -> Grouped:
        """The registry's algorithm ``name`` between the groups, sharded across this
        group's members where it can be (:class:`Grouped`), ready for
        :class:`gossip.runtime.GossipOptimizer` (``comm``: the communicator of the
        hosted row, default one over all ranks)."""
        from gossip import algorithms
        from gossip.comm import DistCommunicator

        inter = self.inter_comm(topology, timeout=timeout, device=device)
        return Grouped.hosted(lambda c: algorithms.build(name, c, **options),
                              comm if comm is not None else DistCommunicator(None, timeout=timeout, device=device),
                              inter=inter, member=self.member, intra=self.intra_comm(timeout=timeout, device=device),
                              group_size=self.plan.group_size, sharded=sharded)


def init_groups(group_size: int) -> DistGroups:
    """Under torchrun (the default process group initialised), cut the ranks into groups
    of ``group_size`` consecutive ranks and create their process groups: every group's,
    and for every member index the ranks holding it in each group. Every rank must call
    it, in the same order as its other ``new_group`` calls.

    Raises:
        ValueError: one line, where ``group_size`` does not fit the world size.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("init_groups: no process group; call gossip.comm.init_from_env() or "
                           "torch.distributed.init_process_group() first")
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = GroupPlan(world, group_size)
    mine_group = mine_inter = None
    for k in range(plan.groups):  # new_group is collective: every rank creates every group
        pg = dist.new_group(plan.group_ranks(k))
        if plan.group_of(rank) == k:
            mine_group = pg
    for j in range(plan.group_size):
        pg = dist.new_group(plan.slice_ranks(j))
        if plan.member_of(rank) == j:
            mine_inter = pg
    return DistGroups(plan, rank, mine_group, mine_inter)
