"""PowerSGD's Table 3 in shape: an LSTM language model with SGD and with rank-1/2/4 PowerSGD.

    python -m experiments run powersgd_lstm                        # the default corpus
    python -m experiments run powersgd_lstm --data wikitext2 --data-dir DIR   # the paper's corpus, as bytes
    python -m experiments run powersgd_lstm --steps 20 --json /tmp/t3.json    # a quick check

Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization" (arXiv:1905.13727), Table 3, train a 3-layer LSTM on WikiText-2 with 16
workers: test perplexity 91 with full-precision SGD, 102 at rank 1, 93 at rank 2 and 91
at rank 4, while the data sent per epoch drops from 7,730 MB to 25, 38 and 64 MB. Here
the same comparison runs on the scaled-down LSTM (3 layers of 192 units, tied decoder,
byte-level, 0.94M parameters) on 4 simulated nodes: ``allreduce`` (SGD, momentum
0.9) and ``powersgd`` at ranks 1, 2 and 4 (its own momentum 0.9, error feedback, warm
start), with the same step size, batches and number of steps. Each run's held-out bits
per byte and perplexity per byte and its data sent per node per epoch (bytes per step
times the steps of one epoch) go to the results JSON, with two checks of the paper's
shape: rank 1 ends clearly worse than SGD (by more than ``--tolerance`` bits per byte)
and rank 4 within ``--tolerance`` of it.

Not a study spec: its results file holds the paper's figures and those two checks, and
each run's data per epoch, which a ``summary`` study (experiments/studies/lm_recipes.toml)
does not compute.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


from experiments import _provenance
from experiments._lmruns import REPO, run_train
from experiments import _cli

#: the code the figures measure (the results go stale when one changes): each method is a
#: `gossip.train` run, so the training path (experiments/_provenance.py's training_sources:
#: the text data, the LSTM, its loss and metrics, the loop, all-reduce and PowerSGD with
#: their wire format), and the scripts
SOURCES = _provenance.training_sources("experiments/powersgd_lstm.py", "experiments/_lmruns.py")
COMMON = ["--simulate", "4", "--model", "lstm", "--model-opt", "layers=3", "--model-opt", "width=192",
          "--data-opt", "context=64", "--batch-size", "8", "--optimizer", "sgd", "--momentum", "0.9",
          "--epochs", "1", "--seed", "0"]
METHODS = {
    "sgd": ["--algo", "allreduce"],
    "powersgd:1": ["--algo", "powersgd", "--algo-opt", "rank=1"],
    "powersgd:2": ["--algo", "powersgd", "--algo-opt", "rank=2"],
    "powersgd:4": ["--algo", "powersgd", "--algo-opt", "rank=4"],
}


def steps_per_epoch(run_dir: Path) -> float | None:
    """From rank 0's last training record: step / epoch."""
    last = None
    for line in (run_dir / "metrics-rank0.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == "train" and r["epoch"] > 0:
            last = r
    return last["step"] / last["epoch"] if last else None


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run powersgd_lstm``."""
    p.add_argument("--data", default="text", choices=("text", "wikitext2"))
    p.add_argument("--data-dir", default=None)
    p.add_argument("--steps", type=int, default=300, help="steps of every run (default 300)")
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--tolerance", type=float, default=0.05, help="bits per byte (default 0.05)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once, each in its own process (default 1)")
    p.add_argument("--out", default="runs/powersgd-lstm")
    p.add_argument("--json", default=str(REPO / "experiments" / "results" / "powersgd_lstm.json"))


def main(argv: list[str] | None = None) -> int:
    p, a = _cli.parse(argv, options, __doc__, "powersgd_lstm")
    if a.jobs < 1 or a.steps < 1:
        p.error(f"--jobs and --steps must be at least 1, got {a.jobs} and {a.steps}")
    prov = _provenance.start(SOURCES, argv=None if argv is None else ["experiments/powersgd_lstm.py", *argv])
    data = ["--data", a.data] + (["--data-dir", a.data_dir] if a.data_dir else [])
    for name in METHODS:
        print(f"powersgd_lstm: {name} ...", flush=True)
    # each method is a process of its own; --jobs N runs N at once (the figures compared do
    # not depend on it: the same batches, steps and bytes; each run's wall clock does)
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        futures = {name: pool.submit(run_train, [*COMMON, *data, *flags, "--lr", str(a.lr), "--max-steps", str(a.steps)],
                                     Path(a.out) / name.replace(":", "-")) for name, flags in METHODS.items()}
        rows = {name: f.result() for name, f in futures.items()}
    for name, rec in rows.items():
        rec["jobs"] = a.jobs
        if rec["exit"] == 0:
            spe = steps_per_epoch(Path(a.out) / name.replace(":", "-"))
            rec["steps_per_epoch"] = spe
            rec["mb_per_epoch_per_node"] = rec["bytes_sent_per_node_per_step"] * spe / 1e6 if spe else None
            print(f"powersgd_lstm: {name}: {rec['final_test_bpb']:.3f} bits per byte, perplexity per byte "
                  f"{rec['final_test_ppl']:.3f}, {rec['mb_per_epoch_per_node']:,.1f} MB per node per epoch, "
                  f"{rec['wall_s']:.0f} s (load {rec['load_average'][0]:.1f} -> {rec['load_average'][1]:.1f})",
                  flush=True)
        else:
            print(f"powersgd_lstm: {name} failed: {rec['error']}", flush=True)
    ok = all(r["exit"] == 0 for r in rows.values())
    checks = {}
    if ok:
        sgd = rows["sgd"]["final_test_bpb"]
        checks = {
            "tolerance_bpb": a.tolerance,
            "rank1_minus_sgd_bpb": rows["powersgd:1"]["final_test_bpb"] - sgd,
            "rank4_minus_sgd_bpb": rows["powersgd:4"]["final_test_bpb"] - sgd,
        }
        checks["rank1_clearly_worse"] = checks["rank1_minus_sgd_bpb"] > a.tolerance
        checks["rank4_within_tolerance"] = abs(checks["rank4_minus_sgd_bpb"]) <= a.tolerance
        print(f"powersgd_lstm: rank 1 - SGD {checks['rank1_minus_sgd_bpb']:+.3f} bpb "
              f"(clearly worse: {checks['rank1_clearly_worse']}), rank 4 - SGD {checks['rank4_minus_sgd_bpb']:+.3f} "
              f"bpb (within {a.tolerance}: {checks['rank4_within_tolerance']})")
    _provenance.write(a.json, {"paper": {"perplexity": {"sgd": 91, "rank1": 102, "rank2": 93, "rank4": 91},
                                         "mb_per_epoch": {"sgd": 7730, "rank1": 25, "rank2": 38, "rank4": 64}},
                               "runs": rows, "checks": checks}, prov)
    print(f"powersgd_lstm: wrote {a.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
