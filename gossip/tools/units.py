"""Units of the links: rates as tc reads them, latencies, and their display.

One reader for every rate and latency of the project (the crossover tool, the
benchmark's specs, the leaderboard, the netns cluster), so ``100mbps`` means the same
everywhere: what tc(8) means by it.
"""

from __future__ import annotations

import math
import re

__all__ = ["UnitError", "TC_RATE_UNITS", "RATE_UNITS_TEXT", "tc_rate", "parse_rate", "parse_time", "fmt_rate"]


class UnitError(ValueError):
    """A rate or a latency that cannot be read: one line naming it and what is accepted."""


#: the rate units of tc (tc(8), "RATES"), read as tc reads them, whatever the case: the
#: ``bit`` units are bits per second, the ``bps`` units BYTES per second (10mbps is 80
#: Mbit/s); the SI prefixes are powers of 1000, the IEC ones (ki, mi, gi, ti) of 1024. A
#: bare number is bits per second, as in tc. Every rate of the project is read here.
TC_RATE_UNITS: dict[str, float] = {
    "": 1.0,
    **{p + "bit": 1000.0 ** i for i, p in enumerate(("", "k", "m", "g", "t"))},
    **{p + "bit": 1024.0 ** i for i, p in enumerate(("ki", "mi", "gi", "ti"), 1)},
    **{p + "bps": 8 * 1000.0 ** i for i, p in enumerate(("", "k", "m", "g", "t"))},
    **{p + "bps": 8 * 1024.0 ** i for i, p in enumerate(("ki", "mi", "gi", "ti"), 1)},
}
RATE_UNITS_TEXT = ("tc's units: bit, kbit, mbit, gbit, tbit (bits per second), bps, kbps, mbps, gbps, tbps (BYTES "
                   "per second, as tc reads them), the IEC kibit, kibps and alike, or a bare number of bits per second")
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-z]*)\s*$", re.I)
_TIME = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*(us|ms|s)?\s*$", re.I)
#: what ``100M``, ``100MB`` or ``100mb`` may mean: a prefix without saying bits or bytes
_BITS_OR_BYTES = {p + b for p in ("", "k", "m", "g", "t", "ki", "mi", "gi", "ti") for b in ("", "b")} - {""}


def tc_rate(text: str) -> float:
    """``"100mbit"`` -> 1e8 bits per second, ``"100mbps"`` -> 8e8, in the units of
    :data:`TC_RATE_UNITS`; UnitError saying what is accepted otherwise. A unit that
    does not say bits or bytes (``100M``, ``100MB``, ``100mb``) is refused, not guessed."""
    m = _RATE.match(str(text))
    if m is None or not math.isfinite(float(m.group(1))) or float(m.group(1)) <= 0:
        raise UnitError(f"expected a positive rate such as 10mbit or 1gbit, in {RATE_UNITS_TEXT}")
    num, unit = m.group(1), m.group(2).lower()
    if unit in _BITS_OR_BYTES:
        p = unit.rstrip("b")
        raise UnitError(f"{m.group(2)!r} does not say bits or bytes: write {num}{p}bit for bits or {num}{p}bps "
                         f"for bytes per second (expected a positive rate in {RATE_UNITS_TEXT})")
    if unit not in TC_RATE_UNITS:
        raise UnitError(f"{m.group(2)!r} is not a unit tc reads (expected a positive rate in {RATE_UNITS_TEXT})")
    return float(num) * TC_RATE_UNITS[unit]


def parse_rate(text: str) -> float:
    """``"100mbit"`` -> 1e8 bits per second (:func:`tc_rate`); UnitError naming the
    bandwidth otherwise."""
    try:
        return tc_rate(text)
    except UnitError as e:
        raise UnitError(f"bandwidth {text!r}: {e}") from None


def parse_time(text: str) -> float:
    """``"5ms"`` -> 0.005 seconds (us, ms, s; a bare number is seconds)."""
    m = _TIME.match(str(text))
    if not m:
        raise UnitError(f"latency {text!r}: expected a time such as 0, 500us, 5ms or 0.05s")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[(m.group(2) or "s").lower()]


def fmt_rate(bps: float) -> str:
    """A rate in bits per second as people write it: ``1e8`` -> ``"100 Mbit/s"``."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} bit/s"
