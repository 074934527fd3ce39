"""PowerSGD (Vogels et al. 2019, arXiv:1905.13727): rank-r power-iteration compression inside error-feedback SGD
with momentum, and the two rank-r approximators the paper compares it with.

The flat parameter vector is cut into the model's tensors (the ``ParamLayout`` given
to ``setup``, which ``GossipOptimizer`` builds from the model). A tensor of two or more
dimensions is the matrix M of shape (shape[0], prod(shape[1:])) (a conv weight
(out, in, kh, kw) becomes (out, in*kh*kw)); it is compressed when that pays:
(n + k) r * min_compression_rate < n k, with r = min(n, k, rank). Vectors (biases,
norms) and matrices too small to gain are all-reduced uncompressed. The rule is the
same for every approximator, so they compress the same matrices.

One step on worker w with gradient g_w (Alg. 2 around Alg. 1), ``approximator="power"``:

1. error feedback: M_w = g_w + e_w (Alg. 2 line 7);
2. P_w = M_w Q for every compressed matrix (Alg. 1 line 3), Q shared by all workers;
3. all-reduce the mean of [uncompressed values, P] (Alg. 1 line 4): by linearity
   P = (1/W) sum_w M_w Q;
4. P_hat = orthogonalize(P) (Gram-Schmidt, line 5); Q_w = M_w^T P_hat (line 6);
5. all-reduce the mean of Q (line 7): Q = (1/W) sum_w M_w^T P_hat;
6. decompress: Delta' = P_hat Q^T for the matrices, the mean for the rest (lines 10-11);
7. memorise the local error e_w = M_w - Delta' on the compressed matrices (Alg. 2 line 9;
   0 on the values sent exactly);
8. momentum after decompression (Alg. 2 lines 12-13): m = lambda m + Delta' and the
   direction Delta' + lambda m (Nesterov, as torch.optim.SGD(nesterov=True); see
   docs/centralized.md for the paper box's "Delta' + m"), or m with ``nesterov=False``;
9. G <- direction, so the user's plain SGD step is x <- x - gamma * direction.

Warm start (Sec. 4.2): the Q of step 5 is the next step's Q. The first Q (and every
Q without warm start) is i.i.d. standard normal from a generator seeded identically on
every worker (``seed``, step), so no broadcast is needed.

The other approximators change steps 2-6 only (the same error feedback and momentum
around them):

* ``"best"`` (Appendix G.7, "best-approximation PowerSGD"): steps 2-5 are repeated
  ``iterations`` times per step (subspace iteration, 2 matrix products each; the paper
  finds 4 enough to reach the best rank-r approximation), each round's Q feeding the
  next round's P = M Q, starting from a fresh shared random Q every step (no reuse of
  the previous step). The uncompressed values ride with the first P.
* ``"unbiased"`` (Sec. 4.1, Table 1): U (k x r) is drawn every step from the shared
  generator with i.i.d. N(0, 1/r) entries, so E[U U^T] = I_k; P = M U is all-reduced
  (with the uncompressed values) and Delta' = P U^T, so E[Delta'] = mean_w M_w. U is
  never sent (every worker draws it), so this costs one all-reduce and about half the
  bytes of rank-r PowerSGD (Table 1: 3 MB vs 4 MB per epoch at rank 1, 4 vs 8 at rank 2).

Every approximator acts on the workers' mean (each product is followed by a mean), so
storing e_w = M_w - Delta' (step 7) or Alg. 2's local e_w = M_w - decompress(C(M_w))
gives the same mean error and hence the same updates; we store the former, as
PyTorch's hook does.

Bytes per worker per step, ring all-reduces of 2 (W - 1) / W of their size, with
U = uncompressed values, P = sum_j n_j r_j, Q = sum_j k_j r_j: ``power``, 4 (U + P)
then 4 Q; ``best``, the same plus (iterations - 1) times (4 P then 4 Q);
``unbiased``, 4 (U + P) only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from gossip.algorithms.base import WireFormat
from gossip.algorithms._centralized import CentralizedBase, check_fraction
from gossip.algorithms._common import check_int, shared_key

__all__ = ["PowerSGD", "PowerSGDConfig", "PowerSGDState", "orthogonalize"]

_Q_STREAM = 2
_APPROXIMATORS = ("power", "unbiased", "best")
_BEST_ITERATIONS = 4  # Vogels et al. 2019 (arXiv:1905.13727) G.7


@dataclass(frozen=True, kw_only=True)
class PowerSGDConfig:
    """The options of PowerSGD; the tensors' shapes come from the layout at ``setup``.

    ``approximator``: ``"power"`` (Alg. 1, one power iteration, warm start),
    ``"best"`` (G.7: ``iterations`` subspace iterations from a fresh Q every step,
    default 4) or ``"unbiased"`` (Sec. 4.1: P = M U, U shared random with
    E[U U^T] = I). ``warm_start`` applies to ``"power"`` only; ``iterations`` to
    ``"best"`` only."""

    rank: int = 1
    momentum: float = 0.9
    nesterov: bool = True
    warm_start: bool = True
    error_feedback: bool = True
    min_compression_rate: float = 2.0
    orthogonalization_epsilon: float = 0.0
    approximator: str = "power"
    iterations: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("rank", self.rank, minimum=1)
        check_fraction("momentum", self.momentum)
        for name in ("nesterov", "warm_start", "error_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Arg `{name}` must be a bool, got {getattr(self, name)!r}")
        for name in ("min_compression_rate", "orthogonalization_epsilon"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"Arg `{name}` must be a finite number >= 0, got {v!r}")
        if not isinstance(self.approximator, str) or self.approximator not in _APPROXIMATORS:
            raise ValueError(
                f"Arg `approximator` must be one of {', '.join(_APPROXIMATORS)}, got {self.approximator!r}"
            )
        if self.approximator == "best":
            if self.iterations is None:
                object.__setattr__(self, "iterations", _BEST_ITERATIONS)
            check_int("iterations", self.iterations, minimum=1)
        elif self.iterations is not None:
            raise ValueError(
                f"Arg `iterations` applies to approximator 'best' only, got iterations="
                f"{self.iterations!r} with approximator {self.approximator!r}"
            )


@dataclass
class PowerSGDState:
    """``t`` counts steps from 1; ``lr`` is the step size last set (PowerSGD's update
    does not depend on it). ``error`` (m, d): e_w (empty without error feedback);
    ``momentum`` (m, d) (empty when lambda = 0); ``q`` (m, sum_j k_j r_j): the
    warm-start Q of every compressed matrix (each (k_j, r_j), row-major, in parameter
    order), identical on all workers; (m, 0) for ``best`` and ``unbiased``, which
    draw theirs afresh every step from (seed, t)."""

    t: int
    lr: float
    error: torch.Tensor
    momentum: torch.Tensor
    q: torch.Tensor


@dataclass(frozen=True)
class _Matrix:
    offset: int  # into the flat vector
    n: int
    k: int
    r: int
    p_off: int  # into the concatenated P (grouped by (n, r), see _Group)
    q_off: int  # into the concatenated Q (parameter order)


@dataclass(frozen=True)
class _Group:
    """Matrices whose P has the same shape (n, r): their P lie next to each other, so
    one batched Gram-Schmidt orthogonalises them all."""

    n: int
    r: int
    p_off: int
    count: int


def orthogonalize(P: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """Gram-Schmidt on the columns of a batch of matrices (..., n, r), in place.

    A column of zeros stays zero instead of becoming NaN.
    """
    r = P.shape[-1]
    for i in range(r):
        col = P[..., i : i + 1]
        norm = torch.linalg.vector_norm(col, dim=-2, keepdim=True)
        col.copy_(torch.where(norm > 0, col / (norm + eps), 0.0))
        if i + 1 < r:
            rest = P[..., i + 1 :]
            rest -= (col * rest).sum(dim=-2, keepdim=True) * col
    return P


def _runs(index: list[int]) -> list[tuple[int, int]]:
    """Sorted flat indices as maximal [start, stop) ranges."""
    out: list[list[int]] = []
    for i in index:
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return [(a, b) for a, b in out]


class PowerSGD(CentralizedBase):
    """Rank-r PowerSGD with error feedback and momentum; steps in the module docstring."""

    shards_flat = False  # its matrices are the tensors

    name = "powersgd"
    fault_tolerant = True
    local_state = ("error",)  # e_w, the worker's own residual; Q is shared and comes from the peer
    Config = PowerSGDConfig
    summary = "PowerSGD (Vogels et al. 2019, arXiv:1905.13727): rank-r power iteration, warm start, error feedback, momentum"

    def __init__(self, config: PowerSGDConfig, comm: Any) -> None:
        super().__init__(config, comm)

    @classmethod
    def momentum_of(cls, config: Any) -> float:
        return config.momentum

    def _plan(self, layout: Any) -> None:
        """Which tensors are compressed matrices, and where their P and Q lie."""
        config = self.config
        found: list[tuple[int, int, int, int]] = []  # offset, n, k, r
        unc: list[int] = []
        off = 0
        for sh in layout.shapes:
            numel = math.prod(sh)
            if len(sh) >= 2 and numel > 0:
                n, k = sh[0], numel // sh[0]
                r = min(n, k, config.rank)
                if (n + k) * r * config.min_compression_rate < n * k:
                    found.append((off, n, k, r))
                    off += numel
                    continue
            unc.extend(range(off, off + numel))
            off += numel
        # P grouped by shape (first-seen order), Q in parameter order (the state's layout)
        by_shape: dict[tuple[int, int], list[int]] = {}
        for j, (_, n, _, r) in enumerate(found):
            by_shape.setdefault((n, r), []).append(j)
        p_offs: dict[int, int] = {}
        self.groups: list[_Group] = []
        p_tot = 0
        for (n, r), members in by_shape.items():
            self.groups.append(_Group(n, r, p_tot, len(members)))
            for j in members:
                p_offs[j] = p_tot
                p_tot += n * r
        self.matrices: list[_Matrix] = []
        q_tot = 0
        for j, (o, n, k, r) in enumerate(found):
            self.matrices.append(_Matrix(o, n, k, r, p_offs[j], q_tot))
            q_tot += k * r
        self.unc_index = torch.tensor(unc, dtype=torch.int64)
        # the uncompressed values as contiguous ranges: one range is sliced, not gathered
        self._unc_runs = _runs(unc)
        self.p_numel, self.q_numel = p_tot, q_tot
        # sqrt(r_j) over each matrix's Q: the unbiased approximator's U = Z / sqrt(r)
        self._q_sqrt_r = torch.cat(
            [torch.full((m.k * m.r,), math.sqrt(m.r)) for m in self.matrices]
        ) if self.matrices else torch.zeros(0)
        self._index_cache: dict[torch.device, torch.Tensor] = {}

    def wire_format(self) -> WireFormat:
        """``powersgd:rank=R`` (and the approximator when not ``power``): fp32 factors P
        and Q and the uncompressed tensors, per coordinate of the model."""
        cfg = self.config
        label = f"powersgd:rank={cfg.rank}" + ("" if cfg.approximator == "power" else f",approximator={cfg.approximator}")
        if self.layout is None:
            return WireFormat(label, 32.0)
        return WireFormat(label, round(32.0 * self.compressed_numel / max(1, self.layout.dim), 4))

    @property
    def compressed_numel(self) -> int:
        """Values sent per worker per step (before the all-reduce's 2(W-1)/W)."""
        U, P, Q = self.unc_index.numel(), self.p_numel, self.q_numel
        cfg = self.config
        if cfg.approximator == "unbiased":
            return U + P
        rounds = cfg.iterations if cfg.approximator == "best" else 1
        return U + rounds * (P + Q)

    def _random_q(self, step: int, m: int, like: torch.Tensor) -> torch.Tensor:
        """(m, sum_j k_j r_j) i.i.d. standard normal, the same on every worker and row."""
        g = torch.Generator().manual_seed(shared_key(self.config.seed, step, _Q_STREAM))
        q = torch.randn(self.q_numel, generator=g, dtype=torch.float32)
        if self.config.approximator == "unbiased":
            q.div_(self._q_sqrt_r)  # N(0, 1/r): E[U U^T] = I
        return q.to(dtype=like.dtype, device=like.device).expand(m, -1).clone()

    def setup(self, X: torch.Tensor, layout: Any = None) -> None:
        m, d = X.shape
        self._plan(self._take_layout(X, layout))
        cfg = self.config
        self.state = PowerSGDState(
            t=1,
            lr=1.0,
            error=X.new_zeros(m, d) if cfg.error_feedback else X.new_zeros(0),
            momentum=X.new_zeros(m, d) if cfg.momentum > 0 else X.new_zeros(0),
            q=self._random_q(0, m, X) if cfg.approximator == "power" else X.new_zeros(m, 0),
        )

    # ---------------------------------------------------------------- pieces of a step
    def _unc_idx(self, device: torch.device) -> torch.Tensor:
        idx = self._index_cache.get(device)
        if idx is None:
            idx = self._index_cache[device] = self.unc_index.to(device)
        return idx

    def _gather_unc(self, A: torch.Tensor, out: torch.Tensor) -> None:
        if len(self._unc_runs) == 1:
            a, b = self._unc_runs[0]
            out.copy_(A[:, a:b])
        elif self._unc_runs:
            out.copy_(A.index_select(1, self._unc_idx(A.device)))

    def _scatter_unc(self, src: torch.Tensor, A: torch.Tensor) -> None:
        if len(self._unc_runs) == 1:
            a, b = self._unc_runs[0]
            A[:, a:b] = src
        elif self._unc_runs:
            A.index_copy_(1, self._unc_idx(A.device), src)

    def _zero_unc(self, A: torch.Tensor) -> None:
        if len(self._unc_runs) == 1:
            a, b = self._unc_runs[0]
            A[:, a:b] = 0
        elif self._unc_runs:
            A.index_fill_(1, self._unc_idx(A.device), 0)

    @staticmethod
    def _mat(A: torch.Tensor, mat: _Matrix) -> torch.Tensor:
        return A[:, mat.offset : mat.offset + mat.n * mat.k].view(A.shape[0], mat.n, mat.k)

    @staticmethod
    def _p(Ps: torch.Tensor, mat: _Matrix) -> torch.Tensor:
        return Ps[:, mat.p_off : mat.p_off + mat.n * mat.r].view(Ps.shape[0], mat.n, mat.r)

    @staticmethod
    def _q(Qs: torch.Tensor, mat: _Matrix) -> torch.Tensor:
        return Qs[:, mat.q_off : mat.q_off + mat.k * mat.r].view(Qs.shape[0], mat.k, mat.r)

    def _project(self, M: torch.Tensor, Qs: torch.Tensor, Ps: torch.Tensor) -> None:
        """P = M Q for every compressed matrix, into Ps (m, sum n_j r_j)."""
        for mat in self.matrices:
            torch.bmm(self._mat(M, mat), self._q(Qs, mat), out=self._p(Ps, mat))

    def _orthogonalize(self, Ps: torch.Tensor) -> None:
        m, eps = Ps.shape[0], self.config.orthogonalization_epsilon
        for g in self.groups:
            orthogonalize(Ps[:, g.p_off : g.p_off + g.count * g.n * g.r].view(m, g.count, g.n, g.r), eps)

    def _back_project(self, M: torch.Tensor, Ps: torch.Tensor, Qs: torch.Tensor) -> None:
        """Q = M^T P_hat for every compressed matrix, into Qs (m, sum k_j r_j); computed
        as (P_hat^T M)^T, which reads M along its rows (much faster on CPU)."""
        for mat in self.matrices:
            PtM = torch.bmm(self._p(Ps, mat).transpose(1, 2), self._mat(M, mat))
            self._q(Qs, mat).copy_(PtM.transpose(1, 2))

    def _decompress(self, Ps: torch.Tensor, Qs: torch.Tensor, out: torch.Tensor) -> None:
        for mat in self.matrices:
            torch.bmm(self._p(Ps, mat), self._q(Qs, mat).transpose(1, 2), out=self._mat(out, mat))

    def _memorise(self, E: torch.Tensor, Ps: torch.Tensor, Qs: torch.Tensor) -> None:
        """E (holding M) <- M - P Q^T on the compressed matrices, 0 elsewhere."""
        for mat in self.matrices:
            self._mat(E, mat).baddbmm_(self._p(Ps, mat), self._q(Qs, mat).transpose(1, 2), alpha=-1)
        self._zero_unc(E)

    # ---------------------------------------------------------------- the step
    @torch.no_grad()
    def reduce_gradients(self, G: torch.Tensor) -> None:
        st, cfg, ledger = self.state, self.config, self.comm.ledger
        m, d = G.shape
        U = self.unc_index.numel()
        with ledger.phase("compute"):
            # 1. error feedback, in place: the memory holds M = g + e until step 7, and
            #    G is free to receive Delta'; without it M is G itself (read before written)
            M = st.error.add_(G) if cfg.error_feedback else G
        with ledger.phase("compress"):
            if cfg.approximator == "power":
                if not cfg.warm_start and st.t > 1:
                    st.q = self._random_q(st.t, m, G)
                Qs, rounds = st.q, 1
            else:  # a fresh shared draw every step: U (unbiased) or the first Q (best)
                Qs = self._random_q(st.t, m, G)
                rounds = cfg.iterations if cfg.approximator == "best" else 1
            # 2. P = M Q, next to the values that travel uncompressed
            send = M.new_empty(m, U + self.p_numel)
            self._gather_unc(M, send[:, :U])
            self._project(M, Qs, send[:, U:])
        with ledger.phase("communicate"):
            # 3. one all-reduce for the uncompressed values and every P
            first = self.comm.all_reduce(send, op="mean")
        unc_mean, Ps = first[:, :U], first[:, U:]
        if cfg.approximator != "unbiased":
            for i in range(rounds):
                if i > 0:  # best: the next round of subspace iteration
                    with ledger.phase("compress"):
                        Pn = M.new_empty(m, self.p_numel)
                        self._project(M, Qs, Pn)
                    with ledger.phase("communicate"):
                        Ps = self.comm.all_reduce(Pn, op="mean")
                with ledger.phase("compress"):
                    # 4. orthogonalise P (one batch per P shape), then Q = M^T P_hat
                    self._orthogonalize(Ps)
                    Qn = M.new_empty(m, self.q_numel)
                    self._back_project(M, Ps, Qn)
                with ledger.phase("communicate"):
                    # 5. all-reduce the mean of Q
                    Qs = self.comm.all_reduce(Qn, op="mean")
        with ledger.phase("compress"):
            # 6. decompress into G: P_hat Q^T (P U^T) for the matrices, the mean for the rest
            self._scatter_unc(unc_mean, G)
            self._decompress(Ps, Qs, G)
        with ledger.phase("compute"):
            # 7. local error on the compressed matrices; the rest was sent exactly
            if cfg.error_feedback:
                self._memorise(st.error, Ps, Qs)
            # 8. momentum after decompression; 9. the direction replaces the gradient
            lam = cfg.momentum
            if lam > 0:
                torch.add(G, st.momentum, alpha=lam, out=st.momentum)
                if cfg.nesterov:
                    G.add_(st.momentum, alpha=lam)
                else:
                    G.copy_(st.momentum)
        if cfg.approximator == "power" and cfg.warm_start:
            st.q = Qs
        st.t += 1

    def set_lr(self, lr: float) -> None:
        """Recorded only: PowerSGD's memories are in gradient units (Vogels et al. 2019, arXiv:1905.13727, Alg. 2)."""
        super().set_lr(lr)
