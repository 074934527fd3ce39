#!/usr/bin/env python3
"""Bytes per node per step of the sharded two-way compressed exchange, from the ledger.

    python -m experiments run sharded_bytes --results experiments/results/sharded_bytes.json

For each case in ``CASES`` (an algorithm, its options and the compressor spec that
sets its payload) and each node count in ``--nodes``:

1. build the algorithm on an in-process ``SimulatedCommunicator`` of n nodes over
   the layout of ``--model`` (cnn1d: 124,810 values in 10 tensors), default exchange
   (sharded);
2. run one step on seeded random gradients (diloco: one round of H = 10 steps),
   eager compression kernels (the bytes do not depend on the backend);
3. read from the ledger the bytes the two legs sent (``shard_push`` and
   ``shard_pull``), per node per step, and set them against ``2 (n - 1) / n`` x the
   payload of the whole vector (``/ H`` for diloco), what an fp32 ring all-reduce
   moves relative to its own payload.

The all-gather column is computed, not measured: an all-gather sends ``(n - 1)`` x
the payload per node, ``n / 2`` times the sharded bound. Bytes do not depend on the
machine or its load. docs/centralized.md renders its table from the results file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from experiments import _provenance  # noqa: E402
from experiments import tables
from experiments import _cli

__all__ = ["CASES", "main", "measure", "witness"]

SOURCES = ["gossip/algorithms", "gossip/comm", "gossip/compress", "gossip/models.py", "experiments/sharded_bytes.py"]

#: (label, algorithm, its options, the compressor spec whose payload is the unit)
CASES = [("efsgd `quant:bits=8`", "efsgd", {"compressor": "quant:bits=8"}, "quant:bits=8"),
         ("efsgd `sign`", "efsgd", {"compressor": "sign"}, "sign"),
         ("signum", "signum", {}, "sign"),
         ("efblocksgd (a sign block per tensor)", "efblocksgd", {}, "blocksign"),
         ("diloco `quant:bits=4`, H = 10", "diloco", {"compressor": "quant:bits=4", "local_steps": 10}, "quant:bits=4")]


def measure(nodes: list[int], model: str = "cnn1d") -> dict:
    """Steps 1 to 3 for every case and node count."""
    import torch

    from gossip import algorithms, comm, models
    from gossip import compress as gc

    net = models.build_model(model, input_shape=(1, 40), num_classes=10, seed=0)
    layout = algorithms.ParamLayout(tuple(tuple(p.shape) for p in net.parameters()))
    d = layout.dim
    old = gc.set_backend("eager")
    rows = []
    try:
        for label, name, opts, spec in CASES:
            h = opts.get("local_steps", 1) if name == "diloco" else 1
            payload = gc.build(spec, **({"offsets": layout.block_starts} if spec == "blocksign" else {})).payload_nbytes(d)
            row = {"case": label, "algo": name, "options": opts, "spec": spec, "payload_bytes": payload, "steps": h,
                   "per_n": {}}
            for n in nodes:
                g = torch.Generator().manual_seed(0)
                c = comm.SimulatedCommunicator(world_size=n)
                alg = algorithms.build(name, c, **opts)
                X = torch.zeros(n, d)
                alg.setup(X, layout)
                G = torch.randn(n, d, generator=g)
                for _ in range(h):
                    if name == "diloco":
                        X += -0.01 * G
                        alg.step(X, -0.01 * G)
                    else:
                        alg.set_lr(0.1)
                        alg.reduce_gradients(G)
                    c.ledger.step()
                ops = c.ledger.as_dict()["ops"]
                sent = ops.get("shard_push", {}).get("sent", 0) + ops.get("shard_pull", {}).get("sent", 0)
                per = sent / n / h
                bound = 2 * (n - 1) / n * payload / h
                row["per_n"][str(n)] = {"bytes_per_node_per_step": per, "vs_two_ring_legs": per / bound,
                                        "allgather_over_sharded_bound": n / 2}
                del alg, c, X
            rows.append(row)
    finally:
        gc.set_backend(old)
    return {"model": model, "params": d, "nodes": nodes, "rows": rows}


def witness(nodes: list[int] = (4, 16, 64), model: str = "cnn1d") -> dict:
    """The figures' own measurement (:func:`measure`, one step per case and node count,
    seconds) as a witness (experiments/witness.py): per case and node count, the payload
    and the bytes per node per step. Deterministic at one thread."""
    import torch

    torch.set_num_threads(1)
    res = measure(list(nodes), model)
    return {"rows": [{"case": r["case"], "nodes": int(n), "payload_bytes": r["payload_bytes"],
                      "bytes_per_node_per_step": v["bytes_per_node_per_step"]}
                     for r in res["rows"] for n, v in r["per_n"].items()]}


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run sharded_bytes``."""
    p.add_argument("--nodes", default="4,16,64", help="node counts, a comma list (default 4,16,64)")
    p.add_argument("--model", default="cnn1d", help="the model whose layout is exchanged (default cnn1d)")
    p.add_argument("--results", type=Path, default=None, help="results JSON (experiments/results/sharded_bytes.json)")


def main(argv: list[str] | None = None) -> int:
    p, a = _cli.parse(argv, options, __doc__, "sharded_bytes")
    try:
        nodes = [int(v) for v in a.nodes.split(",") if v.strip()]
    except ValueError:
        p.error(f"--nodes must be a comma list of integers >= 2, got {a.nodes!r}")
    if not nodes or min(nodes) < 2:
        p.error(f"--nodes must be a comma list of integers >= 2, got {a.nodes!r}")
    prov = _provenance.start(SOURCES, argv=None if argv is None else ["experiments/sharded_bytes.py", *argv])
    res = measure(nodes, a.model)
    if a.results:
        _provenance.write(a.results, res, prov)
    print(tables.sharded_bytes_table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
