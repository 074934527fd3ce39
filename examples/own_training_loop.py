"""Train your own model with ECD-PSGD in your own loop.

Under torchrun, one node per process (gloo on CPU, NCCL on CUDA):

    torchrun --nproc_per_node 4 examples/own_training_loop.py --algo ecd --bits 8

The same script in one process, all nodes simulated:

    python examples/own_training_loop.py --simulate 4 --algo ecd --bits 8
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import topologies
from gossip import algorithms, comm
from gossip.runtime import GossipOptimizer


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))


def local_batch(node: int, step: int, gen: torch.Generator):
    """Each node's own data: a 2-class problem whose class balance differs per node."""
    x = torch.randn(32, 20, generator=gen)
    y = (x[:, 0] + 0.3 * x[:, 1] + 0.2 * (node % 2) > 0).long()
    return x, y


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--algo", default="ecd", choices=list(algorithms.available()))
    p.add_argument("--bits", type=int, default=8)
    p.add_argument("--simulate", type=int, default=None, metavar="N")
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()

    # 1. a communicator: real ranks under torchrun, or N nodes in this process
    if args.simulate:
        c = comm.SimulatedCommunicator(topologies.build("ring", args.simulate))
    else:
        c = comm.init_from_env(topology="ring", backend="gloo")
    # 2. one model and one local optimizer per hosted node, all starting from the same x_1
    models, opts = [], []
    for _ in c.nodes:
        torch.manual_seed(0)
        models.append(make_model())
        opts.append(torch.optim.SGD(models[-1].parameters(), lr=0.1, momentum=0.9))
    # 3. the algorithm, wrapped around the local optimizers
    extra = {"compressor": f"quant:bits={args.bits}"} if args.algo in ("naive", "dcd", "ecd") else {}
    opt = GossipOptimizer(models, opts, algorithms.build(args.algo, c, **extra))
    gens = [torch.Generator().manual_seed(int(i)) for i in c.nodes]
    try:
        for step in range(args.steps):
            opt.zero_grad()
            for node, model, gen in zip(c.nodes.tolist(), models, gens):
                x, y = local_batch(node, step, gen)
                F.cross_entropy(model(x), y).backward()
            opt.step()
        dist = opt.consensus_distance()
        if int(c.nodes[0]) == 0:
            print(f"{args.algo}: consensus distance {dist:.3g}, "
                  f"bytes sent by node 0: {c.ledger.as_dict()['bytes_sent']:,}")
    finally:
        if not args.simulate:
            comm.shutdown()


if __name__ == "__main__":
    main()
