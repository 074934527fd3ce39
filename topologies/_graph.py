"""Shared last step of every builder: edges -> adjacency -> weights -> Topology."""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.sparse as sp

from ._checks import check_bool, check_weights
from .topology import Topology
from .weights import mixing_matrix


def adjacency(n: int, src: np.ndarray, dst: np.ndarray) -> sp.csr_matrix:
    """Symmetric 0/1 adjacency of the undirected edges ``src[k] -- dst[k]``.

    Repeated edges are merged and self loops dropped.
    """
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    keep = src != dst
    rows = np.concatenate([src[keep], dst[keep]])
    cols = np.concatenate([dst[keep], src[keep]])
    A = sp.csr_matrix((np.ones(rows.size), (rows, cols)), shape=(n, n))
    A.data[:] = 1.0  # duplicates were summed
    A.sort_indices()
    return A


def finish(
    name: str,
    A: sp.csr_matrix,
    params: dict[str, Any],
    weights: object,
    lazy: object,
) -> Topology:
    """Weight ``A`` by ``weights`` (None = default rule), make it lazy if asked, validate."""
    rule = check_weights(name, weights)
    is_lazy = check_bool(name, "lazy", lazy)
    W, used = mixing_matrix(A, rule, is_lazy, who=name)
    return Topology(W, name=name, params={**params, "weights": used, "lazy": is_lazy})
