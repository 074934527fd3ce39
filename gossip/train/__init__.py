"""``gossip.train``: the training application and its CLI.

    torchrun --nproc_per_node 8 -m gossip.train --algo ecd --bits 8 --topology ring
    python -m gossip.train --simulate 8 --algo dcd --bits 4 --topology torus

Thin by design: parse and validate the config, build the parts from their registries,
run the loop in :mod:`gossip.train.loop`, and always tear the process group down. User errors
print one line ``gossip.train: error: ...`` and exit 2 on every rank; under torchrun
each rank's line starts with ``[rank K]``, and a rank stopped by a failure writes the
full detail to ``error-rank<K>.log`` in the run directory.

The application's parts, each a module of this package: :mod:`~gossip.train.config`
(the flags, TOML sections, help and fingerprint), :mod:`~gossip.train.assembly` (the
parts built from the config), :mod:`~gossip.train.agreement` (what the ranks agree on
before anything is written), :mod:`~gossip.train.loop` (:class:`~gossip.train.loop.Run`),
:mod:`~gossip.train.checkpoint` (the checkpoint manager; the file format is the
library's :mod:`gossip.checkpoint`), :mod:`~gossip.train.metrics` (the records),
:mod:`~gossip.train.evaluation`, :mod:`~gossip.train.stopping` (a SIGTERM stops the
run) and :mod:`~gossip.train.fault_tolerance` (``FaultTolerantRun(Run)``). Importing
this package is cheap: they load when used.
"""

from __future__ import annotations

import os
import signal
import sys

from gossip.train import stopping
from gossip.train.stopping import Terminated  # noqa: F401 (where callers have found it)

__all__ = ["main", "run"]


#: what a rank says on SIGTERM: torchrun sends it when another rank failed (that rank's
#: own line says why) and when torchrun itself or the job was stopped; which, a rank cannot tell
STOPPED = ("stopped by SIGTERM (from torchrun when another rank failed, whose own line then says why, "
           "or when torchrun or the job was stopped); the checkpoints written are intact")


def _say(line: str) -> None:
    """One line to stderr in one write: under torchrun the ranks share the stream."""
    from gossip.errors import say_line

    say_line(line)


def run(cfg):
    """Train as configured: under ``--fault-tolerance`` one torchft replica per process
    (:func:`gossip.train.fault_tolerance.run_fault_tolerant`), else :func:`gossip.train.loop.run`.
    Returns the summary on rank 0 (None elsewhere)."""
    if cfg.comm.fault_tolerance is not None:
        from gossip.train.fault_tolerance import run_fault_tolerant

        return run_fault_tolerant(cfg)
    from gossip.train.loop import run as run_loop

    return run_loop(cfg)


def main(argv: list[str] | None = None) -> int:
    """``python -m gossip.train``: parse the flags, run, and return the exit code.

    2: bad input; the run's own code when it fails; 130: interrupted; 143: stopped by
    SIGTERM."""
    from gossip.train.config import ConfigError, parse_args
    from gossip.errors import one_line
    from gossip.errors import RunError

    rank = int(os.environ.get("RANK", "0"))
    # under torchrun every rank may print its line at once: say whose each one is
    who = f"[rank {rank}] " if "RANK" in os.environ and "WORLD_SIZE" in os.environ else ""
    stopping.reset()
    previous = signal.signal(signal.SIGTERM, stopping.on_sigterm)
    try:
        cfg = parse_args(argv)
        run(cfg)
    except ConfigError as e:
        _say(f"{who}gossip.train: error: {one_line(e)}")
        return 2
    except RunError as e:
        if e.exit_code == 0:  # nothing went wrong (a finished run resumed): rank 0 says so
            if rank == 0:
                _say(f"{who}gossip.train: {one_line(e)}")
            return 0
        _say(f"{who}gossip.train: error: {one_line(e)}")
        return e.exit_code
    except KeyboardInterrupt:
        if rank == 0:
            _say(f"{who}gossip.train: interrupted")
        return 130
    except Terminated:
        _say(f"{who}gossip.train: {STOPPED}")
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
        # on every path: no native thread of the process group outlives main(). Only
        # gossip.comm.distributed makes one, so there is none unless it has loaded; and not
        # imported here: a SIGTERM that interrupted torch's first import leaves torch unimportable
        shutdown = getattr(sys.modules.get("gossip.comm.distributed"), "shutdown", None)
        if shutdown is not None:
            shutdown()
    return 0
