"""Hierarchical training in your own loop: DDP inside each group, an algorithm between groups.

    torchrun --nproc_per_node 4 examples/groups_ddp.py --group-size 2 --algo diloco --opt local_steps=5
    torchrun --nproc_per_node 4 examples/groups_ddp.py --group-size 2 --algo dpsgd --topology complete

gloo on CPU, NCCL when CUDA is present. ``gossip.groups.init_groups(G)`` cuts the ranks
into groups of G consecutive ranks and creates the process groups. Inside a group, DDP
averages the gradients in full precision over the group's process group every step, so
the members of a group hold the same model. Between groups, the algorithm runs with each
group as one node of its topology, each member exchanging only its 1/G slice of the
parameters with the members that hold the same slice in the other groups (the HSDP
layout), through ``GossipOptimizer`` around a plain ``torch.optim.SGD(momentum=0.9)``.

Rank 0 prints, once, the test accuracy and last training loss averaged over the ranks,
the bytes a rank sent between groups and inside its group (the slices' all-gather; DDP's
own all-reduce is torch's, counted apart), and whether the members of every group ended
with the same model.
"""

import argparse
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import topologies
from gossip.groups import init_groups
from gossip.runtime import GossipOptimizer

FEATURES = 20


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 2))


def label(x: torch.Tensor) -> torch.Tensor:
    return (x[:, 0] + 0.3 * x[:, 1] > 0).long()


def local_batch(rank: int, gen: torch.Generator, device: torch.device):
    """Each rank's own data: inputs drawn around a different centre per rank."""
    x = torch.randn(32, FEATURES, generator=gen)
    x[:, 0] += 0.5 if rank % 2 else -0.5
    return x.to(device), label(x).to(device)


def option(text: str) -> tuple[str, object]:
    """KEY=VALUE, the value read as an int, a float or else a string."""
    key, _, value = text.partition("=")
    for kind in (int, float):
        try:
            return key, kind(value)
        except ValueError:
            pass
    return key, value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--group-size", type=int, default=2, help="ranks per group (default 2)")
    p.add_argument("--algo", default="diloco", help="the algorithm between the groups (default diloco)")
    p.add_argument("--opt", type=option, action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the algorithm's Config (repeatable), e.g. local_steps=5")
    p.add_argument("--topology", default="complete", help="the groups' graph, for a gossip algorithm")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = gopt = algo = stats = None
    try:
        groups = init_groups(args.group_size)  # every rank, in the same order
        torch.manual_seed(0)
        model = DDP(make_model().to(device), device_ids=[device.index] if cuda else None,
                    process_group=groups.group_pg)  # full-precision data parallelism inside the group
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        graph = topologies.build(args.topology, groups.plan.groups) if args.topology else None
        algo = groups.algorithm(args.algo, graph, device=device, **dict(args.opt))  # between the groups
        gopt = GossipOptimizer(model, opt, algo)

        gen = torch.Generator().manual_seed(rank)
        for _ in range(args.steps):
            x, y = local_batch(rank, gen, device)
            gopt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()  # DDP: the gradient averaged over the group
            gopt.step()  # SGD, then the algorithm's exchange between the groups

        x_test = torch.randn(1000, FEATURES, generator=torch.Generator().manual_seed(12345))
        with torch.no_grad():
            acc = (model(x_test.to(device)).argmax(1) == label(x_test).to(device)).double().mean()
        inter = sum(inner.comm.ledger.step_bytes_sent for inner in algo.inners.values())
        intra = algo.intra.ledger.step_bytes_sent
        # every member of a group holds the same model: the largest difference from member 0's
        flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()]).double()
        first = flat.clone()
        dist.broadcast(first, groups.plan.group_ranks(groups.group)[0], group=groups.group_pg)
        stats = torch.tensor([float(acc), loss.item(), float(inter), float(intra),
                              float((flat - first).abs().max())], dtype=torch.float64, device=device)
        gathered = [torch.empty_like(stats) for _ in range(world)]
        dist.all_gather(gathered, stats)
        if rank == 0:
            table = torch.stack(gathered)
            acc_mean, loss_mean, inter_mean, intra_mean = table[:, :4].mean(0).tolist()
            same = bool(table[:, 4].max() == 0)
            print(f"{args.algo} between {groups.plan.groups} groups of {args.group_size} "
                  f"({'sliced' if algo.sharded else 'unsliced'}), {args.steps} steps: test accuracy {acc_mean:.3f}, "
                  f"last training loss {loss_mean:.4f}, bytes sent per rank between groups {inter_mean:,.0f}, "
                  f"inside its group {intra_mean:,.0f} (and DDP's all-reduce), members agree: {same}")
    finally:
        # DDP's reducer and the communicators hold process groups: they go first (see
        # examples/ddp_hook.py for why), then the groups
        model = gopt = algo = None
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
