"""CHOCO-SGD's consensus step gamma on a label-sorted logistic regression.

8 simulated nodes on a ring; nodes 0-3 hold (almost) only label 0, nodes 4-7 label 1;
d = 800 features, 384 samples per node, full local gradients, step size
lr * 10 / (t + 10). For each compressor and gamma: the loss of the averaged model
after the last step, its ratio to D-PSGD's, the bytes sent relative to D-PSGD's
(setup traffic included) and the final consensus distance mean_i ||x_i - xbar||^2.
The same problem is tests/test_choco.py's.

    python -m experiments run choco_gamma
    python -m experiments run choco_gamma --compressors topk:p=0.01,sign --gammas 0.05,0.1,0.2 --steps 600
"""

from __future__ import annotations

import argparse

import torch

import topologies
from gossip import algorithms
from gossip.comm import SimulatedCommunicator
from experiments import _cli


def logistic_problem(n: int, d: int, per_node: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w_true = torch.randn(d, generator=g)
    F = torch.randn(n * per_node, d, generator=g)
    y = (F @ w_true / d**0.5 + torch.randn(n * per_node, generator=g) > 0).float()
    order = torch.argsort(y, stable=True)  # label-sorted shards
    return F[order].view(n, per_node, d), y[order].view(n, per_node)


def loss_grad(F: torch.Tensor, y: torch.Tensor, X: torch.Tensor):
    z = torch.einsum("npd,nd->np", F, X)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(z, y, reduction="none").mean(1)
    return loss, torch.einsum("np,npd->nd", torch.sigmoid(z) - y, F) / F.shape[1]


def train(name: str, F, y, steps: int, lr: float, **opts) -> tuple[float, int, float]:
    n, _, d = F.shape
    c = SimulatedCommunicator(topologies.build("ring", n))
    alg = algorithms.build(name, c, **opts)
    X = torch.zeros(n, d)
    alg.setup(X)
    for t in range(steps):
        _, G = loss_grad(F, y, X)
        alg.step(X, -lr * 10 / (t + 10) * G)
    xbar = X.mean(0, keepdim=True)
    loss = float(loss_grad(F, y, xbar.expand(n, d).contiguous())[0].mean())
    return loss, c.ledger.bytes_sent, float(((X - xbar) ** 2).sum(1).mean())


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run choco_gamma``."""
    p.add_argument("--compressors", default="topk:p=0.01,sign,quant:bits=4,block=256")
    p.add_argument("--gammas", default="0.02,0.05,0.1,0.2,0.5,1.0")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--dim", type=int, default=800)
    p.add_argument("--per-node", type=int, default=384)


def main(argv: list[str] | None = None) -> None:
    p, a = _cli.parse(argv, options, __doc__, "choco_gamma")
    torch.set_num_threads(1)
    F, y = logistic_problem(8, a.dim, a.per_node)
    base, base_bytes, base_cd = train("dpsgd", F, y, a.steps, a.lr)
    print(f"dpsgd: loss {base:.4f}, consensus distance {base_cd:.2e}, {base_bytes:,} bytes")
    print(f"{'compressor':<24} {'gamma':>6} {'loss':>8} {'/dpsgd':>7} {'bytes/dpsgd':>12} {'consensus':>10}")
    # a spec may hold commas (quant:bits=4,block=256): split on commas before a name
    specs, cur = [], ""
    for part in a.compressors.split(","):
        if "=" in part and ":" not in part and cur:
            cur += "," + part
        else:
            if cur:
                specs.append(cur)
            cur = part
    specs.append(cur)
    for spec in specs:
        for gamma in (float(g) for g in a.gammas.split(",")):
            loss, sent, cd = train("choco", F, y, a.steps, a.lr, compressor=spec, gamma=gamma)
            print(f"{spec:<24} {gamma:>6g} {loss:>8.4f} {loss / base:>7.3f} {f'1/{base_bytes / sent:.1f}':>12} {cd:>10.2e}",
                  flush=True)


if __name__ == "__main__":
    main()
