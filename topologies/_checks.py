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


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux's MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


#: memory per node of a sparse graph's builder beyond its edges, measured with peak RSS:
#: a 2-D torus of 10^6 nodes (2 * 10^6 edges) peaks at 2.1 GiB, a ring at 0.7 GiB (the
#: per-node vectors of the spectral solver, degree and index arrays, temporaries)
BYTES_PER_NODE = 2048


def check_fits(who: str, n: int, edges: int, bytes_per_edge: int = 64, bytes_per_node: int = BYTES_PER_NODE) -> None:
    """Refuse, in one line and before anything is allocated, a graph whose matrices cannot
    fit in memory: ``edges`` undirected edges cost about ``bytes_per_edge`` each (index
    arrays, the CSR adjacency and mixing matrix, both directions, and the builder's
    temporaries) and each node about ``bytes_per_node``. Sparse and dense graphs alike."""
    have = available_memory()
    need = edges * bytes_per_edge + n * bytes_per_node
    if have is not None and need > have:
        # largest n whose cost fits, for a graph of this density (edges ~ c n^2 or c n)
        ratio = (have / need) ** (0.5 if edges > 4 * n else 1.0)
        raise TopologyError(
            f"{who}: n={n:,} has {edges:,} edges, whose matrices need about {need / 2**30:.1f} GiB; "
            f"{have / 2**30:.1f} GiB are available: at most about n={max(2, int(n * ratio)):,} fits"
        )
