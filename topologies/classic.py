"""Deterministic classic graphs: ring, complete graph, star."""

from __future__ import annotations

import numpy as np

from ._checks import check_fits, check_int
from ._graph import adjacency, finish
from .topology import Topology

__all__ = ["ring", "complete", "star"]


def ring(n: int, *, weights: str | None = None, lazy: bool = False) -> Topology:
    """Cycle over ``n >= 3`` nodes: node ``i`` is linked to ``i - 1`` and ``i + 1`` (mod n).

    2-regular, so the default weights are uniform: 1/3 on both edges and the self loop.
    Then ``lambda_2 = (1 + 2 cos(2 pi/n))/3`` and, for even ``n``, ``lambda_n = -1/3``.
    """
    n = check_int("ring", "n", n, 3)
    check_fits("ring", n, n)
    i = np.arange(n)
    return finish("ring", adjacency(n, i, (i + 1) % n), {}, weights, lazy)


def complete(n: int, *, weights: str | None = None, lazy: bool = False) -> Topology:
    """Every pair of the ``n >= 2`` nodes linked (degree ``n - 1``).

    With uniform weights ``W = 11^T/n``: one gossip step reaches the exact average
    (``rho = 0``). Dense: ``n^2`` entries, so keep ``n`` moderate.
    """
    n = check_int("complete", "n", n, 2)
    check_fits("complete", n, n * (n - 1) // 2)
    src, dst = np.triu_indices(n, k=1)
    return finish("complete", adjacency(n, src, dst), {}, weights, lazy)


def star(n: int, *, weights: str | None = None, lazy: bool = False) -> Topology:
    """Node 0 linked to each of the other ``n - 1`` nodes (``n >= 2``).

    Irregular for ``n >= 3`` (the centre has degree ``n - 1``, the leaves 1), so the
    default weights are Metropolis-Hastings: ``1/n`` on every edge. Mixing is slow
    (``1 - lambda_2 = 1/n``): a useful worst case, not a useful training topology.
    """
    n = check_int("star", "n", n, 2)
    check_fits("star", n, n - 1)
    leaves = np.arange(1, n)
    return finish("star", adjacency(n, np.zeros_like(leaves), leaves), {}, weights, lazy)
