"""Time-varying topologies: a mixing matrix ``W(t)`` per step ``t = 0, 1, 2, ...``.

Two families:

``onepeer_exp`` (the one-peer exponential graph, Assran et al. 2019; Ying et al. 2021)
    With ``K = ceil(log2 n)`` and ``k(t) = 2^(t mod K)``, at step ``t`` node ``i`` sends
    to ``i + k(t)`` and receives from ``i - k(t)`` (mod n), so every node sends one
    message and receives one per step. ``W(t) = (I + P_k)/2``: keep half, take half
    of the one received model, ``(W(t) x)_i = (x_i + x_{i-k})/2``. ``W(t)`` is
    doubly stochastic but not symmetric (except where ``2k = n``): a directed graph.
    For ``n`` a power of two the product ``W(K-1) ... W(1) W(0)`` of one period is
    exactly ``11^T/n`` (each of the ``2^K = n`` paths has weight ``1/n``), so one
    period reaches the exact average. For other ``n`` the ``K`` offsets
    ``1, 2, ..., 2^(K-1)`` still make every period a connected, doubly stochastic
    product, but not the exact average: the period's contraction ``rho < 1`` is
    reported instead (e.g. ``n = 3``: rho = 0.25; ``n = 6``: 0.2165; ``n = 12``: 0.2091).
``matching`` (random perfect matchings)
    At step ``t`` a uniformly random perfect matching, drawn from a generator seeded
    by ``(seed, t)``, so every rank computes the same matching without communicating
    and a resumed run draws the ones it would have drawn. Matched pairs average:
    ``W(t) = (I + P)/2`` with ``P`` the matching's involution, symmetric. ``n`` even.

Each ``W(t)`` is a :class:`topologies.Topology` validated like a static one (finite,
non-negative, rows and columns summing to 1) except that it need not be connected
(one step links each node to one other) nor, for the directed one-peer graph,
symmetric. Connectivity is checked where it matters: on the union of one period.

Spectral figures. A single ``W(t)`` does not mix; what matters is:

* deterministic periodic graphs: the product ``M = W(p-1) ... W(0)`` over one period
  ``p``. ``rho = ||M - 11^T/n||_2`` (largest singular value) is the factor by which one
  period shrinks the distance to the average in the worst case (for a symmetric ``M``
  it equals ``max(|lambda_2|, |lambda_n|)``); ``spectral_gap = 1 - rho``.
* random matchings: the expected contraction of one step. ``W(t)`` is a symmetric
  projection (``W^2 = W``), so ``E||W x - xbar||^2 = (x - xbar)^T E[W] (x - xbar)``,
  and ``E[W] = I/2 + (J - I)/(2(n-1))`` for a uniform perfect matching, whose second
  eigenvalue is ``rho = (n - 2) / (2 (n - 1))``: the expected factor on the *squared*
  distance per step. ``spectral_gap = 1 - rho = n / (2 (n - 1))``.

Pure numpy/scipy: nothing here imports torch.
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np
import scipy.sparse as sp
import scipy.sparse.csgraph as csgraph

from ._checks import check_bool, check_fits, check_int, check_seed
from .errors import TopologyError
from .spectral import DENSE_MAX_N
from .topology import Topology

__all__ = ["TimeVaryingTopology", "onepeer_exp", "matching"]

#: steps of a random topology whose ``W(t)`` are kept (a resumed run or a sweep of
#: evaluations asks for recent steps again)
_CACHE = 64


class TimeVaryingTopology:
    """A topology whose mixing matrix changes every step: ``at(t)`` is ``W(t)``.

    Attributes:
        n: number of nodes.
        name, params: registry name and the parameters that produced it.
        period: ``p`` with ``W(t + p) = W(t)`` for a deterministic graph, None for a
            random one.
        directed: whether the ``W(t)`` may be non-symmetric (then a node's senders,
            ``at(t).neighbors(i)``, and receivers, ``at(t).out_neighbors(i)``, differ).
        degrees: messages each node sends per step, ``int64 (n,)``.

    ``time_varying`` is True (False on a static :class:`Topology`), which is how the
    communicators and the algorithms tell the two apart.
    """

    time_varying = True

    def __init__(self, n: int, *, name: str, params: Mapping[str, Any], period: int | None,
                 directed: bool, degree: int) -> None:
        self.n = int(n)
        self.name = str(name)
        self.params: Mapping[str, Any] = MappingProxyType(dict(params))
        self.period = period
        self.directed = bool(directed)
        deg = np.full(self.n, int(degree), dtype=np.int64)
        deg.flags.writeable = False
        self.degrees = deg
        self._cache: dict[int, Topology] = {}
        self._figures: dict[str, Any] | None = None

    @property
    def is_regular(self) -> bool:
        return True

    # ----------------------------------------------------------------- matrices
    def _matrix(self, t: int) -> sp.csr_matrix:  # pragma: no cover - interface
        raise NotImplementedError

    def at(self, t: int) -> Topology:
        """``W(t)``, validated (see the module docstring); ``t`` is a step index >= 0."""
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)) or t < 0:
            raise TopologyError(f"{self.name}: step t must be an integer >= 0, got {t!r}")
        key = int(t) % self.period if self.period is not None else int(t)
        topo = self._cache.get(key)
        if topo is None:
            topo = Topology(self._matrix(key), name=f"{self.name}@{key}", symmetric=not self.directed,
                            connected=False, params={**self.params, "t": key})
            if self.period is None and len(self._cache) >= _CACHE:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = topo
        return topo

    def product(self, start: int = 0, steps: int | None = None) -> np.ndarray:
        """``W(start + steps - 1) ... W(start + 1) W(start)`` as a dense array (``steps``
        defaults to one period); ``x <- W(t) x`` applied ``steps`` times from ``start``."""
        steps = self.period if steps is None else steps
        if steps is None:
            raise TopologyError(f"{self.name}: a random topology has no period; pass steps")
        check_int(self.name, "steps", steps, 1)
        self._check_dense()
        M = np.eye(self.n)
        for t in range(start, start + steps):
            M = self.at(t).to_sparse() @ M
        return np.asarray(M)

    def _check_dense(self) -> None:
        if self.n > DENSE_MAX_N:
            raise TopologyError(
                f"{self.name}: the period's figures are computed on dense n x n products, "
                f"n <= {DENSE_MAX_N}; got n = {self.n}"
            )

    # ----------------------------------------------------------------- spectra
    def _compute(self) -> dict[str, Any]:  # pragma: no cover - interface
        raise NotImplementedError

    def figures(self) -> dict[str, Any]:
        """``rho``, ``spectral_gap``, what they are of (``gap_of``) and ``exact_average``."""
        if self._figures is None:
            self._figures = self._compute()
        return dict(self._figures)

    @property
    def rho(self) -> float:
        return float(self.figures()["rho"])

    @property
    def spectral_gap(self) -> float:
        return float(self.figures()["spectral_gap"])

    def consensus_steps(self, eps: float = 1e-3) -> int | None:
        """Steps that guarantee the distance to the average shrinks by ``eps``
        (in expectation, for random topologies); None if it never does."""
        if not 0.0 < eps < 1.0:
            raise ValueError(f"consensus_steps: eps must be in (0, 1), got {eps!r}")
        f = self.figures()
        rho = f["rho"]
        if rho >= 1.0:
            return None
        if self.period is not None:  # per period, on the distance
            periods = 1 if rho == 0.0 else max(1, math.ceil(math.log(eps) / math.log(rho) - 1e-9))
            return periods * self.period
        # per step, on the expected squared distance
        return max(1, math.ceil(2.0 * math.log(eps) / math.log(rho) - 1e-9))

    def summary(self) -> dict[str, Any]:
        """The figures ``python -m topologies NAME N --json`` prints (JSON-ready)."""
        f = self.figures()
        return {
            "name": self.name,
            "n": self.n,
            "time_varying": True,
            "directed": self.directed,
            "period": self.period,
            "degree_per_step": int(self.degrees[0]),
            "gap_of": f["gap_of"],
            "rho": f["rho"],
            "spectral_gap": f["spectral_gap"],
            "exact_average": f["exact_average"],
            "steps_to_1e-3": self.consensus_steps(1e-3),
        }

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"<TimeVaryingTopology {self.name} n={self.n}{', ' + params if params else ''}>"


def _shift_matrix(n: int, k: int, keep: float) -> sp.csr_matrix:
    """``keep I + (1 - keep) P`` with ``(P x)_i = x_{i-k}``: i receives from i - k."""
    i = np.arange(n)
    rows = np.concatenate([i, i])
    cols = np.concatenate([i, (i - k) % n])
    vals = np.concatenate([np.full(n, keep), np.full(n, 1.0 - keep)])
    return sp.csr_matrix((vals, (rows, cols)), shape=(n, n))


class _OnePeerExp(TimeVaryingTopology):
    def __init__(self, n: int, lazy: bool) -> None:
        K = max(1, (n - 1).bit_length())  # ceil(log2 n)
        super().__init__(n, name="onepeer-exp", params={"lazy": lazy}, period=K, directed=True, degree=1)
        self.keep = 0.75 if lazy else 0.5
        self.offsets = tuple(1 << k for k in range(K))
        union = sum((self._matrix(t) for t in range(K)), sp.csr_matrix((n, n)))
        ncomp, _ = csgraph.connected_components(union, directed=False)
        if ncomp > 1:  # cannot happen with offset 1 in every period; kept as the rule
            raise TopologyError(f"onepeer-exp: the union of one period is not connected (n = {n})")

    def offset(self, t: int) -> int:
        """``k(t) = 2^(t mod K)``: node i sends to i + k(t), receives from i - k(t)."""
        return self.offsets[int(t) % len(self.offsets)]

    def _matrix(self, t: int) -> sp.csr_matrix:
        return _shift_matrix(self.n, self.offset(t), self.keep)

    def _compute(self) -> dict[str, Any]:
        M = self.product()
        D = M - 1.0 / self.n
        rho = float(np.linalg.norm(D, 2))
        exact = bool(np.array_equal(M, np.full_like(M, 1.0 / self.n)))
        if exact or rho < 1e-13:
            rho = 0.0
        return {"gap_of": f"product of one period ({self.period} steps)", "rho": rho,
                "spectral_gap": 1.0 - rho, "exact_average": exact}


class _Matching(TimeVaryingTopology):
    def __init__(self, n: int, seed: int, lazy: bool) -> None:
        super().__init__(n, name="matching", params={"seed": seed, "lazy": lazy}, period=None,
                         directed=False, degree=1)
        self.seed = seed
        self.keep = 0.75 if lazy else 0.5

    def partners(self, t: int) -> np.ndarray:
        """``p`` with ``p[i]`` node i's partner at step ``t`` (``p[p[i]] = i``)."""
        rng = np.random.default_rng([self.seed, int(t)])
        perm = rng.permutation(self.n)
        p = np.empty(self.n, dtype=np.int64)
        p[perm[0::2]] = perm[1::2]
        p[perm[1::2]] = perm[0::2]
        return p

    def _matrix(self, t: int) -> sp.csr_matrix:
        n, i = self.n, np.arange(self.n)
        rows = np.concatenate([i, i])
        cols = np.concatenate([i, self.partners(t)])
        vals = np.concatenate([np.full(n, self.keep), np.full(n, 1.0 - self.keep)])
        return sp.csr_matrix((vals, (rows, cols)), shape=(n, n))

    def _compute(self) -> dict[str, Any]:
        n, a = self.n, 1.0 - self.keep
        # E[W] = keep I + a (J - I)/(n - 1); E[W^T W] = E[W^2] = (keep^2 + a^2) I + 2 keep a E[P]
        # with E[P] = (J - I)/(n - 1): its eigenvalue on 1^perp is -1/(n - 1)
        rho = float(self.keep**2 + a**2 - 2.0 * self.keep * a / (n - 1))
        return {"gap_of": "expected, E[W(t)^T W(t)] of one step (squared distance)", "rho": rho,
                "spectral_gap": 1.0 - rho, "exact_average": False}


