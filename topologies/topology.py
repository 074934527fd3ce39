"""``Topology``: a validated mixing matrix and everything derived from it."""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np
import scipy.sparse as sp
import scipy.sparse.csgraph as csgraph

from . import spectral
from ._numeric import row_sums
from .errors import TopologyError
from .spectral import DENSE_MAX_N, Spectrum

__all__ = ["Topology", "TOLERANCE", "DENSE_MAX_N"]

#: Largest deviation allowed from symmetry and from unit row and column sums.
TOLERANCE = 1e-12


class Topology:
    """A gossip topology: ``n`` nodes and a mixing matrix ``W``.

    ``W`` is validated here, whoever built it: square, ``n >= 2``, finite, non-negative,
    symmetric and with rows and columns summing to 1 (both within ``TOLERANCE``), and
    its graph (the non-zero off-diagonal entries) connected. A broken rule raises
    ``TopologyError`` naming the rule, the offending entry or row, and a fix.

    Args:
        matrix: the mixing matrix, a 2-D array-like or a ``scipy.sparse`` matrix.
        name: a short name (the builders use their registry name).
        params: the parameters that produced the matrix, kept for reports and logs.

    The builders (``topologies.ring``, ``topologies.build("ring", 8)``, ...) are the
    usual way to get one; pass your own matrix here to use it as it is.

    The spectral figures (``lambda2``, ``lambdan``, ``rho``, ``spectral_gap``) are
    computed on first use and cached; see ``topologies.spectral`` for how.

    One step ``W(t)`` of a time-varying topology (``topologies.timevarying``) is a
    ``Topology`` built with ``connected=False`` (one step of a one-peer graph links each
    node to one other) and, for a directed graph, ``symmetric=False``: rows and columns
    must still sum to 1. Such a step has no spectral figures of its own (the
    time-varying topology reports those of a whole period); its rows are what a node
    receives (``neighbors``: in-neighbours ``j`` with ``W_ij``) and its columns whom it
    sends to (``out_neighbors``).
    """

    #: a static graph; ``TimeVaryingTopology`` says True
    time_varying = False

    def __init__(
        self,
        matrix: Any,
        *,
        name: str = "custom",
        params: Mapping[str, Any] | None = None,
        symmetric: bool = True,
        connected: bool = True,
    ) -> None:
        W = _as_csr(matrix)
        _validate(W, symmetric=bool(symmetric), connected=bool(connected))
        self.symmetric: bool = bool(symmetric)
        W.data.flags.writeable = False
        self._W = W
        self._dense: np.ndarray | None = None
        self._spectrum: Spectrum | None = None
        self.n: int = W.shape[0]
        self.name: str = str(name)
        self.params: Mapping[str, Any] = MappingProxyType(dict(params or {}))

        diag = W.diagonal().astype(np.float64)
        diag.flags.writeable = False
        self._self_weights = diag
        off = sp.csr_matrix(W - sp.diags(diag, format="csr"))
        off.eliminate_zeros()
        off.sort_indices()
        self._off = off
        deg = np.diff(off.indptr).astype(np.int64)
        deg.flags.writeable = False
        self._degrees = deg
        self._out: sp.csr_matrix | None = None

    # ------------------------------------------------------------------ matrix
    @property
    def matrix(self) -> np.ndarray | sp.csr_matrix:
        """``W``: a read-only ``np.ndarray`` for ``n <= DENSE_MAX_N``, else ``csr_matrix``.

        Read-only because the cached spectrum depends on it; copy it to modify it.
        """
        if self.n > DENSE_MAX_N:
            return self._W
        if self._dense is None:
            dense = self._W.toarray()
            dense.flags.writeable = False
            self._dense = dense
        return self._dense

    def to_sparse(self) -> sp.csr_matrix:
        """A fresh, writable ``csr_matrix`` copy of ``W``, whatever ``n``."""
        W = self._W.copy()
        W.data = np.array(W.data)
        return W

    def to_dense(self) -> np.ndarray:
        """A fresh, writable dense copy of ``W``, whatever ``n``."""
        return self._W.toarray()

    # ------------------------------------------------------------- neighbours
    def neighbors(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Node ``i``'s neighbours (ascending ids, self excluded) and their weights."""
        i = self._node(i)
        lo, hi = self._off.indptr[i], self._off.indptr[i + 1]
        ids = self._off.indices[lo:hi].astype(np.int64)
        return ids, np.array(self._off.data[lo:hi], dtype=np.float64)

    def out_neighbors(self, i: int) -> np.ndarray:
        """The nodes ``j != i`` with ``W_ji > 0`` (whom ``i`` sends to), ascending.

        The same ids as ``neighbors(i)`` for a symmetric matrix.
        """
        i = self._node(i)
        if self._out is None:
            out = sp.csr_matrix(self._off.T)
            out.sort_indices()
            self._out = out
        lo, hi = self._out.indptr[i], self._out.indptr[i + 1]
        return self._out.indices[lo:hi].astype(np.int64)

    def at(self, t: int) -> "Topology":
        """``W(t)`` of a static topology: itself, whatever ``t``."""
        return self

    def self_weight(self, i: int) -> float:
        """``W_ii``."""
        return float(self._self_weights[self._node(i)])

    @property
    def self_weights(self) -> np.ndarray:
        """The diagonal of ``W``, shape ``(n,)`` (read-only)."""
        return self._self_weights

    @property
    def degrees(self) -> np.ndarray:
        """Number of neighbours of each node, ``int64`` shape ``(n,)`` (read-only)."""
        return self._degrees

    @property
    def is_regular(self) -> bool:
        """Whether every node has the same degree."""
        return bool(self._degrees.min() == self._degrees.max())

    def padded_neighbors(self) -> tuple[np.ndarray, np.ndarray]:
        """Every node's neighbours as two ``(n, D)`` arrays, ``D`` the largest degree.

        Row ``i`` lists node ``i``'s neighbours in ascending id order, then pads with
        ``idx = i`` and ``w = 0.0`` up to ``D`` columns, so ``sum(w[i] * x[idx[i]])`` is
        the neighbour part of ``(W x)_i`` for any node. Fresh, writable arrays.
        """
        n, D = self.n, int(self._degrees.max())
        idx = np.repeat(np.arange(n, dtype=np.int64)[:, None], D, axis=1)
        w = np.zeros((n, D), dtype=np.float64)
        rows = np.repeat(np.arange(n), self._degrees)
        cols = np.arange(self._off.nnz) - np.repeat(self._off.indptr[:-1], self._degrees)
        idx[rows, cols] = self._off.indices
        w[rows, cols] = self._off.data
        return idx, w

    def _node(self, i: int) -> int:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"node index must be an integer, got {i!r}")
        if not 0 <= i < self.n:
            raise IndexError(f"node {i} is out of range for a {self.n}-node topology (0..{self.n - 1})")
        return int(i)

    # --------------------------------------------------------------- spectrum
    def spectrum(self, method: str = "auto") -> Spectrum:
        """The spectral figures by ``method`` (``"auto"``, ``"dense"`` or ``"sparse"``).

        ``"auto"`` is cached and backs ``lambda2``, ``lambdan``, ``rho`` and
        ``spectral_gap``; forcing a method recomputes (to cross-check the two).
        """
        if not self.symmetric:
            raise TopologyError(
                f"{self.name}: a directed mixing matrix (built with symmetric=False, one step of "
                f"a time-varying topology) has no symmetric spectrum; the time-varying "
                f"topology reports the spectral gap of a whole period"
            )
        if method != "auto":
            return spectral.spectrum(self._W, method)
        if self._spectrum is None:
            self._spectrum = spectral.spectrum(self._W, "auto")
        return self._spectrum

    @property
    def lambda2(self) -> float:
        """Second largest eigenvalue of ``W``."""
        return self.spectrum().lambda2

    @property
    def lambdan(self) -> float:
        """Smallest eigenvalue of ``W``."""
        return self.spectrum().lambdan

    @property
    def rho(self) -> float:
        """``max(|lambda_2|, |lambda_n|)``."""
        return self.spectrum().rho

    @property
    def spectral_gap(self) -> float:
        """``1 - rho``."""
        return self.spectrum().spectral_gap

    def consensus_steps(self, eps: float = 1e-3) -> int | None:
        """Gossip steps ``t`` that guarantee ``rho**t <= eps``: ``ceil(log eps / log rho)``.

        The distance to the average shrinks by at least ``rho`` per step, so after ``t``
        steps it is at most ``eps`` times the start. ``rho = 0`` (exact averaging, e.g.
        the complete graph) gives 1 step; ``rho = 1`` (never mixes, e.g. a bipartite
        matrix without self weights) gives ``None``.
        """
        if not 0.0 < eps < 1.0:
            raise ValueError(f"consensus_steps: eps must be in (0, 1), got {eps!r}")
        gap = self.spectral_gap
        if self.rho == 0.0:
            return 1
        if gap <= 0.0:
            return None
        # log1p(-gap) keeps the precision of log(rho) when rho is within 1e-9 of 1
        return max(1, math.ceil(math.log(eps) / math.log1p(-gap) - 1e-9))

    def summary(self) -> dict[str, Any]:
        """The figures the CLI's ``--json`` prints, as a dict with JSON-ready values."""
        return {
            "name": self.name,
            "n": self.n,
            "min_degree": int(self._degrees.min()),
            "max_degree": int(self._degrees.max()),
            "lambda2": self.lambda2,
            "lambdan": self.lambdan,
            "rho": self.rho,
            "spectral_gap": self.spectral_gap,
            "steps_to_1e-3": self.consensus_steps(1e-3),
        }

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"<Topology {self.name} n={self.n}{', ' + params if params else ''}>"


