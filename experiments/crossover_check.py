#!/usr/bin/env python3
"""Check ``gossip.tools.crossover``'s link model against shaped links of the virtual cluster.

    python -m experiments run crossover_check --nodes 4 --algos dpsgd,ecd:8 \\
        --bandwidth 5mbit,50mbit --steps 30 --out runs/crossover-check

1. ``experiments/sweep_network.py`` runs each algorithm at each bandwidth on the
   virtual cluster (one network namespace per rank, links shaped with tc ``tbf``/
   ``htb``; latency with netem where the kernel has it, else emulated in the
   communicator) and takes the median measured step time.
2. ``python -m gossip.tools.crossover`` measures the same algorithms, model, world size and
   topology on this machine and predicts the step time at the same bandwidths and
   latency.
3. The table puts prediction and measurement side by side with their ratio.

Needs root (network namespaces). The ranks share this machine's cores: keep the
model small enough that compute stays a minor part of a step, or give
``--compute-threads`` thought. Output: ``check.json`` (the rows, the prediction and
the provenance record of ``experiments/_provenance.py``) and ``check.md`` in ``--out``;
with ``--results PATH`` the same JSON at PATH too (``make results-tables`` renders
``experiments/results/crossover_check.json`` into docs/crossover.md).
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

from experiments import _cli
from experiments import tables

HERE = Path(__file__).resolve().parent


def _crossover_label(algo: str) -> str:
    name, _, bits = algo.partition(":")
    return f"{name}@quant:bits={bits}" if bits else name


def compare(measured: list[dict], prediction: dict, labels: dict[str, str]) -> list[dict]:
    """One row per measured cell that succeeded: ``sweep_network.py``'s row (``measured``,
    from its results.csv) beside ``gossip.tools.crossover``'s prediction at the nearest
    bandwidth and latency (``prediction``: its ``--json``; ``labels``: sweep name ->
    crossover label)."""
    rows_pred = {r["label"]: r for r in prediction["rows"]}
    out = []
    for m in measured:
        algo = m["algo"] + (f":{m['bits']}" if m.get("bits") not in (None, "", "None") else "")
        label = labels.get(algo)
        if label is None or m.get("ok") not in ("True", "true", "1"):
            continue
        bw = float(m["bandwidth_mbit"]) * 1e6
        r = rows_pred[label]
        step = min(r["step_s"], key=lambda s: abs(s["bandwidth"] - bw) + abs(s["latency"] * 1e3 - float(m["latency_ms"])))
        meas = float(m["step_s"])
        out.append({"algo": algo, "bandwidth_mbit": bw / 1e6, "latency_ms": float(m["latency_ms"]),
                    "latency_mode": m["latency_mode"], "predicted_s": step["seconds"], "measured_s": meas,
                    "predicted_over_measured": step["seconds"] / meas,
                    "bytes_predicted": r["bytes"], "bytes_measured": float(m["bytes_per_step"]),
                    "iface_bytes_per_step": float(m["iface_bytes_per_step"]) if m.get("iface_bytes_per_step") else None})
    return out


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run crossover_check``."""
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--algos", default="dpsgd,ecd:8", help="sweep_network.py names: name or name:bits")
    p.add_argument("--bandwidth", default="5mbit,50mbit")
    p.add_argument("--latency", default="0.13ms", help="one latency for every cell")
    p.add_argument("--model", default="mlp")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--force", action="store_true", help="re-measure cells already measured")
    p.add_argument("--results", type=Path, default=None,
                   help="also write check.json here (experiments/results/crossover_check.json: docs/crossover.md's table)")


def main(argv: list[str] | None = None) -> int:
    p, args = _cli.parse(argv, options, __doc__, "crossover_check")
    from experiments import _provenance

    prov = _provenance.start(_provenance.training_sources(  # the model's prediction and the sweep's runs
        "gossip/tools/crossover.py", "experiments/crossover_check.py", "experiments/sweep_network.py",
        "experiments/vcluster.py"),
                             argv=None if argv is None else ["experiments/crossover_check.py", *argv])
    args.out.mkdir(parents=True, exist_ok=True)
    sweep = [*_cli.module_command("sweep_network"), "--nodes", str(args.nodes), "--algos", args.algos,
             "--bandwidth", args.bandwidth, "--latency", args.latency, "--steps", str(args.steps),
             "--warmup", str(args.warmup), "--model", args.model, "--data", "synthetic", "--prefix", "gxc",
             "--out", str(args.out / "sweep")] + (["--force"] if args.force else [])
    print("measuring:", " ".join(sweep), flush=True)
    if subprocess.run(sweep, env=_cli.module_env()).returncode != 0:
        print("crossover_check: the sweep failed", file=sys.stderr)
        return 1
    labels = {a: _crossover_label(a) for a in args.algos.split(",")}
    cx = [sys.executable, "-m", "gossip.tools.crossover", "--model", args.model, "--world-size", str(args.nodes),
          "--algos", ",".join(labels.values()), "--bandwidth", args.bandwidth, "--latency", args.latency,
          "--steps", "5", "--json"]
    print("predicting:", " ".join(cx), flush=True)
    pred = subprocess.run(cx, capture_output=True, text=True)
    if pred.returncode != 0:
        print(pred.stderr, file=sys.stderr)
        return 1
    res = json.loads(pred.stdout)
    with open(args.out / "sweep" / "results.csv", newline="") as fh:
        measured = list(csv.DictReader(fh))
    from experiments import sweep_network

    sweep_network.record_cells(args.out / "sweep", measured)  # the sweep's runs, for `experiments verify`
    rows = compare(measured, res, labels)
    text = tables.crossover_check_table(rows)
    print(text)
    (args.out / "check.md").write_text(text + "\n")
    record = {"nodes": args.nodes, "model": args.model, "steps": args.steps, "warmup": args.warmup,
              "prediction": res, "rows": rows, "provenance": prov.finish()}
    for path in [args.out / "check.json"] + ([args.results] if args.results else []):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
