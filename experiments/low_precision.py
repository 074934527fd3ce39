"""How naive compression, DCD-PSGD and ECD-PSGD behave as the bits go down.

    python -m experiments run low_precision [--nodes 8] [--steps 300] [--json PATH]

``--json`` writes the rows with a provenance record (experiments/_provenance.py);
the README's table is rendered from experiments/results/low_precision.json.

Logistic regression on 8 nodes of a ring, each node holding a slice of the
label-sorted data (strongly non-identical local data), run in the in-process
simulation with plain SGD (u = -lr * g). Prints the final loss of the averaged model
for D-PSGD and for naive/DCD/ECD with the stochastic quantizer at 8, 4, 2 and 1 bits.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import topologies
from gossip import algorithms, comm

from experiments import _provenance
from experiments import _cli

#: the code these figures measure (for `python -m experiments.render --stale`)
SOURCES = ["gossip/algorithms", "gossip/compress", "gossip/comm", "topologies", "experiments/low_precision.py"]


def problem(n: int, d: int = 10, per_node: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w_true = torch.randn(d, generator=g)
    A = torch.randn(n * per_node, d, generator=g)
    y = (A @ w_true + 0.5 * torch.randn(n * per_node, generator=g) > 0).float()
    order = torch.argsort(y, stable=True)  # label-sorted shards
    return A[order].view(n, per_node, d), y[order].view(n, per_node)


def loss_grad(A, y, X):
    z = torch.einsum("npd,nd->np", A, X)
    loss = F.binary_cross_entropy_with_logits(z, y, reduction="none").mean(1)
    grad = torch.einsum("np,npd->nd", torch.sigmoid(z) - y, A) / A.shape[1]
    return loss, grad


def _train(name: str, topo, A, y, steps: int, lr: float, on_step=None, **opts) -> torch.Tensor:
    """``steps`` steps of ``name`` from zero; the nodes' models. ``on_step(X, c)`` after
    each step (``c``: the communicator, whose ledger counts the bytes)."""
    n, _, d = A.shape
    c = comm.SimulatedCommunicator(topo)
    alg = algorithms.build(name, c, **opts)
    X = torch.zeros(n, d)
    alg.setup(X)
    for _ in range(steps):
        alg.step(X, -lr * loss_grad(A, y, X)[1])
        if on_step is not None:
            on_step(X, c)
    return X


def _avg_loss(A, y, X) -> float:
    """The loss of the averaged model (inf where it is not finite)."""
    n, d = X.shape
    xbar = X.mean(0, keepdim=True).expand(n, d).contiguous()
    v = float(loss_grad(A, y, xbar)[0].mean())
    return v if math.isfinite(v) else float("inf")


def final_loss(name: str, topo, A, y, steps: int, lr: float, **opts) -> float:
    return _avg_loss(A, y, _train(name, topo, A, y, steps, lr, **opts))


#: every row of the table: (algorithm, bits; 32 is D-PSGD's full precision)
ROWS = [("dpsgd", 32)] + [(name, bits) for bits in (8, 4, 2, 1) for name in ("naive", "dcd", "ecd")]


def witness(nodes: int = 8, lr: float = 0.5, steps: int = 20) -> dict:
    """A short run of every row with the table's code (experiments/witness.py): per row
    and step, the averaged model's loss and the bytes sent so far. Deterministic at one
    thread; seconds."""
    torch.set_num_threads(1)
    topo = topologies.build("ring", nodes)
    A, y = problem(nodes)
    rows = []
    for name, bits in ROWS:
        opts = {} if bits == 32 else {"compressor": f"quant:bits={bits}"}
        trace: list = []
        _train(name, topo, A, y, steps, lr,
               on_step=lambda X, c: trace.append([_avg_loss(A, y, X), int(c.ledger.bytes_sent)]), **opts)
        rows += [{"algo": name, "bits": bits, "step": i + 1, "loss": v, "bytes_sent": b}
                 for i, (v, b) in enumerate(trace)]
    return {"rows": rows}


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run low_precision``."""
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--json", metavar="PATH")


def main(argv=None) -> int:
    p, a = _cli.parse(argv, options, __doc__, "low_precision")
    prov = _provenance.start(SOURCES, argv=None if argv is None else ["experiments/low_precision.py", *argv])
    topo = topologies.build("ring", a.nodes)
    A, y = problem(a.nodes)
    rows = [{"bits": 32, "algo": "dpsgd", "final_loss": final_loss("dpsgd", topo, A, y, a.steps, a.lr)}]
    print(f"| bits | naive | DCD | ECD |\n|---|---|---|---|\n| 32 (D-PSGD) | {rows[0]['final_loss']:.4f} | | |")
    for bits in (8, 4, 2, 1):
        vals = {}
        for name in ("naive", "dcd", "ecd"):
            vals[name] = final_loss(name, topo, A, y, a.steps, a.lr, compressor=f"quant:bits={bits}")
            rows.append({"bits": bits, "algo": name, "final_loss": vals[name]})
        print(f"| {bits} | {vals['naive']:.4f} | {vals['dcd']:.4f} | {vals['ecd']:.4f} |", flush=True)
    if a.json:
        _provenance.write(a.json, rows, prov)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