# --------------------------------------------------------------------- validation
def _as_csr(matrix: Any) -> sp.csr_matrix:
    if sp.issparse(matrix):
        if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
            raise TopologyError(f"mixing matrix must be square, got shape {matrix.shape}")
        try:
            W = sp.csr_matrix(matrix, dtype=np.float64, copy=True)
        except (TypeError, ValueError) as e:
            raise TopologyError(f"mixing matrix must hold real numbers: {e}") from None
    else:
        try:
            arr = np.asarray(matrix)
            if np.iscomplexobj(arr) or arr.dtype.kind not in "biuf":
                raise TypeError(f"dtype {arr.dtype}")
            arr = arr.astype(np.float64)
        except (TypeError, ValueError) as e:
            raise TopologyError(f"mixing matrix must hold real numbers, got {e}") from None
        if arr.ndim != 2 or arr.shape[0] != arr.shape[1]:
            raise TopologyError(f"mixing matrix must be square (n x n), got shape {arr.shape}")
        W = sp.csr_matrix(arr)
    W.eliminate_zeros()
    W.sort_indices()
    return W


def _entry(W: sp.csr_matrix, k: int) -> tuple[int, int]:
    """(row, col) of the k-th stored entry of a csr matrix."""
    row = int(np.searchsorted(W.indptr, k, side="right") - 1)
    return row, int(W.indices[k])


