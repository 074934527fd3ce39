"""Run ``gossip.train`` with its communicator wrapped in ``LatencyCommunicator``.

    python experiments/netshape/emulate_latency.py MS [gossip.train flags ...]

A stop-gap for the sweep driver while ``gossip.train`` has no ``--emulate-latency MS``
flag: the driver uses the flag as soon as ``python -m gossip.train --help`` lists it,
and this wrapper only before. It replaces ``gossip.comm.DistCommunicator`` (and
``SimulatedCommunicator``) by factories that wrap what they build, then runs the CLI
unchanged; every output of such a run is marked ``latency_mode: emulated`` by the
driver.
"""

from __future__ import annotations

import math
import os
import sys


def main(argv: list[str]) -> int:
    if not argv:
        print("emulate_latency.py: usage: emulate_latency.py MS [gossip.train flags ...]", file=sys.stderr)
        return 2
    try:
        ms = float(argv[0])
    except ValueError:
        ms = float("nan")
    if not math.isfinite(ms) or ms < 0:
        print(f"emulate_latency.py: bad latency {argv[0]!r}: expected milliseconds >= 0, e.g. 20 or 0.13",
              file=sys.stderr)
        return 2
    # import gossip from the working directory first, as `python -m gossip.train` would
    sys.path.insert(0, os.getcwd())
    from gossip import comm as gcomm
    from gossip.comm.latency import LatencyCommunicator

    for name in ("DistCommunicator", "SimulatedCommunicator"):
        cls = getattr(gcomm, name)

        def factory(*args, _cls=cls, **kwargs):
            return LatencyCommunicator(_cls(*args, **kwargs), ms / 1000.0)

        setattr(gcomm, name, factory)
    from gossip.train import main as train_main

    return train_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
