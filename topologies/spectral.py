"""Spectral figures of a mixing matrix: lambda_2, lambda_n, rho and the spectral gap.

``W`` is symmetric and doubly stochastic, so its eigenvalues are real and lie in
``[-1, 1]``; the largest is exactly 1 with eigenvector ``1/sqrt(n)``. Gossip
``x <- W x`` shrinks the distance to consensus by at most ``rho = max(|lambda_2|,
|lambda_n|)`` per step, so ``1 - rho`` (the spectral gap) is the figure that matters.

Two methods:

- ``dense``: ``scipy.linalg.eigvalsh`` on the full matrix (every eigenvalue, O(n^3)).
- ``sparse``: each end of the spectrum by one of two routes.

  * *Lanczos* on ``W`` restricted to ``1^perp`` (the known eigenpair ``(1, 1)`` is
    projected out at every step), both ends from one run. Fast when the ends of the
    spectrum are well separated (expanders, hypercubes, exponential graphs). This is
    plain Lanczos without reorthogonalisation, written here rather than
    ``scipy.sparse.linalg.eigsh``: ARPACK reorthogonalises every step against its
    whole basis, which at n = 100,000 costs 10-20 times the sparse product, and the
    extreme Ritz values do not need it.
  * *shift-invert* with ``scipy.sparse.linalg.eigsh``. On a ring of 100,000 nodes
    ``1 - lambda_2 ~ 1.3e-9`` and the next eigenvalues are as close again, so Lanczos
    would need tens of thousands of steps. Top end: the eigenvalue 1 is known
    exactly, so we work on the Laplacian ``L = I - W`` and apply its pseudo-inverse on
    ``1^perp``, through a sparse LU of ``L`` with node 0 grounded (row and column 0
    removed; that matrix is nonsingular when the graph is connected). The largest
    eigenvalue of ``L^+`` is ``1/(1 - lambda_2)``, well separated from the next
    (``mu_3/mu_2 = 4`` on a ring), and ``1 - lambda_2`` comes out without
    cancellation. Bottom end: shift-invert of ``W - sigma I`` at the Gershgorin bound
    ``sigma = min_i(2 W_ii - 1) <= lambda_n`` (less 1e-10), which is attained on
    bipartite regular graphs such as even rings and tori and close on lattices.

  Shift-invert needs a sparse LU, which is cheap on lattice-like graphs (rings, tori,
  paths, grids) and ruinous on expanders, where Lanczos is fast instead. The order is
  chosen by the eccentricity of node 0 (one BFS): lattice-like graphs, with an
  eccentricity above ``4 log2(n)``, try shift-invert first; the others try Lanczos
  first. An end that the first route does not resolve goes to the other; if neither
  does, ``SpectralError``. The known weak spot: a graph that is both poorly separated
  at an end and has no small separators (say, a long chain of large expanders) makes
  the LU expensive.

Eigenvalues within ``ROUNDOFF`` of 0 are reported as exactly 0 (the complete graph
with uniform weights has ``rho = 0``, which eigvalsh returns as ~1e-16).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import scipy.linalg
import scipy.sparse as sp
import scipy.sparse.csgraph as csgraph
from scipy.sparse.linalg import splu

__all__ = ["Spectrum", "spectrum", "DENSE_MAX_N", "ROUNDOFF", "SpectralWarning"]

#: ``method="auto"`` uses the dense method up to this n, the sparse one above.
DENSE_MAX_N = 2048
#: Eigenvalues closer than this to 0 are reported as 0.
ROUNDOFF = 1e-13
#: Residual (distance to an eigenvalue) accepted for a Ritz value; for ARPACK it is
#: relative to the eigenvalue of the shift-inverted operator.
_TOL = 1e-10
#: Plain Lanczos budget (one sparse product per step) and how often it checks.
_LANCZOS_STEPS = 3000
_CHECK_EVERY = 25
#: Lanczos budget on a factorised inverse (one sparse solve per step): for the top
#: end, and for each round of the bottom end, whose shift may move up between rounds
#: (short rounds: a closer shift converges faster than more steps at a far one).
_SHIFT_INVERT_STEPS = 300
_ROUND_STEPS = 50
_REFINE_ROUNDS = 10
#: Below this n the sparse method hands over to the dense one.
_SPARSE_MIN_N = 8
#: Lattice-like graphs: eccentricity of node 0 above this many times log2(n).
_LATTICE_FACTOR = 4
#: Shift-invert of the bottom end sits this far below the Gershgorin bound, so that
#: ``W - sigma I`` is positive definite even when the bound is attained.
_BOTTOM_MARGIN = 1e-10
_SEED = 20240229


class SpectralWarning(UserWarning):
    """The sparse method returned an end of the spectrum short of its tolerance."""


@dataclass(frozen=True)
class Spectrum:
    """The extreme eigenvalues of a mixing matrix other than the trivial 1.

    Attributes:
        lambda2: second largest eigenvalue.
        lambdan: smallest eigenvalue.
        one_minus_lambda2: ``1 - lambda2``, computed without cancellation where the
            method allows (the shift-invert route computes it directly).
        one_plus_lambdan: ``1 + lambdan``.
        method: ``"dense"`` or ``"sparse"``.
        routes: how the top and the bottom end were found: ``"eigvalsh"``,
            ``"lanczos"`` or ``"shift-invert"``.
        converged: False if the sparse method stopped short of its tolerance at
            either end (a ``SpectralWarning`` says by how much).
    """

    lambda2: float
    lambdan: float
    one_minus_lambda2: float
    one_plus_lambdan: float
    method: str
    routes: tuple[str, str]
    converged: bool = True

    @property
    def rho(self) -> float:
        """``max(|lambda_2|, |lambda_n|)``: the worst contraction per gossip step."""
        return max(abs(self.lambda2), abs(self.lambdan))

    @property
    def spectral_gap(self) -> float:
        """``1 - rho``, from the cancellation-free ``1 - lambda2`` and ``1 + lambdan``."""
        top = self.one_minus_lambda2 if self.lambda2 >= 0 else 1.0 + self.lambda2
        bottom = self.one_plus_lambdan if self.lambdan <= 0 else 1.0 - self.lambdan
        return min(top, bottom)


def spectrum(W: np.ndarray | sp.spmatrix, method: str = "auto") -> Spectrum:
    """lambda_2 and lambda_n of a valid (symmetric, doubly stochastic, connected) ``W``.

    ``method`` is ``"auto"`` (dense up to ``DENSE_MAX_N`` nodes, sparse above),
    ``"dense"`` or ``"sparse"`` (which still hands matrices under 8 nodes to the dense
    method). ``W`` is not validated here: build a ``topologies.Topology`` for that.
    The sparse method issues a ``SpectralWarning`` and sets ``converged=False`` if an
    end stops short of its tolerance.
    """
    if method not in ("auto", "dense", "sparse"):
        raise ValueError(f"spectrum: method must be 'auto', 'dense' or 'sparse', got {method!r}")
    n = W.shape[0]
    if method == "dense" or (method == "auto" and n <= DENSE_MAX_N):
        return _dense(W)
    return _sparse(sp.csr_matrix(W, dtype=np.float64))


def _clean(x: float) -> float:
    return 0.0 if abs(x) < ROUNDOFF else float(x)


def _dense(W: np.ndarray | sp.spmatrix) -> Spectrum:
    Wd = W.toarray() if sp.issparse(W) else np.asarray(W, dtype=np.float64)
    ev = scipy.linalg.eigvalsh(Wd)  # ascending; ev[-1] is the trivial 1
    l2, ln = _clean(ev[-2]), _clean(ev[0])
    return Spectrum(l2, ln, 1.0 - l2, 1.0 + ln, "dense", ("eigvalsh", "eigvalsh"))


def _sparse(W: sp.csr_matrix) -> Spectrum:
    n = W.shape[0]
    if n < _SPARSE_MIN_N:  # too small for a Krylov method to mean anything
        return _dense(W)
    lattice = _eccentricity0(W) > _LATTICE_FACTOR * math.log2(n)
    v0 = np.random.default_rng(_SEED).standard_normal(n)
    found: dict[str, list[_End]] = {"top": [], "bottom": []}

    def best(end: str) -> _End | None:
        return min(found[end], key=lambda e: e.residual, default=None)

    def settled(end: str) -> bool:
        b = best(end)
        return b is not None and b.converged

    def lanczos() -> None:
        for end, result in _lanczos_ends(W, v0).items():
            found[end].append(result)

    if not lattice:
        lanczos()
    if not settled("top"):
        found["top"] += _attempt(_top_shift_invert, W, v0)
    if not settled("bottom"):
        hint = best("bottom")
        found["bottom"] += _attempt(_bottom_shift_invert, W, v0, hint.value if hint else None)
    if lattice and not (settled("top") and settled("bottom")):
        lanczos()
    top, bottom = best("top"), best("bottom")
    assert top is not None and bottom is not None  # Lanczos ran whenever shift-invert could fail
    for result, what in ((top, "lambda_2"), (bottom, "lambda_n")):
        if not result.converged:
            warnings.warn(
                f"{what} of this {n}-node matrix did not converge: {result.value!r} is within "
                f"{result.residual:.2g} of an eigenvalue (asked for {_TOL:g})",
                SpectralWarning,
                stacklevel=4,
            )
    l2, gap2 = (0.0, 1.0) if abs(top.value) < ROUNDOFF else (top.value, top.gap)
    ln, gapn = (0.0, 1.0) if abs(bottom.value) < ROUNDOFF else (bottom.value, bottom.gap)
    return Spectrum(
        l2, ln, gap2, gapn, "sparse", (top.route, bottom.route), top.converged and bottom.converged
    )


def _attempt(route: Callable[..., _End], *args) -> list[_End]:
    """``[route(*args)]``, or ``[]`` if SuperLU gives up (``RuntimeError``)."""
    try:
        return [route(*args)]
    except RuntimeError:
        return []


@dataclass(frozen=True)
class _End:
    """One end of the spectrum: the value, 1 -+ value, and how sure we are of it."""

    value: float
    gap: float  # 1 - lambda_2 or 1 + lambda_n
    residual: float  # distance to an eigenvalue of W is at most this
    route: str

    @property
    def converged(self) -> bool:
        return self.residual <= _TOL


def _better(a: _End, b: _End) -> _End:
    return a if a.residual <= b.residual else b


def _inverted_residual(theta: float, residual: float) -> float:
    """Bound on ``|1/theta - 1/theta'|`` given ``|theta - theta'| <= residual``."""
    return residual / (theta * (theta - residual)) if residual < theta else math.inf


def _eccentricity0(W: sp.csr_matrix) -> float:
    """Largest hop distance from node 0 (the graph is connected)."""
    d = csgraph.shortest_path(W, method="D", unweighted=True, directed=False, indices=0)
    return float(np.max(d))


# ---------------------------------------------------------------------- Lanczos
def _lanczos(
    apply: Callable[[np.ndarray], np.ndarray],
    v0: np.ndarray,
    steps: int,
    done: Callable[[dict[str, tuple[float, float]]], bool],
) -> dict[str, tuple[float, float]]:
    """Extreme Ritz values of a symmetric operator on ``1^perp``, by plain Lanczos.

    ``apply`` must map ``1^perp`` into itself; every vector is projected back onto it
    so that rounding never lets the direction ``1`` (the trivial eigenvector) in.
    Returns ``{"top": (theta, residual), "bottom": (theta, residual)}``, the largest
    and the smallest Ritz value with ``|beta_k s_k|``, which bounds their distance to
    an eigenvalue of the operator (Paige; it holds without reorthogonalisation).
    Checks ``done`` every ``_CHECK_EVERY`` steps and stops when it says so.

    No reorthogonalisation: it would cost ``k`` vector operations per step against one
    operator application, and the extreme Ritz values converge without it (lost
    orthogonality only adds copies, "ghosts", of values that have converged).
    """
    q = v0 - v0.mean()
    q /= _norm(q)
    q_prev = np.zeros_like(q)
    beta_prev = 0.0
    alphas: list[float] = []
    betas: list[float] = []
    ends: dict[str, tuple[float, float]] = {}
    for k in range(1, steps + 1):
        w = apply(q)
        w -= w.mean()
        alpha = _dot(q, w)
        w -= alpha * q
        w -= beta_prev * q_prev
        beta = _norm(w)
        alphas.append(alpha)
        # beta ~ 0: the Krylov space is invariant (complete graph, star), T is exact
        breakdown = beta <= 1e-12 * max(1.0, abs(alpha))
        if breakdown or k % _CHECK_EVERY == 0 or k == steps:
            ends = _ritz_ends(np.array(alphas), np.array(betas), 0.0 if breakdown else beta)
            if breakdown or done(ends):
                break
        betas.append(beta)
        q_prev, q = q, w / beta
        beta_prev = beta
    return ends


def _ritz_ends(alphas: np.ndarray, betas: np.ndarray, beta: float) -> dict[str, tuple[float, float]]:
    k = alphas.size
    out = {}
    for end, index in (("top", k - 1), ("bottom", 0)):
        if k == 1:
            theta, last = alphas[0], 1.0
        else:
            vals, vecs = scipy.linalg.eigh_tridiagonal(
                alphas, betas, select="i", select_range=(index, index)
            )
            theta, last = vals[0], vecs[-1, 0]
        out[end] = (float(theta), abs(beta * float(last)))
    return out


def _dot(x: np.ndarray, y: np.ndarray) -> float:
    # einsum, not BLAS: a multi-threaded BLAS on a busy machine turns these O(n) calls
    # into the bottleneck (measured 0.02 ms -> 1.4 ms per call at n = 100,000)
    return float(np.einsum("i,i->", x, y))


def _norm(x: np.ndarray) -> float:
    return math.sqrt(_dot(x, x))


def _lanczos_ends(W: sp.csr_matrix, v0: np.ndarray) -> dict[str, _End]:
    """Both ends of ``W`` on ``1^perp`` from one plain Lanczos run."""
    ends = _lanczos(
        lambda x: W @ x, v0, _LANCZOS_STEPS,
        lambda e: e["top"][1] <= _TOL and e["bottom"][1] <= _TOL,
    )
    (l2, r2), (ln, rn) = ends["top"], ends["bottom"]
    return {
        "top": _End(l2, 1.0 - l2, r2, "lanczos"),
        "bottom": _End(ln, 1.0 + ln, rn, "lanczos"),
    }


# ----------------------------------------------------------------- shift-invert
def _factor(M: sp.spmatrix):
    """Sparse LU of a symmetric matrix with diagonal pivots only (an LDL^T in effect).

    With a symmetric ordering and no off-diagonal pivoting, the diagonal of ``U`` holds
    the pivots of ``L D L^T``, so their signs give the inertia of ``M`` (Sylvester).
    Raises ``RuntimeError`` when a pivot is exactly zero.
    """
    return splu(
        sp.csc_matrix(M), permc_spec="MMD_AT_PLUS_A", diag_pivot_thresh=0.0,
        options={"SymmetricMode": True},
    )


def _positive_definite(lu) -> bool:
    return bool(np.array_equal(lu.perm_r, lu.perm_c) and np.all(lu.U.diagonal() > 0))


def _inverse_top(
    solve: Callable[[np.ndarray], np.ndarray], v0: np.ndarray, steps: int
) -> tuple[float, float]:
    """Largest Ritz value (and residual) of an inverse operator on ``1^perp``."""
    theta, residual = _lanczos(
        solve, v0, steps, lambda e: _inverted_residual(*e["top"]) <= _TOL
    )["top"]
    return theta, residual


def _top_shift_invert(W: sp.csr_matrix, v0: np.ndarray) -> _End:
    """``1 - lambda_2`` as ``1 / (largest eigenvalue of L^+)``, ``L = I - W``."""
    n = W.shape[0]
    L = sp.csr_matrix(sp.identity(n, format="csr") - W)
    lu = _factor(L[1:, 1:])  # positive definite: L is a connected weighted Laplacian

    def solve(b: np.ndarray) -> np.ndarray:
        # L x = b has a solution for b orthogonal to 1; pin x_0 = 0 and solve for the
        # rest (row 0 then holds too, since the columns of L sum to 0)
        x = np.zeros(n)
        x[1:] = lu.solve(b[1:])
        return x

    theta, residual = _inverse_top(solve, v0, _SHIFT_INVERT_STEPS)
    gap2 = 1.0 / theta
    return _End(1.0 - gap2, gap2, _inverted_residual(theta, residual), "shift-invert")


def _bottom_shift_invert(W: sp.csr_matrix, v0: np.ndarray, hint: float | None) -> _End:
    """lambda_n by shift-invert from below, the shift moved up while it stays certified.

    Start at the Gershgorin bound ``min_i(2 W_ii - 1) <= lambda_n``, less 1e-10, where
    ``W - sigma I`` is positive definite. The largest eigenvalue of ``(W - sigma I)^-1``
    is ``1/(lambda_n - sigma)``, and Lanczos on it converges fast when ``sigma`` is
    closer to lambda_n than the next eigenvalue is. When it does not converge, its Ritz
    value still gives an upper bound on lambda_n, so the next shift goes just below
    that bound, kept only once its factorisation shows ``W - sigma I`` positive
    definite (``sigma < lambda_n``); otherwise we step further down.
    """
    n = W.shape[0]
    identity = sp.identity(n, format="csr")
    lowest_diag = float(W.diagonal().min())
    sigma = 2.0 * lowest_diag - 1.0 - _BOTTOM_MARGIN
    one_plus_sigma = 2.0 * lowest_diag - _BOTTOM_MARGIN  # 1 + sigma without cancellation
    upper = hint if hint is not None else math.inf
    lu = _factor(W - sigma * identity)
    best = _End(math.nan, math.nan, math.inf, "shift-invert")
    for _ in range(_REFINE_ROUNDS):
        theta, residual = _inverse_top(lu.solve, v0, _ROUND_STEPS)
        end = _End(
            sigma + 1.0 / theta, one_plus_sigma + 1.0 / theta,
            _inverted_residual(theta, residual), "shift-invert",
        )
        best = _better(best, end)
        if end.converged:
            return end
        upper = min(upper, end.value)  # theta <= 1/(lambda_n - sigma)
        step = max(4.0 * end.residual, 1e-12)
        while True:
            candidate = upper - step
            if candidate <= sigma:
                return best  # no room left between the bounds
            try:
                lu_c = _factor(W - candidate * identity)
            except RuntimeError:  # exactly singular: candidate is an eigenvalue
                lu_c = None
            if lu_c is not None and _positive_definite(lu_c):
                sigma, one_plus_sigma, lu = candidate, 1.0 + candidate, lu_c
                break
            upper, step = candidate, 8.0 * step  # an eigenvalue lies below candidate
    return best
