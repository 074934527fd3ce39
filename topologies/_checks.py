"""Validation of builder arguments: real exceptions with one-line messages, never assert."""

from __future__ import annotations

import numbers

from .errors import TopologyError

WEIGHT_RULES = ("uniform", "metropolis")


def check_int(who: str, name: str, value: object, minimum: int) -> int:
    """``value`` as an ``int`` if it is an integer >= ``minimum``; ``TopologyError`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TopologyError(
            f"{who}: {name} must be an integer >= {minimum}, got {name}={value!r}"
        )
    value = int(value)
    if value < minimum:
        raise TopologyError(f"{who}: {name} must be >= {minimum}, got {name}={value}")
    return value


def check_seed(who: str, seed: object) -> int | None:
    """``None`` or a non-negative integer seed."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or int(seed) < 0:
        raise TopologyError(
            f"{who}: seed must be a non-negative integer or None, got seed={seed!r}"
        )
    return int(seed)


def check_weights(who: str, weights: object) -> str | None:
    """``None`` (the default rule) or one of ``WEIGHT_RULES``."""
    if weights is None or weights in WEIGHT_RULES:
        return weights  # type: ignore[return-value]
    accepted = " or ".join(repr(w) for w in WEIGHT_RULES)
    raise TopologyError(
        f"{who}: weights must be {accepted} (or None for the default), got weights={weights!r}"
    )


def check_bool(who: str, name: str, value: object) -> bool:
    """A real boolean (``numpy.bool_`` included); strings such as "false" are refused."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise TopologyError(f"{who}: {name} must be True or False, got {name}={value!r}")
