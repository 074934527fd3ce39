"""Timing helper shared by the single-process benchmark scripts."""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["min_interleaved"]


def min_interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """The minimum wall time in seconds of each callable over ``repeats`` rounds.

    Each round calls every candidate once, in turn, so that a slow spell of the machine
    (another process, a frequency change) touches all of them alike rather than one.
    """
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best
