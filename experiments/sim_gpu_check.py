"""The simulation on a GPU, with the code that runs on the CPU: a check, then figures.

    python -m experiments run sim_gpu_check [--out DIR] [--quick]

1. ``gossip.train --simulate 8 --device cuda`` on both paths (D-PSGD, DCD at 8 bits
   and MuLoCo with its Muon, mlp, 20 steps): each completes, says which path it took,
   and the two end within the tolerance of docs/simulation.md (float32: 1e-4 of max
   |x| for D-PSGD; for DCD, whose stochastic rounding may flip on a 1-ulp difference,
   and MuLoCo, whose Muon runs in bfloat16 on a GPU, the test losses within 1e-2).
2. ``experiments/bench_sim.py --device cuda``: nodes x steps per second of both paths
   (the loop path up to 1024 nodes: one model per kernel launch is what it measures),
   and the share of a 1024-node epoch outside the steps; JSON into ``--out``.

Exits non-zero if CUDA is unavailable or a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from experiments import _cli



def _train(args: list[str]) -> tuple[int, str, str]:
    from gossip import train

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = train.main(args)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return rc, out.getvalue(), err.getvalue()


def check_paths(tmp: Path) -> list[dict]:
    from gossip import checkpoint

    rows = []
    for algo in (["--algo", "dpsgd"], ["--algo", "dcd", "--bits", "8"],
                 ["--algo", "muloco", "--algo-opt", "local_steps=4"]):
        got = {}
        for mode in ("loop", "vectorized"):
            out = tmp / f"{algo[1]}-{mode}"
            t0 = time.perf_counter()
            rc, so, se = _train(["--simulate", "8", "--simulate-mode", mode, "--device", "cuda", *algo, "--model", "mlp",
                                 "--data", "synthetic", "--epochs", "1", "--max-steps", "20", "--no-progress",
                                 "--out", str(out)])
            if rc != 0:
                raise SystemExit(f"sim_gpu_check: {algo[1]} --simulate-mode {mode} on cuda failed: {se.strip()}")
            if f"simulation path: {mode}" not in so:
                raise SystemExit(f"sim_gpu_check: {algo[1]} did not take the {mode} path:\n{so}")
            ck = sorted(out.glob("ckpt-step*-rank0.pt"))[-1]
            got[mode] = (checkpoint.load_checkpoint(ck)["optimizer"]["params"].float().cpu(),
                         json.loads((out / "summary.json").read_text()), time.perf_counter() - t0)
        (xa, sa, ta), (xb, sb, tb) = got["loop"], got["vectorized"]
        diff = float((xa - xb).abs().max()) / float(xa.abs().max())
        loss_diff = abs(sa["final_test_loss"] - sb["final_test_loss"])
        ok = diff <= 1e-4 if algo[1] == "dpsgd" else loss_diff <= 1e-2
        if algo[1] == "muloco":  # Muon in bfloat16 on a GPU: torch's step (loop) against the batched one
            ok = loss_diff <= 1e-2
        rows.append({"algo": algo[1], "max_rel_diff": diff, "test_loss_diff": loss_diff, "ok": ok,
                     "loop_run_s": ta, "vectorized_run_s": tb})
        print(f"{algo[1]}: loop vs vectorized on cuda: max |dx|/max|x| {diff:.2e}, test loss diff {loss_diff:.2e} "
              f"({'ok' if ok else 'FAILED'}); runs {ta:.1f} s and {tb:.1f} s", flush=True)
    return rows


def options(ap: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run sim_gpu_check``."""
    ap.add_argument("--out", default="runs/sim_gpu_check")
    ap.add_argument("--quick", action="store_true", help="the path check and a 256/1024-node logreg/mlp bench only")


def main(argv: list[str] | None = None) -> int:
    ap, a = _cli.parse(argv, options, __doc__, "sim_gpu_check")
    if not torch.cuda.is_available():
        print("sim_gpu_check: no CUDA device", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from experiments import _provenance
    from experiments import bench_sim

    record = _provenance.start(["gossip", "experiments/sim_gpu_check.py"],
                               argv=["experiments/sim_gpu_check.py", *(argv if argv is not None else sys.argv[1:])])
    with tempfile.TemporaryDirectory() as tmp:
        rows = check_paths(Path(tmp))
    _provenance.write(out / "paths.json", rows, record)

    bench = ["--device", "cuda", "--loop-max-nodes", "1024", "--loop-budget", "1", "--json", str(out / "bench_sim_cuda.json")]
    if a.quick:
        bench += ["--nodes", "256,1024", "--models", "logreg,mlp", "--steps", "4"]
    else:
        bench += ["--nodes", "16,256,1024,16384", "--models", "logreg,mlp,cnn1d", "--steps", "5"]
    bench_sim.main(bench)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
