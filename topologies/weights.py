"""Weight rules: from an undirected graph to a symmetric doubly stochastic matrix.

Each rule takes the graph as a 0/1 adjacency matrix ``A`` (``scipy.sparse``, symmetric,
no self loops) and returns the mixing matrix ``W`` as ``scipy.sparse.csr_matrix``:

- ``uniform``: ``W_ij = 1/(d+1)`` on every edge and on the self loop. Regular graphs
  only (every node of degree ``d``); on any other graph the rows would not sum to 1.
- ``metropolis`` (Metropolis-Hastings): ``W_ij = 1/(1 + max(d_i, d_j))`` on every edge,
  ``W_ii = 1 - sum_j W_ij``. Any graph; on a regular graph it equals ``uniform``.
- ``lazy``: ``(I + W)/2``, applied after either rule. All eigenvalues move into
  ``[0, 1]``, which removes oscillation (``lambda_n`` near -1) at the price of a gap
  that is halved.

The default (``weights=None``) is ``uniform`` on regular graphs and ``metropolis``
otherwise, so a default never fails.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from ._checks import WEIGHT_RULES
from ._numeric import row_sums
from .errors import TopologyError

__all__ = ["uniform", "metropolis", "lazy", "mixing_matrix", "default_rule", "WEIGHT_RULES"]


def _degrees(A: sp.csr_matrix) -> np.ndarray:
    return np.diff(A.indptr).astype(np.int64)


def default_rule(A: sp.csr_matrix) -> str:
    """``"uniform"`` if every node of ``A`` has the same degree, else ``"metropolis"``."""
    deg = _degrees(A)
    return "uniform" if deg.min() == deg.max() else "metropolis"


def uniform(A: sp.csr_matrix, *, who: str = "uniform weights") -> sp.csr_matrix:
    """``(A + I)/(d+1)`` for a ``d``-regular graph; ``TopologyError`` if not regular."""
    deg = _degrees(A)
    lo, hi = int(deg.argmin()), int(deg.argmax())
    if deg[lo] != deg[hi]:
        raise TopologyError(
            f"{who}: weights='uniform' needs a regular graph (every node the same degree), "
            f"but node {lo} has degree {deg[lo]} and node {hi} has degree {deg[hi]}; "
            f"use weights='metropolis', which works on any graph"
        )
    W = sp.csr_matrix(A + sp.identity(A.shape[0], format="csr"), dtype=np.float64)
    W.data[:] = 1.0 / (deg[0] + 1)
    return W


def metropolis(A: sp.csr_matrix) -> sp.csr_matrix:
    """Metropolis-Hastings weights of any undirected graph."""
    deg = _degrees(A)
    C = sp.coo_matrix(A)
    w = 1.0 / (1.0 + np.maximum(deg[C.row], deg[C.col]))
    off = sp.csr_matrix((w, (C.row, C.col)), shape=A.shape)
    self_w = 1.0 - row_sums(off)  # fsum on long rows keeps the row sum within 1e-16 of 1
    return sp.csr_matrix(off + sp.diags(self_w, format="csr"))


def lazy(W: sp.spmatrix) -> sp.csr_matrix:
    """``(I + W)/2``: the lazy version of a mixing matrix."""
    n = W.shape[0]
    return sp.csr_matrix((sp.identity(n, format="csr") + sp.csr_matrix(W)) * 0.5)


def mixing_matrix(
    A: sp.csr_matrix, weights: str | None, is_lazy: bool, *, who: str
) -> tuple[sp.csr_matrix, str]:
    """Apply a rule (``None`` = the default for this graph) and the lazy flag.

    Returns the matrix and the name of the rule used.
    """
    rule = default_rule(A) if weights is None else weights
    if rule == "uniform":
        W = uniform(A, who=who)
    elif rule == "metropolis":
        W = metropolis(A)
    else:  # callers validate with _checks.check_weights; this guards direct use
        raise TopologyError(f"{who}: unknown weight rule {rule!r}; known: {', '.join(WEIGHT_RULES)}")
    if is_lazy:
        W = lazy(W)
    W.sort_indices()
    return W, rule
