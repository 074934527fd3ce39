"""The run's communicators: the process group and the communicator over it (or the
simulated one), and a run in groups' (``--group-size`` G > 1) parts: the algorithm
between the groups, the communicator inside them, the ledgers of both levels and the
gradients averaged inside each group (:meth:`RunGroups.gradients`).

Built by :func:`gossip.train.loop.run` before the :class:`~gossip.train.loop.Run` that
steps over them; under torchrun the ranks agree on the config and the data
(:mod:`gossip.train.agreement`) before anything is exchanged.
"""

from __future__ import annotations

import torch

from gossip.errors import RunError
from gossip.train import agreement, assembly
from gossip.train.assembly import Env
from gossip.train.config import TrainConfig

__all__ = ["LevelLedgers", "RunGroups", "build_groups", "communicator"]


def communicator(cfg: TrainConfig, env: Env, topo, device, dataset, data_error: str | None, size: int = 1):
    """The process group and a communicator over it (the ranks agree on the config and
    the data before anything is exchanged or written), or the simulated one. In groups
    of ``size`` > 1: under torchrun one over all ranks (no graph: the groups' graph is
    the inter-group communicator's), in the simulation one row per group on the groups' graph."""
    from gossip import comm as gcomm

    if env.distributed:
        agreement.init_group(cfg, env, device)
        agreement.agree_config(cfg, env, dataset, data_error)
        comm = gcomm.DistCommunicator(topo if size == 1 else None, device=device, timeout=cfg.comm.timeout)
    else:
        comm = gcomm.SimulatedCommunicator(topo, world_size=env.world_size // size, device=device)
    if cfg.comm.emulate_latency:
        from gossip.comm.latency import LatencyCommunicator

        comm = LatencyCommunicator(comm, cfg.comm.emulate_latency / 1000.0)
    return comm


class RunGroups:
    """A run in groups (``--group-size`` G > 1): the algorithm between the groups
    (:class:`gossip.groups.Grouped`), the communicator inside the group(s) and the
    ledger of the traffic between groups. ``members``: the ranks (data shards) of each
    hosted row (a group in the simulation; the rank itself under torchrun); ``ranks``:
    how many ranks this process holds (N in the simulation, 1 under torchrun)."""

    def __init__(self, size: int, algo, intra, inter_ledger, members: list[list[int]], ranks: int) -> None:
        self.size, self.algo, self.intra, self.inter_ledger = size, algo, intra, inter_ledger
        self.members, self.ranks = members, ranks

    def checkpointed(self, ledger) -> "LevelLedgers":
        """What a checkpoint keeps of the traffic: the run's ``ledger`` and the levels'
        (inside the group; between groups where that is not the run's, under torchrun)."""
        levels = {"intra": self.intra.ledger}
        if self.inter_ledger is not ledger:
            levels["inter"] = self.inter_ledger
        return LevelLedgers(ledger, levels)

    def bytes_by_level(self, steps: int) -> dict[str, float]:
        """Bytes one rank sent per step inside its group and between groups (this process's ranks)."""
        per = max(1, steps) * self.ranks
        return {"intra": self.intra.ledger.step_bytes_sent / per, "inter": self.inter_ledger.step_bytes_sent / per}


    def gradients(self, run) -> list[float]:
        """Inside each hosted group: every member's forward and backward on its own shard,
        then the full-precision all-reduce of their gradients over the group (the mean),
        as DDP inside a group does; one loss per hosted row (the mean of its members')."""
        ledger, layout = run.ledger, run.gopt.flat
        grads, losses = [], []
        loaders = iter(run.loaders)
        with ledger.phase("compute"):
            for m_, members in zip(run.models, self.members):
                mine = []
                for _ in members:
                    ld = next(loaders)
                    m_.zero_grad(set_to_none=True)
                    xb, yb = ld.next_batch()
                    loss = run.loss(m_(xb), yb)
                    loss.backward()
                    mine.append(float(loss.detach()))
                    grads.append(torch.cat([p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel())
                                            for p in (p for p in m_.parameters() if p.requires_grad)]))
                losses.append(sum(mine) / len(mine))
        # (hosted members, hosted groups, d): member-major, as the intra communicator hosts the members
        G = torch.stack(grads).view(len(run.models), -1, layout.dim).transpose(0, 1).contiguous()
        with ledger.phase("communicate"):
            G = self.intra.all_reduce(G, op="sum")
        layout.scatter_grads(G[0].div_(self.size))
        return losses


class LevelLedgers:
    """The run's ledger with those of a run in groups' levels, saved and restored
    together (a checkpoint's ``ledger``: the run's state, plus ``levels``)."""

    def __init__(self, run, levels: dict) -> None:
        self.run, self.levels = run, levels

    def state_dict(self) -> dict:
        return {**self.run.state_dict(), "levels": {k: v.state_dict() for k, v in self.levels.items()}}

    def load_state_dict(self, sd: dict) -> None:
        sd = dict(sd)
        levels = sd.pop("levels", {})
        self.run.load_state_dict(sd)
        for k, ledger in self.levels.items():
            if k in levels:
                ledger.load_state_dict(levels[k])


def build_groups(cfg: TrainConfig, env: Env, topo, device, comm, size: int) -> RunGroups:
    """The parts of a run in groups of ``size``: under torchrun the group's and the
    inter-group process groups (every rank creates all of them), in the simulation one
    communicator per slice, each on the groups' graph, recording into the run's ledger."""
    from gossip import comm as gcomm
    from gossip.groups import GroupPlan, Grouped, SliceLedger, init_groups

    plan = GroupPlan(env.world_size, size)
    n = plan.groups

    def build(c):
        return assembly.build_algorithm(cfg, c)

    try:
        if env.distributed:
            dg = init_groups(size)
            inter = dg.inter_comm(topo, timeout=cfg.comm.timeout, device=device)
            intra = dg.intra_comm(timeout=cfg.comm.timeout, device=device)
            algo = Grouped.hosted(build, comm, inter=inter, member=dg.member, intra=intra, group_size=size)
            members, ranks, inter_ledger = [[env.rank]], 1, inter.ledger
        else:
            template = build(gcomm.SimulatedCommunicator(topo, world_size=n, device=device))
            runs = {j: gcomm.SimulatedCommunicator(topo, world_size=n, device=device,
                                                   ledger=SliceLedger(comm.ledger, j))
                    for j in range(size if template.shards_flat else 1)}
            intra = gcomm.SimulatedCommunicator(world_size=size, device=device)
            algo = Grouped(build, comm, inter=runs, intra=intra, group_size=size, sharded=template.shards_flat,
                           template=template)
            members, ranks, inter_ledger = [plan.group_ranks(k) for k in range(n)], env.world_size, comm.ledger
    except ValueError as e:
        raise RunError(f"--group-size {size}: {e}") from None
    return RunGroups(size, algo, intra, inter_ledger, members, ranks)

