"""The static exponential graph."""

from __future__ import annotations

import numpy as np

from ._checks import check_fits, check_int
from ._graph import adjacency, finish
from .topology import Topology

__all__ = ["exponential"]


def exponential(n: int, *, weights: str | None = None, lazy: bool = False) -> Topology:
    """Node ``i`` linked to ``i + 2^k`` (mod n) for every ``2^k < n``, undirected.

    Undirected, each node also reaches ``i - 2^k``, so the degree is about
    ``2 log2(n)`` (``2 log2(n) - 1`` when ``n`` is a power of 2, where ``+2^(m-1)`` and
    ``-2^(m-1)`` coincide). The graph is circulant, hence regular: uniform weights by
    default. ``n >= 2``.
    """
    n = check_int("exponential", "n", n, 2)
    check_fits("exponential", n, n * (n - 1).bit_length())
    i = np.arange(n)
    hops = [1 << k for k in range((n - 1).bit_length())]
    src = np.tile(i, len(hops))
    dst = np.concatenate([(i + h) % n for h in hops])
    return finish("exponential", adjacency(n, src, dst), {}, weights, lazy)
