"""``python -m topologies``: build a topology by name and report its spectral figures.

    python -m topologies NAME N [--degree D] [--rows R --cols C]
                         [--weights uniform|metropolis] [--lazy] [--seed S] [--json]
    python -m topologies --list

Bad input prints one line ``topologies: error: ...`` and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import NoReturn, Sequence

from . import registry
from .errors import TopologyError
from .topology import Topology

PROG = "topologies"
EPS = 1e-3


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage block
        _fail(message)


def _fail(message: str) -> NoReturn:
    print(f"{PROG}: error: {' '.join(str(message).split())}", file=sys.stderr)
    sys.exit(2)


def _count(label: str):
    """argparse type: a non-negative integer written in digits."""

    def parse(text: str) -> int:
        if not text.strip().isdigit():
            raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
        return int(text)

    parse.__name__ = label  # argparse names the type in some messages
    return parse


def _parser() -> _Parser:
    p = _Parser(
        prog=PROG,
        description="Build a gossip topology and report its degree and spectral figures.",
        epilog="Example: topologies expander 64 --degree 4 --seed 0",
    )
    p.add_argument("name", nargs="?", metavar="NAME", help="topology name (see --list)")
    p.add_argument("n", nargs="?", metavar="N", type=_count("N"), help="number of nodes")
    p.add_argument("--list", action="store_true", help="list the topologies and exit")
    p.add_argument("--degree", type=_count("--degree"), help="degree of the expander")
    p.add_argument("--rows", type=_count("--rows"), help="torus rows (>= 3)")
    p.add_argument("--cols", type=_count("--cols"), help="torus columns (>= 3)")
    p.add_argument(
        "--weights",
        choices=["uniform", "metropolis"],
        help="weight rule (default: uniform on regular graphs, metropolis otherwise)",
    )
    p.add_argument("--lazy", action="store_true", help="use (I + W)/2")
    p.add_argument("--seed", type=_count("--seed"), help="seed of random topologies")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _list() -> str:
    names = registry.available()
    width = max(map(len, names))
    return "\n".join(f"{name:<{width}}  {summary}" for name, summary in names.items())


def _steps_text(topo: Topology) -> str:
    steps = topo.consensus_steps(EPS)
    if steps is None:
        return "never (rho = 1: W does not mix; try --lazy)"
    if topo.rho == 0.0:
        return "1  (rho = 0: one step reaches the exact average)"
    return f"{steps}  (ceil(log(1e-3) / log(rho)))"


def _report_time_varying(topo) -> str:
    f = topo.summary()
    params = ", ".join(f"{k}={v}" for k, v in topo.params.items())
    steps = f["steps_to_1e-3"]
    rows = [
        ("topology", f"{topo.name} ({params}), time-varying{', directed' if f['directed'] else ''}"),
        ("n", str(topo.n)),
        ("degree", f"{f['degree_per_step']} per step"),
        ("period", "none (random)" if f["period"] is None else f"{f['period']} steps"),
        ("rho", f"{f['rho']:.12g}  ({f['gap_of']})"),
        ("spectral gap", f"{f['spectral_gap']:.12g}"),
        ("exact average", "yes, after one period" if f["exact_average"] else "no"),
        ("steps to 1e-3", "never" if steps is None else str(steps)),
    ]
    return "\n".join(f"{label:<14} {value}" for label, value in rows)


def _report(topo: Topology) -> str:
    if topo.time_varying:
        return _report_time_varying(topo)
    s = topo.spectrum()
    deg = topo.degrees
    degree = str(int(deg[0])) if topo.is_regular else f"min {int(deg.min())}, max {int(deg.max())}"
    params = ", ".join(f"{k}={v}" for k, v in topo.params.items())
    if s.method == "dense":
        method = "dense (scipy.linalg.eigvalsh)"
    else:
        method = f"sparse (lambda_2 by {s.routes[0]}, lambda_n by {s.routes[1]})"
    rows = [
        ("topology", f"{topo.name} ({params})"),
        ("n", str(topo.n)),
        ("degree", degree),
        ("lambda_2", f"{s.lambda2:.12g}"),
        ("lambda_n", f"{s.lambdan:.12g}"),
        ("rho", f"{s.rho:.12g}"),
        ("spectral gap", f"{s.spectral_gap:.12g}"),
        ("steps to 1e-3", _steps_text(topo)),
        ("spectrum", method),
    ]
    return "\n".join(f"{label:<14} {value}" for label, value in rows)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list:
        if args.name is not None:
            _fail("--list takes no NAME or N")
        print(_list())
        return 0
    if args.name is None or args.n is None:
        _fail(f"give a topology NAME and a node count N (e.g. '{PROG} ring 8'), or --list")
    params = {k: getattr(args, k) for k in ("degree", "rows", "cols") if getattr(args, k) is not None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            topo = registry.build(
                args.name, args.n, weights=args.weights, lazy=args.lazy, seed=args.seed, **params
            )
            if args.seed is not None and "seed" not in topo.params:
                warnings.warn(f"--seed has no effect on {topo.name}, which is not random")
            out = json.dumps(topo.summary()) if args.json else _report(topo)
        except TopologyError as e:
            _fail(str(e))
    for w in caught:
        print(f"{PROG}: warning: {' '.join(str(w.message).split())}", file=sys.stderr)
    try:  # flushed here, so that a closed pipe or a full disk is one line, not a traceback
        sys.stdout.write(out + "\n")
        sys.stdout.flush()
    except OSError as e:
        try:  # the interpreter's own flush at exit must not print a second error
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass
        print(f"{PROG}: error: cannot write to standard output ({e.strerror or e})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
