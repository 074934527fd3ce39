"""A plain DistributedDataParallel script whose gradients travel compressed.

    torchrun --nproc_per_node 2 examples/ddp_hook.py --algo efsgd --opt compressor=quant:bits=8
    torchrun --nproc_per_node 2 examples/ddp_hook.py --algo powersgd --opt rank=2

gloo on CPU, NCCL when CUDA is present. It differs from a plain DDP script by the
import and the two lines marked ``# gossip``: DDP's all-reduce of each gradient bucket
becomes the algorithm's compressed reduction. Rank 0 prints, once, the test accuracy
and last training loss averaged over the processes, the bytes each process sent and
what DDP's full-precision all-reduce would have sent for the same steps.
"""

import argparse
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gossip import ddp

FEATURES = 20


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 2))


def label(x: torch.Tensor) -> torch.Tensor:
    return (x[:, 0] + 0.3 * x[:, 1] > 0).long()


def local_batch(rank: int, gen: torch.Generator, device: torch.device):
    """Each process's own data: inputs drawn around a different centre per rank."""
    x = torch.randn(32, FEATURES, generator=gen)
    x[:, 0] += 0.5 if rank % 2 else -0.5
    return x.to(device), label(x).to(device)


def option(text: str) -> tuple[str, object]:
    """KEY=VALUE, the value read as a bool, an int, a float or else a string."""
    key, _, value = text.partition("=")
    if value.lower() in ("true", "false"):
        return key, value.lower() == "true"
    for kind in (int, float):
        try:
            return key, kind(value)
        except ValueError:
            pass
    return key, value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algo", default="efsgd", choices=ddp.HOOK_ALGORITHMS)
    p.add_argument("--opt", type=option, action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the algorithm's Config (repeatable), e.g. compressor=quant:bits=8")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=0.1)
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = state = stats = None
    try:
        torch.manual_seed(0)
        model = DDP(make_model().to(device), device_ids=[device.index] if cuda else None)
        # the algorithms that keep momentum themselves (powersgd, signum, ...) need a
        # local optimizer without any; hook_state refuses the pair in one line
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        state = ddp.hook_state(model, args.algo, optimizer=opt, **dict(args.opt))  # gossip
        model.register_comm_hook(state, ddp.hook)  # gossip

        gen = torch.Generator().manual_seed(rank)
        for _ in range(args.steps):
            x, y = local_batch(rank, gen, device)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()

        x_test = torch.randn(1000, FEATURES, generator=torch.Generator().manual_seed(12345))
        with torch.no_grad():
            acc = (model(x_test.to(device)).argmax(1) == label(x_test).to(device)).double().mean()
        stats = torch.stack([acc, loss.detach().double(), torch.tensor(float(state.ledger.bytes_sent),
                                                                       dtype=torch.float64, device=device)])
        dist.all_reduce(stats)
        acc_mean, loss_mean, sent_mean = (stats / world).tolist()
        # a ring all-reduce sends 2 (W - 1) / W of the gradient's bytes per step
        numel = sum(p.numel() for p in model.parameters())
        full = args.steps * ((2 * (world - 1) * 4 * numel + world // 2) // world)
        if rank == 0:
            print(f"{args.algo} under DDP on {world} processes, {args.steps} steps: "
                  f"test accuracy {acc_mean:.3f}, last training loss {loss_mean:.4f}, "
                  f"bytes sent per process {sent_mean:,.0f} (full-precision all-reduce {full:,})")
    finally:
        # Teardown order (torch 2.13, gloo): DDP's reducer holds the process group, so the
        # group's destructor runs where the last of the two goes, and it joins gloo's worker
        # threads holding the GIL. A worker that is still releasing a finished collective
        # whose tensor Python no longer references needs the GIL for it: a deadlock. So
        # the reducer goes first, and the group while `stats` (the last collective's
        # tensor) is still referenced here.
        model = state = None
        gc.collect()  # DDP modules sit in reference cycles
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
