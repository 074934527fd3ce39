"""A small GPT trained with plain DistributedDataParallel, its gradients compressed by PowerSGD.

    torchrun --nproc_per_node 2 examples/ddp_gpt_powersgd.py                   # the default corpus
    torchrun --nproc_per_node 2 examples/ddp_gpt_powersgd.py --text my.txt --rank 4 --steps 300

gloo on CPU, NCCL when CUDA is present. The script is an ordinary DDP training loop
of a decoder-only transformer on byte-level text; the two lines marked ``# gossip``
replace DDP's all-reduce of each gradient bucket by PowerSGD's rank-r reduction
(Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", arXiv:1905.13727), with its error feedback and its own momentum (so
the local SGD has none). Each process reads its own contiguous part of the training
text (a ``sorted`` split). Rank 0 prints, once, the held-out bits per byte before and
after training and the bytes each process sent, next to what DDP's full-precision
all-reduce would have sent for the same steps.
"""

import argparse
import gc
import math
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gossip import ddp
from gossip.train import evaluation
from gossip.data import build_dataset, partition_dataset
from gossip.models import build_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", default=None, help="a UTF-8 file or folder (default: the standard library's sources)")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--rank", type=int, default=2, help="PowerSGD's rank")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.3)
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = state = stats = None
    try:
        data = build_dataset("text", data_dir=args.text, context=args.context,
                             max_test_bytes=max(args.context + 1, 16384))
        mine = partition_dataset(data, world, "sorted")[rank]  # this process's part of the text
        gpt = build_model("gpt", input_shape=data.input_shape, num_classes=data.num_classes, seed=0,
                          layers=args.layers, width=args.width, heads=args.heads).to(device)
        before = evaluation.test_metrics(gpt, data, device)["test_bpb"]
        model = DDP(gpt, device_ids=[device.index] if cuda else None)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)  # PowerSGD keeps the momentum
        state = ddp.hook_state(model, "powersgd", optimizer=opt, rank=args.rank)  # gossip
        model.register_comm_hook(state, ddp.hook)  # gossip

        gen = torch.Generator().manual_seed(rank)
        for _ in range(args.steps):
            rows = mine[torch.randint(len(mine), (args.batch_size,), generator=gen)]
            x, y = data.x_train[rows].to(device), data.y_train[rows].to(device)
            opt.zero_grad()
            loss = evaluation.lm_loss(model(x), y)  # mean cross-entropy per byte, in nats
            loss.backward()
            opt.step()

        after = evaluation.test_metrics(gpt, data, device)["test_bpb"]
        stats = torch.tensor([after, float(loss.detach()), float(state.ledger.bytes_sent)], dtype=torch.float64,
                             device=device)
        dist.all_reduce(stats)
        after_mean, loss_mean, sent_mean = (stats / world).tolist()
        numel = sum(p.numel() for p in gpt.parameters())
        full = args.steps * ((2 * (world - 1) * 4 * numel + world // 2) // world)  # a ring all-reduce of fp32
        if rank == 0:
            print(f"gpt ({numel:,} params) with powersgd rank {args.rank} under DDP on {world} processes, "
                  f"{args.steps} steps: held-out bits per byte {before:.3f} -> {after_mean:.3f}, "
                  f"last training loss {loss_mean / math.log(2):.3f} bits per byte, bytes sent per process "
                  f"{sent_mean:,.0f} (full-precision all-reduce {full:,})")
    finally:
        # DDP's reducer holds the process group: drop it first (see examples/ddp_hook.py)
        model = state = None
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
