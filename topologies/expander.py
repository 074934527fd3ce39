"""Random regular expanders."""

from __future__ import annotations

import random

import numpy as np

from ._checks import check_fits, check_int, check_seed
from ._graph import adjacency, finish
from .errors import TopologyError
from .topology import Topology

__all__ = ["expander", "DEFAULT_DEGREE", "DEFAULT_SEED", "MAX_DRAWS"]

DEFAULT_DEGREE = 4
#: ``seed=None`` means this seed, not fresh entropy: every rank of a distributed run
#: builds its own copy of the topology, and all copies must be the same graph.
DEFAULT_SEED = 0
#: Draws before giving up on a connected graph (for degree >= 3 nearly every draw is).
MAX_DRAWS = 100


def expander(
    n: int,
    *,
    degree: int = DEFAULT_DEGREE,
    seed: int | None = None,
    weights: str | None = None,
    lazy: bool = False,
) -> Topology:
    """Random ``degree``-regular graph on ``n`` nodes, drawn again until connected.

    Random regular graphs of degree ``d >= 3`` are, with high probability, near-optimal
    expanders: ``lambda_2`` of the adjacency is close to ``2 sqrt(d - 1)``, so the gap
    stays bounded away from 0 as ``n`` grows. Rules: ``3 <= degree < n`` and
    ``n * degree`` even. Draws come from ``networkx.random_regular_graph`` with one
    ``random.Random(seed)`` (``seed=None`` means ``DEFAULT_SEED``), so the same seed
    gives the same graph with the same networkx version.
    """
    n = check_int("expander", "n", n, 4)
    degree = check_int("expander", "degree", degree, 3)
    seed = check_seed("expander", seed)
    if degree >= n:
        raise TopologyError(
            f"expander: degree must be < n (a simple graph has at most n - 1 neighbours "
            f"per node), got n={n}, degree={degree}"
        )
    if (n * degree) % 2:
        raise TopologyError(
            f"expander: n * degree must be even (each edge has two ends), "
            f"got n={n}, degree={degree}"
        )
    # networkx builds the random graph first: a Python object per node and edge
    check_fits("expander", n, n * degree // 2, bytes_per_edge=512)
    import networkx as nx  # here, not at the top: the CLI starts faster without it

    used_seed = DEFAULT_SEED if seed is None else seed
    rng = random.Random(used_seed)
    for _ in range(MAX_DRAWS):
        G = nx.random_regular_graph(degree, n, seed=rng)
        if nx.is_connected(G):
            break
    else:
        raise TopologyError(
            f"expander: no connected {degree}-regular graph on {n} nodes in {MAX_DRAWS} "
            f"draws (seed={used_seed}); try another seed or a larger degree"
        )
    edges = np.array(G.edges(), dtype=np.int64).reshape(-1, 2)
    A = adjacency(n, edges[:, 0], edges[:, 1])
    return finish("expander", A, {"degree": degree, "seed": used_seed}, weights, lazy)
