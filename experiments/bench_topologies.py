#!/usr/bin/env python3
"""How long ``python -m topologies`` takes on a large graph: a ring and an expander.

    python -m experiments run bench_topologies --results experiments/results/bench_topologies.json
    python -m experiments run bench_topologies --n 1000 --repeats 1          # a quick look

1. For each graph (a ring, and a random 4-regular expander with seed 0, of ``--n``
   nodes) and for ``python -m topologies --list`` (start-up and imports only, the
   reference), run the command line ``--repeats`` times, the three interleaved so a
   change of the machine's load hits each alike: wall time, and the user CPU time of
   the child process (``resource.getrusage(RUSAGE_CHILDREN)``).
2. Then, in this process, split each graph's cost between building it (the topology
   object, its matrix validated) and its spectrum (``rho``, which computes lambda_2
   and lambda_n), ``--repeats`` times each on a freshly built object.
3. Write every figure, the spectral values each run printed (so a run that computed
   something else shows), and the provenance record of ``experiments/_provenance.py``
   to ``--results`` (docs/topologies.md renders its table from
   ``experiments/results/bench_topologies.json``), and print the table.

The figures are this machine's: run it with nothing else running (load < 0.3).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from experiments import _provenance  # noqa: E402
from experiments import tables
from experiments import _cli

__all__ = ["CASES", "main", "measure"]

#: the code the figures measure
SOURCES = ["topologies", "experiments/bench_topologies.py"]

#: label -> (the CLI's arguments after the node count, the builder's keyword arguments)
CASES: dict[str, tuple[list[str], dict]] = {
    "ring": ([], {}),
    "expander, degree 4": (["--degree", "4", "--seed", "0"], {"degree": 4, "seed": 0}),
}


def _topologies_cli(args: list[str]) -> tuple[float, float, dict | None]:
    """Wall and child user CPU seconds of ``python -m topologies ARGS``, and its JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "topologies", *args], capture_output=True, text=True, env=env,
                         cwd=REPO)
    wall = time.perf_counter() - t0
    user = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - before
    if out.returncode != 0:
        raise SystemExit(f"bench_topologies: python -m topologies {' '.join(args)} failed (exit {out.returncode}): "
                         f"{out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ''}")
    return wall, user, (json.loads(out.stdout) if "--json" in args else None)


def measure(n: int, repeats: int) -> dict:
    """Steps 1 and 2 (see the module docstring) for ``n`` nodes."""
    import topologies as T

    cmds = {"start-up (--list)": ["--list"]}
    cmds.update({label: [("ring" if label == "ring" else "expander"), str(n), *extra, "--json"]
                 for label, (extra, _) in CASES.items()})
    cli: dict[str, dict] = {k: {"command": "python -m topologies " + " ".join(v), "wall_s": [], "user_s": []}
                            for k, v in cmds.items()}
    for _ in range(repeats):
        for label, args in cmds.items():
            wall, user, js = _topologies_cli(args)
            cli[label]["wall_s"].append(wall)
            cli[label]["user_s"].append(user)
            if js is not None:
                cli[label]["printed"] = {k: js.get(k) for k in ("n", "lambda2", "lambdan", "rho", "spectral_gap")}
    split: dict[str, dict] = {}
    for label, (_, kw) in CASES.items():
        make = (lambda: T.ring(n)) if label == "ring" else (lambda kw=kw: T.expander(n, **kw))
        build, spectrum = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            topo = make()
            t1 = time.perf_counter()
            topo.rho
            build.append(t1 - t0)
            spectrum.append(time.perf_counter() - t1)
        split[label] = {"build_s": build, "spectrum_s": spectrum}
    return {"n": n, "repeats": repeats, "cli": cli, "split": split}


def options(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m experiments run bench_topologies``."""
    p.add_argument("--n", type=int, default=100_000, help="nodes of each graph (default 100000)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each command (default 3)")
    p.add_argument("--results", type=Path, default=None, help="results JSON (experiments/results/...)")


def main(argv: list[str] | None = None) -> int:
    p, a = _cli.parse(argv, options, __doc__, "bench_topologies")
    if a.n < 5 or a.repeats < 1:
        p.error(f"need --n >= 5 (a 4-regular expander) and --repeats >= 1, got --n {a.n} --repeats {a.repeats}")
    prov = _provenance.start(SOURCES, argv=None if argv is None else ["experiments/bench_topologies.py", *argv])
    res = measure(a.n, a.repeats)
    if not prov.quiet and prov.load_before:
        print(f"bench_topologies: load average {prov.load_before[0]:.2f} at the start: these timings are not "
              f"this machine's own (quiet below {_provenance.QUIET_LOAD})", file=sys.stderr)
    if a.results:
        _provenance.write(a.results, res, prov)
    print(tables.bench_topologies_table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