def onepeer_exp(n: int, *, weights: str | None = None, lazy: bool = False) -> TimeVaryingTopology:
    """The one-peer exponential graph on ``n >= 2`` nodes (see the module docstring).

    ``weights`` must be None or ``'uniform'`` (keep half, send half); ``lazy`` keeps 3/4
    and sends 1/4.
    """
    n = check_int("onepeer-exp", "n", n, 2)
    check_fits("onepeer-exp", n, n)
    _fixed_weights("onepeer-exp", weights)
    return _OnePeerExp(n, check_bool("onepeer-exp", "lazy", lazy))


def matching(n: int, *, weights: str | None = None, lazy: bool = False, seed: int | None = None) -> TimeVaryingTopology:
    """A random perfect matching per step on an even ``n >= 2``; seed 0 by default."""
    n = check_int("matching", "n", n, 2)
    check_fits("matching", n, n)
    if n % 2:
        raise TopologyError(f"matching: n must be even (a perfect matching pairs every node), got n={n}")
    _fixed_weights("matching", weights)
    seed = check_seed("matching", seed)
    return _Matching(n, 0 if seed is None else seed, check_bool("matching", "lazy", lazy))


def _fixed_weights(who: str, weights: object) -> None:
    if weights not in (None, "uniform"):
        raise TopologyError(
            f"{who}: weights are fixed (each step keeps half and takes half from one peer), "
            f"so weights must be None or 'uniform', got weights={weights!r}"
        )
