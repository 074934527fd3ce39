"""Topologies from a graph or an adjacency matrix supplied by the user."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import scipy.sparse as sp

from ._graph import finish
from .errors import TopologyError
from .topology import Topology

if TYPE_CHECKING:
    import networkx as nx

__all__ = ["from_graph", "from_adjacency"]


def from_graph(
    G: nx.Graph,
    *,
    weights: str | None = None,
    lazy: bool = False,
    name: str = "graph",
) -> Topology:
    """A topology on any undirected networkx graph.

    Node ``i`` of the topology is the ``i``-th node of ``sorted(G)`` (of ``list(G)``
    when the labels cannot be sorted), so a graph labelled ``0..n-1`` keeps its labels.
    Edge attributes are ignored: the weights come from the rule (``None``: uniform if
    ``G`` is regular, Metropolis-Hastings otherwise). Self loops are dropped with a
    warning; directed graphs and multigraphs are refused.
    """
    import networkx as nx  # here, not at the top: the CLI starts faster without it

    if not isinstance(G, nx.Graph):
        raise TopologyError(f"from_graph: expected a networkx graph, got {type(G).__name__}")
    if G.is_directed():
        raise TopologyError(
            "from_graph: the graph must be undirected (gossip weights are symmetric); "
            "pass G.to_undirected()"
        )
    if G.is_multigraph():
        raise TopologyError(
            "from_graph: multigraphs are not accepted (parallel edges have no meaning for "
            "the weight rules); pass networkx.Graph(G)"
        )
    try:
        nodes = sorted(G)
    except TypeError:
        nodes = list(G)
    A = nx.to_scipy_sparse_array(G, nodelist=nodes, weight=None, format="csr")
    return _from_adjacency(A, weights, lazy, name, "from_graph", stacklevel=3)


def from_adjacency(
    A: Any,
    *,
    weights: str | None = None,
    lazy: bool = False,
    name: str = "adjacency",
) -> Topology:
    """A topology on the graph of a symmetric 0/1 adjacency matrix (dense or sparse).

    ``A[i, j] = 1`` links ``i`` and ``j``. A non-zero diagonal is ignored with a warning:
    the weight rule sets the self weights. To use a mixing matrix you computed yourself,
    pass it to ``Topology(W)`` instead.
    """
    return _from_adjacency(A, weights, lazy, name, "from_adjacency", stacklevel=3)


def _from_adjacency(
    A: Any, weights: object, lazy: object, name: str, who: str, stacklevel: int
) -> Topology:
    if sp.issparse(A):
        A = sp.csr_matrix(A, dtype=np.float64, copy=True)
    else:
        try:
            arr = np.asarray(A, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise TopologyError(f"{who}: the adjacency matrix must hold numbers: {e}") from None
        if arr.ndim != 2:
            raise TopologyError(f"{who}: the adjacency matrix must be 2-D, got shape {arr.shape}")
        A = sp.csr_matrix(arr)
    if A.shape[0] != A.shape[1]:
        raise TopologyError(f"{who}: the adjacency matrix must be square, got shape {A.shape}")
    if A.shape[0] < 2:
        raise TopologyError(f"{who}: a topology needs n >= 2 nodes, got n={A.shape[0]}")
    A.eliminate_zeros()
    bad = np.flatnonzero(A.data != 1.0)
    if bad.size:
        i = int(np.searchsorted(A.indptr, bad[0], side="right") - 1)
        j = int(A.indices[bad[0]])
        raise TopologyError(
            f"{who}: adjacency entries must be 0 or 1, got A[{i}, {j}] = {float(A.data[bad[0]])!r}; "
            f"to use your own weights, pass the mixing matrix to topologies.Topology(W)"
        )
    if A.diagonal().any():
        warnings.warn(
            f"{who}: ignoring {int(np.count_nonzero(A.diagonal()))} self loop(s); "
            f"the weight rule sets the self weights",
            stacklevel=stacklevel,
        )
        A.setdiag(0)
        A.eliminate_zeros()
    asym = sp.csr_matrix(A - A.T)
    asym.eliminate_zeros()
    if asym.nnz:
        i = int(np.searchsorted(asym.indptr, 0, side="right") - 1)
        j = int(asym.indices[0])
        raise TopologyError(
            f"{who}: the adjacency matrix must be symmetric (undirected graph), but "
            f"A[{i}, {j}] = {A[i, j]:g} and A[{j}, {i}] = {A[j, i]:g}; use A + A.T > 0 "
            f"for the undirected graph"
        )
    A.sort_indices()
    return finish(name, A, {}, weights, lazy)
