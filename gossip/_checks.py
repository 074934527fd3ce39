"""The argument checks every part shares: one line naming the argument, the rule and
the value. ``label`` is how the argument is named in the message (``Arg `rank```,
``--batch-size``, ``seed``)."""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["check_int", "check_float"]


def check_int(label: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
              error: type[Exception] = ValueError) -> int:
    """``value`` as an int: an integer (not a bool) within ``[minimum, maximum]``.
    A non-integer raises ``TypeError``, an integer out of range ``error``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{label} must be an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise error(f"{label} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise error(f"{label} must be <= {maximum}, got {value}")
    return value


def check_float(label: str, value: Any, *, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False, hi_open: bool = False, error: type[Exception] = ValueError) -> float:
    """``value`` as a float: a finite real number (not a bool) in the interval given by
    ``lo``/``hi`` (open ends with ``lo_open``/``hi_open``). A non-number raises
    ``TypeError``; anything else outside the rule ``error``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{label} must be a number, got {type(value).__name__} {value!r}")
    v = float(value)
    below = lo is not None and (v <= lo if lo_open else v < lo)
    above = hi is not None and (v >= hi if hi_open else v > hi)
    if not math.isfinite(v) or below or above:
        left = "" if lo is None else f"{lo:g} {'<' if lo_open else '<='} "
        right = "" if hi is None else f" {'<' if hi_open else '<='} {hi:g}"
        rule = f"{left}x{right}" if (left or right) else "finite"
        raise error(f"{label} must satisfy {rule}, got {value!r}")
    return v
