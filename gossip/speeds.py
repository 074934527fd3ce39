"""Node speeds: how long each node's local gradient takes, step by step.

A spec (``--node-speed``) is one of

- ``uniform``: every node at speed 1 (the default);
- ``slow:nodes=K,factor=F``: the first ``K`` nodes (ids 0 .. K-1) take ``F`` times as
  long as the others (``F >= 1``);
- ``lognormal:sigma=S,seed=N``: each node's multiplier drawn once from a log-normal
  distribution of median 1 and log-standard deviation ``S``, from a generator seeded
  with ``N`` (the same multipliers on every rank and in every run);
- ``trace:FILE``: a CSV file of per-node, per-step compute times in seconds, one line
  per step and one column per node (lines starting with ``#`` are comments); a run
  longer than the trace starts it again from its first line.

:class:`NodeSpeeds` turns a spec into compute times: :meth:`NodeSpeeds.times` gives
every node's time of one step, from a base time (a node at speed 1) for the
multiplier specs, from the file for a trace. It is pure (numpy only): the simulation's
clock (:mod:`gossip.clock`) reads it, and under torchrun each rank sleeps for the time
its node takes beyond what it measured.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

__all__ = ["NodeSpeeds", "SpeedError", "KINDS", "parse"]

#: the accepted forms, for the messages
KINDS = "uniform, slow:nodes=K,factor=F, lognormal:sigma=S,seed=N or trace:FILE (CSV, one line per step)"


class SpeedError(ValueError):
    """A bad node-speed spec: one line naming what was wrong and what is accepted."""


def _params(kind: str, body: str, allowed: dict[str, type]) -> dict:
    out: dict = {}
    for part in [p for p in body.split(",") if p.strip()]:
        key, eq, val = part.partition("=")
        key = key.strip()
        if not eq or key not in allowed:
            raise SpeedError(f"--node-speed {kind}: unknown parameter {part.strip()!r}; {kind} takes "
                             f"{', '.join(k + '=' for k in allowed)}")
        try:
            out[key] = allowed[key](val.strip())
        except ValueError:
            raise SpeedError(f"--node-speed {kind}: {key}={val.strip()!r} is not "
                             f"{'an integer' if allowed[key] is int else 'a number'}") from None
    missing = [k for k in allowed if k not in out]
    if missing:
        raise SpeedError(f"--node-speed {kind}: missing {', '.join(k + '=' for k in missing)} "
                         f"(e.g. {'slow:nodes=1,factor=4' if kind == 'slow' else 'lognormal:sigma=0.5,seed=0'})")
    return out


class NodeSpeeds:
    """Compute times of ``n`` nodes under a speed spec (see the module's docstring).

    ``multipliers`` (n,) for the multiplier specs, ``trace`` (steps, n) seconds for a
    trace; :meth:`times` reads either."""

    def __init__(self, spec: str, n: int, *, multipliers: np.ndarray | None = None,
                 trace: np.ndarray | None = None) -> None:
        self.spec, self.n = spec, int(n)
        self.multipliers = multipliers
        self.trace = trace

    @property
    def uniform(self) -> bool:
        """Every node equally fast at every step: nothing to model or to sleep."""
        return self.trace is None and bool(np.all(self.multipliers == 1.0))

    @property
    def needs_base(self) -> bool:
        """Whether :meth:`times` needs a base compute time (a trace has its own seconds)."""
        return self.trace is None

    def times(self, step: int, base: float = 1.0) -> np.ndarray:
        """Seconds each node's local gradient takes at ``step`` (0-based), shape (n,):
        ``base`` times its multiplier, or the trace's line ``step mod len(trace)``."""
        if self.trace is not None:
            return self.trace[step % len(self.trace)]
        return base * self.multipliers

    def describe(self) -> str:
        """One line for logs: the spec and the range of its multipliers (or the trace's size)."""
        if self.trace is not None:
            return f"{self.spec} ({len(self.trace)} steps of {self.n} nodes)"
        m = self.multipliers
        return f"{self.spec} (multipliers {m.min():.3g} to {m.max():.3g})"


def parse(spec: str, n: int | None) -> NodeSpeeds:
    """The :class:`NodeSpeeds` of ``spec`` on ``n`` nodes; :class:`SpeedError` (one line)
    for a bad spec. ``n=None`` checks the spec alone (one node is built; the rules that
    need the run's node count are left to the run's own call)."""
    if not isinstance(spec, str) or not spec.strip():
        raise SpeedError(f"--node-speed: expected {KINDS}, got {spec!r}")
    spec = spec.strip()
    check_n, n = n is not None, 1 if n is None else n
    kind, _, body = spec.partition(":")
    if kind == "uniform" and not body:
        return NodeSpeeds(spec, n, multipliers=np.ones(n))
    if kind == "slow":
        p = _params("slow", body, {"nodes": int, "factor": float})
        k, f = p["nodes"], p["factor"]
        if k < 1 or (check_n and k > n):
            raise SpeedError(f"--node-speed slow: nodes={k} must be between 1 and the {n} nodes of the run")
        if not math.isfinite(f) or f < 1:
            raise SpeedError(f"--node-speed slow: factor={f:g} must be a finite number >= 1 (how many times slower)")
        m = np.ones(n)
        m[:min(k, n)] = f
        return NodeSpeeds(spec, n, multipliers=m)
    if kind == "lognormal":
        p = _params("lognormal", body, {"sigma": float, "seed": int})
        s, seed = p["sigma"], p["seed"]
        if not math.isfinite(s) or s < 0 or s > 5:
            raise SpeedError(f"--node-speed lognormal: sigma={s:g} must be between 0 and 5")
        if seed < 0:
            raise SpeedError(f"--node-speed lognormal: seed={seed} must be >= 0")
        return NodeSpeeds(spec, n, multipliers=np.random.default_rng(seed).lognormal(0.0, s, n))
    if kind == "trace":
        return NodeSpeeds(spec, n, trace=_read_trace(body, n if check_n else None))
    raise SpeedError(f"--node-speed {spec!r}: expected {KINDS}")


def _read_trace(path: str, n: int | None) -> np.ndarray:
    if not path:
        raise SpeedError("--node-speed trace: give the file, trace:FILE (CSV: one line per step, one column per node)")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpeedError(f"--node-speed trace:{path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    rows = []
    for no, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            row = [float(v) for v in line.split(",")]
        except ValueError:
            raise SpeedError(f"--node-speed trace:{path}: line {no} is not comma-separated numbers: {line[:60]!r}") from None
        if n is not None and len(row) != n:
            raise SpeedError(f"--node-speed trace:{path}: line {no} has {len(row)} values; the run has {n} nodes")
        if not all(math.isfinite(v) and v >= 0 for v in row):
            raise SpeedError(f"--node-speed trace:{path}: line {no}: times must be finite seconds >= 0")
        rows.append(row)
    if len({len(r) for r in rows}) > 1:
        raise SpeedError(f"--node-speed trace:{path}: its lines have different numbers of values")
    if not rows:
        raise SpeedError(f"--node-speed trace:{path}: no lines of times in it")
    return np.asarray(rows, dtype=np.float64)
