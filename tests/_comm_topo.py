"""Topologies for the communicator tests.

``build(name, n)`` is ``topologies.build`` once that package is importable; until then
a stand-in with the same attributes (docs/internals.md) built from networkx with
uniform 1/(deg+1) weights on regular graphs and Metropolis-Hastings otherwise.
"""

from __future__ import annotations

import math

import networkx as nx
import numpy as np

try:
    from topologies import build as _real_build  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the checkout
    _real_build = None

__all__ = ["build", "REAL"]

REAL = _real_build is not None


class _StandIn:
    def __init__(self, name: str, graph: nx.Graph) -> None:
        n = graph.number_of_nodes()
        deg = np.array([graph.degree(i) for i in range(n)], dtype=np.int64)
        W = np.zeros((n, n))
        regular = len(set(deg.tolist())) == 1
        for i, j in graph.edges():
            W[i, j] = W[j, i] = 1 / (deg[i] + 1) if regular else 1 / (1 + max(deg[i], deg[j]))
        W[np.diag_indices(n)] = 1 - W.sum(axis=1)
        self.n, self.name, self.params, self.matrix, self.degrees = n, name, {}, W, deg
        self.self_weights = np.diag(W).copy()

    def neighbors(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        ids = np.array([j for j in range(self.n) if j != i and self.matrix[i, j] > 0], dtype=np.int64)
        return ids, self.matrix[i, ids]

    def self_weight(self, i: int) -> float:
        return float(self.matrix[i, i])

    def padded_neighbors(self) -> tuple[np.ndarray, np.ndarray]:
        D = int(self.degrees.max()) if self.n > 1 else 0
        idx = np.repeat(np.arange(self.n, dtype=np.int64)[:, None], D, axis=1)
        w = np.zeros((self.n, D))
        for i in range(self.n):
            ids, ws = self.neighbors(i)
            idx[i, : ids.size], w[i, : ids.size] = ids, ws
        return idx, w


def build(name: str, n: int):
    """The ``name`` topology on ``n`` nodes (ring, torus, star, complete)."""
    if _real_build is not None:
        return _real_build(name, n)
    if name == "ring":
        g = nx.cycle_graph(n)
    elif name == "torus":
        side = math.isqrt(n)
        g = nx.convert_node_labels_to_integers(nx.grid_2d_graph(side, side, periodic=True))
    elif name == "star":
        g = nx.star_graph(n - 1)
    elif name == "complete":
        g = nx.complete_graph(n)
    else:
        raise ValueError(name)
    return _StandIn(name, g)
