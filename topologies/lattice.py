"""Lattices: the 2-D torus and the hypercube."""

from __future__ import annotations

import math

import numpy as np

from ._checks import check_fits, check_int
from ._graph import adjacency, finish
from .errors import TopologyError
from .topology import Topology

__all__ = ["torus", "hypercube", "torus_shape"]

_MIN_SIDE = 3


def _has_torus_shape(n: int) -> bool:
    return any(n % r == 0 and n // r >= _MIN_SIDE for r in range(_MIN_SIDE, math.isqrt(n) + 1))


def torus_shape(n: int) -> tuple[int, int]:
    """The most square ``rows x cols = n`` with ``3 <= rows <= cols``.

    ``TopologyError`` (naming the nearest sizes that work) if there is none, as for
    primes, twice a prime, and ``n < 9``.
    """
    n = check_int("torus", "n", n, 9)
    for rows in range(math.isqrt(n), _MIN_SIDE - 1, -1):
        if n % rows == 0 and n // rows >= _MIN_SIDE:
            return rows, n // rows
    below = [m for m in range(n - 1, 8, -1) if _has_torus_shape(m)][:2]
    above = [m for m in range(max(n + 1, 9), n + 64) if _has_torus_shape(m)][:2]
    nearby = ", ".join(str(m) for m in sorted(below + above))
    raise TopologyError(
        f"torus: n={n} has no factorisation rows x cols with both sides >= {_MIN_SIDE}; "
        f"use an n such as {nearby}, or give rows and cols"
    )


def torus(
    n: int,
    *,
    rows: int | None = None,
    cols: int | None = None,
    weights: str | None = None,
    lazy: bool = False,
) -> Topology:
    """2-D periodic grid of ``rows x cols = n`` nodes, both sides ``>= 3``.

    Node ``r * cols + c`` is linked to its four neighbours ``(r +- 1, c)`` and
    ``(r, c +- 1)``, wrapping around. Without ``rows`` and ``cols`` the most square
    shape is used (``n = 16`` gives 4 x 4); with one of them the other is ``n`` divided
    by it. 4-regular, so uniform weights (1/5) by default; an ``m x m`` torus then has
    ``lambda_2 = (3 + 2 cos(2 pi/m))/5``.
    """
    n = check_int("torus", "n", n, 9)
    check_fits("torus", n, 2 * n)
    if rows is None and cols is None:
        rows, cols = torus_shape(n)
    else:
        if rows is not None:
            rows = check_int("torus", "rows", rows, 1)
        if cols is not None:
            cols = check_int("torus", "cols", cols, 1)
        if rows is None or cols is None:
            side = rows if rows is not None else cols
            if n % side:
                given = "rows" if rows is not None else "cols"
                raise TopologyError(
                    f"torus: {given}={side} does not divide n={n}; give a divisor of n, "
                    f"or both rows and cols with rows * cols = n"
                )
            rows, cols = (side, n // side) if rows is not None else (n // side, side)
        if rows < _MIN_SIDE or cols < _MIN_SIDE:
            raise TopologyError(
                f"torus: rows and cols must both be >= {_MIN_SIDE} (a side of 1 or 2 would "
                f"repeat an edge), got rows={rows}, cols={cols}"
            )
        if rows * cols != n:
            raise TopologyError(
                f"torus: rows * cols must equal n, got rows={rows}, cols={cols} "
                f"(rows * cols = {rows * cols}) and n={n}"
            )
    i = np.arange(n)
    r, c = divmod(i, cols)
    down = ((r + 1) % rows) * cols + c
    right = r * cols + (c + 1) % cols
    A = adjacency(n, np.concatenate([i, i]), np.concatenate([down, right]))
    return finish("torus", A, {"rows": rows, "cols": cols}, weights, lazy)


def hypercube(n: int, *, weights: str | None = None, lazy: bool = False) -> Topology:
    """``log2(n)``-dimensional hypercube: ``i`` linked to ``i XOR 2^k``; ``n`` a power of 2.

    ``log2(n)``-regular; with uniform weights ``lambda_2 = 1 - 2/(log2(n) + 1)``.
    """
    n = check_int("hypercube", "n", n, 2)
    check_fits("hypercube", n, n * max(1, n.bit_length() - 1) // 2)
    if n & (n - 1):
        lo = 1 << (n.bit_length() - 1)
        raise TopologyError(
            f"hypercube: n must be a power of 2 (2, 4, 8, 16, ...), got n={n}; "
            f"the nearest are {lo} and {2 * lo}"
        )
    dim = n.bit_length() - 1
    i = np.arange(n)
    src = np.tile(i, dim)
    dst = np.concatenate([i ^ (1 << k) for k in range(dim)])
    return finish("hypercube", adjacency(n, src, dst), {}, weights, lazy)
