"""Train your own model with ECD-PSGD in your own loop.

Under torchrun, one node per process (gloo on CPU, NCCL on CUDA):

    torchrun --nproc_per_node 4 examples/own_training_loop.py --algo ecd --bits 8

The same script in one process, all nodes simulated:

    python examples/own_training_loop.py --simulate 4 --algo ecd --bits 8

At the end it prints, once, the test accuracy and training loss averaged over the
nodes, how far the nodes' models are from their average, and the bytes each node
sent.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import topologies
from gossip import algorithms, comm
from gossip.runtime import GossipOptimizer

FEATURES = 20


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 2))


def label(x: torch.Tensor) -> torch.Tensor:
    """The rule every node's data follows: a linear boundary through the origin."""
    return (x[:, 0] + 0.3 * x[:, 1] > 0).long()


def local_batch(node: int, gen: torch.Generator, device: torch.device):
    """Each node's own data: inputs drawn around a different centre per node."""
    x = torch.randn(32, FEATURES, generator=gen)
    x[:, 0] += 0.5 if node % 2 else -0.5
    return x.to(device), label(x).to(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algo", default="ecd", choices=list(algorithms.available()))
    p.add_argument("--bits", type=int, default=8, help="quantizer bits for naive, dcd and ecd")
    p.add_argument("--topology", default="ring", choices=list(topologies.available()))
    p.add_argument("--simulate", type=int, default=None, metavar="N", help="N nodes in this process")
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()

    # 1. a communicator: one node per rank under torchrun, or N nodes in this process
    if args.simulate:
        device = torch.device("cpu")
        c = comm.SimulatedCommunicator(topologies.build(args.topology, args.simulate))
    else:
        device = comm.init_from_env()  # torchrun's environment; gloo on CPU, NCCL on CUDA
        c = comm.DistCommunicator(topologies.build(args.topology, dist.get_world_size()))
    try:
        # 2. the algorithm; some (PowerSGD, the momentum variants of error feedback, ...)
        #    keep the momentum themselves, and then the local optimizer must not
        extra = {"compressor": f"quant:bits={args.bits}"} if args.algo in ("naive", "dcd", "ecd") else {}
        algo = algorithms.build(args.algo, c, **extra)
        momentum = 0.0 if algo.owns_momentum else 0.9
        # 3. one model and one local optimizer per hosted node, all starting from the same x_1
        models, opts = [], []
        for _ in c.nodes:
            torch.manual_seed(0)
            models.append(make_model().to(device))
            opts.append(torch.optim.SGD(models[-1].parameters(), lr=0.1, momentum=momentum))
        opt = GossipOptimizer(models, opts, algo)

        # 4. the training loop: local gradients, then opt.step() = local step + communication
        nodes = c.nodes.tolist()
        gens = [torch.Generator().manual_seed(node) for node in nodes]
        losses = torch.zeros(len(nodes), 1, dtype=torch.float64, device=device)
        for _ in range(args.steps):
            opt.zero_grad()
            for k, (node, model, gen) in enumerate(zip(nodes, models, gens)):
                x, y = local_batch(node, gen, device)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                losses[k, 0] = loss.item()
            opt.step()

        # 5. what it achieved and what it cost, averaged over all nodes (collectives,
        #    not recorded in the ledger)
        x_test = torch.randn(1000, FEATURES, generator=torch.Generator().manual_seed(12345))
        x_test, y_test = x_test.to(device), label(x_test).to(device)
        with torch.no_grad():
            acc = [(m(x_test).argmax(1) == y_test).double().mean().item() for m in models]
        stats = torch.tensor(
            [[a, float(c.ledger.sent_by(node))] for a, node in zip(acc, nodes)],
            dtype=torch.float64, device=device,
        )
        stats = torch.cat([stats, losses], dim=1)
        acc_mean, sent_mean, loss_mean = c.all_reduce(stats, op="mean", record=False)[0].tolist()
        distance = opt.consensus_distance()
        if nodes[0] == 0:
            print(f"{args.algo} on {args.topology} of {c.world_size} nodes, {args.steps} steps: "
                  f"test accuracy {acc_mean:.3f}, last training loss {loss_mean:.4f}, "
                  f"consensus distance {distance:.3g}, bytes sent per node {sent_mean:,.0f}")
    finally:
        if not args.simulate:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