def _validate(W: sp.csr_matrix, *, symmetric: bool = True, connected: bool = True) -> None:
    n = W.shape[0]
    if n < 2:
        raise TopologyError(f"a topology needs n >= 2 nodes, got a {n} x {n} matrix")
    bad = np.flatnonzero(~np.isfinite(W.data))
    if bad.size:
        i, j = _entry(W, int(bad[0]))
        raise TopologyError(f"mixing matrix must be finite: W[{i}, {j}] = {float(W.data[bad[0]])}")
    bad = np.flatnonzero(W.data < 0)
    if bad.size:
        i, j = _entry(W, int(bad[0]))
        raise TopologyError(
            f"mixing matrix must be non-negative: W[{i}, {j}] = {float(W.data[bad[0]])!r}; "
            f"gossip weights are averaging weights, set negative entries to 0 "
            f"(or build from the graph with weights='metropolis')"
        )
    D = sp.csr_matrix(W - W.T)
    if symmetric and D.nnz:
        k = int(np.argmax(np.abs(D.data)))
        if abs(D.data[k]) > TOLERANCE:
            i, j = _entry(D, k)
            raise TopologyError(
                f"mixing matrix must be symmetric: W[{i}, {j}] = {float(W[i, j])!r} but "
                f"W[{j}, {i}] = {float(W[j, i])!r} (difference {abs(D.data[k]):.3g} > {TOLERANCE:g}); "
                f"use an undirected graph, e.g. (W + W.T) / 2 or weights='metropolis'"
            )
    for what, sums in (("row", row_sums(W)), ("column", row_sums(sp.csr_matrix(W.T)))):
        k = int(np.argmax(np.abs(sums - 1.0)))
        if abs(sums[k] - 1.0) > TOLERANCE:
            raise TopologyError(
                f"every {what} of the mixing matrix must sum to 1 (within {TOLERANCE:g}): "
                f"{what} {k} sums to {float(sums[k])!r}; rescale it, or set the self weight "
                f"W[{k}, {k}] = 1 - (sum of the other weights) as Metropolis-Hastings does"
            )
    if not connected:
        return
    ncomp, labels = csgraph.connected_components(W, directed=False)
    if ncomp > 1:
        other = int(np.flatnonzero(labels != labels[0])[0])
        size0 = int(np.count_nonzero(labels == labels[0]))
        raise TopologyError(
            f"the graph of the mixing matrix must be connected, but it has {ncomp} "
            f"components (node 0 is in one of {size0} nodes, node {other} is not in it); "
            f"without a path between them gossip never reaches consensus; add edges "
            f"joining the components"
        )
