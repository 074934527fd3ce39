"""PowerSGD (papers/001): rank-r power-iteration compression inside error-feedback SGD
with momentum.

The flat parameter vector is cut into the model's tensors (``shapes``, in
``parameters()`` order, e.g. ``FlatParams.shapes``). A tensor of two or more
dimensions is the matrix M of shape (shape[0], prod(shape[1:])) (a conv weight
(out, in, kh, kw) becomes (out, in*kh*kw)); it is compressed when that pays:
(n + k) r * min_compression_rate < n k, with r = min(n, k, rank). Vectors (biases,
norms) and matrices too small to gain are all-reduced uncompressed.

One step on worker w with gradient g_w (Alg. 2 around Alg. 1):

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

Bytes per worker per step: two ring all-reduces, of 4 (U + sum_j n_j r_j) and of
4 sum_j k_j r_j bytes (U = uncompressed values), each 2 (W - 1) / W of its size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from gossip.algorithms._centralized import _Centralized, check_fraction
from gossip.algorithms._common import check_int, shared_key

__all__ = ["PowerSGD", "PowerSGDConfig", "PowerSGDState", "orthogonalize"]

_Q_STREAM = 2


@dataclass(frozen=True, kw_only=True)
class PowerSGDConfig:
    """``shapes``: the parameter tensors' shapes in flat-buffer order (required)."""

    shapes: tuple[tuple[int, ...], ...] | None = None
    rank: int = 1
    momentum: float = 0.9
    nesterov: bool = True
    warm_start: bool = True
    error_feedback: bool = True
    min_compression_rate: float = 2.0
    orthogonalization_epsilon: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.shapes is None:
            raise ValueError(
                "Arg `shapes` of powersgd is required: the parameter shapes in flat order "
                "(FlatParams.shapes), so matrices can be told from vectors"
            )
        try:
            shapes = tuple(tuple(int(s) for s in sh) for sh in self.shapes)
        except (TypeError, ValueError):
            raise TypeError(
                f"Arg `shapes` must be a sequence of shapes (sequences of ints), got {self.shapes!r}"
            ) from None
        if not shapes or any(s < 0 for sh in shapes for s in sh):
            raise ValueError(
                f"Arg `shapes` must be a non-empty sequence of shapes with non-negative sizes, got {shapes}"
            )
        object.__setattr__(self, "shapes", shapes)
        check_int("rank", self.rank, minimum=1)
        check_fraction("momentum", self.momentum)
        for name in ("nesterov", "warm_start", "error_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Arg `{name}` must be a bool, got {getattr(self, name)!r}")
        for name in ("min_compression_rate", "orthogonalization_epsilon"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"Arg `{name}` must be a finite number >= 0, got {v!r}")

    @property
    def numel(self) -> int:
        return sum(math.prod(sh) for sh in self.shapes)


@dataclass
class PowerSGDState:
    """``t`` counts steps from 1; ``lr`` is the step size last set (PowerSGD's update
    does not depend on it). ``error`` (m, d): e_w (empty without error feedback);
    ``momentum`` (m, d) (empty when lambda = 0); ``q`` (m, sum_j k_j r_j): the
    warm-start Q of every compressed matrix, identical on all workers."""

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
    p_off: int  # into the concatenated P (values after the uncompressed ones)
    q_off: int  # into the concatenated Q


def orthogonalize(P: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """Gram-Schmidt on the columns of a batch of matrices (B, n, r), in place.

    A column of zeros stays zero instead of becoming NaN.
    """
    r = P.shape[2]
    for i in range(r):
        col = P[:, :, i : i + 1]
        norm = torch.linalg.vector_norm(col, dim=1, keepdim=True)
        col.copy_(torch.where(norm > 0, col / (norm + eps), torch.zeros_like(col)))
        if i + 1 < r:
            rest = P[:, :, i + 1 :]
            rest -= (col * rest).sum(dim=1, keepdim=True) * col
    return P


class PowerSGD(_Centralized):
    """Rank-r PowerSGD with error feedback and momentum; steps in the module docstring."""

    name = "powersgd"
    summary = "PowerSGD (papers/001): rank-r power iteration, warm start, error feedback, momentum"

    def __init__(self, config: PowerSGDConfig, comm: Any) -> None:
        super().__init__(config, comm)
        self.matrices: list[_Matrix] = []
        unc: list[torch.Tensor] = []
        off = p_tot = q_tot = 0
        for sh in config.shapes:
            numel = math.prod(sh)
            if len(sh) >= 2 and numel > 0:
                n, k = sh[0], numel // sh[0]
                r = min(n, k, config.rank)
                if (n + k) * r * config.min_compression_rate < n * k:
                    self.matrices.append(_Matrix(off, n, k, r, p_tot, q_tot))
                    p_tot += n * r
                    q_tot += k * r
                    off += numel
                    continue
            unc.append(torch.arange(off, off + numel))
            off += numel
        self.unc_index = torch.cat(unc) if unc else torch.zeros(0, dtype=torch.int64)
        self.p_numel, self.q_numel = p_tot, q_tot

    @property
    def compressed_numel(self) -> int:
        """Values sent per worker per step (before the all-reduce's 2(W-1)/W)."""
        return self.unc_index.numel() + self.p_numel + self.q_numel

    def _random_q(self, step: int, m: int, like: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(shared_key(self.config.seed, step, _Q_STREAM))
        q = torch.randn(self.q_numel, generator=g, dtype=torch.float32)
        return q.to(dtype=like.dtype, device=like.device).expand(m, -1).clone()

    def setup(self, X: torch.Tensor) -> None:
        m, d = X.shape
        if d != self.config.numel:
            raise ValueError(
                f"powersgd: the parameter shapes hold {self.config.numel} values, the flat "
                f"buffer has {d}"
            )
        cfg = self.config
        self.state = PowerSGDState(
            t=1,
            lr=1.0,
            error=X.new_zeros(m, d) if cfg.error_feedback else X.new_zeros(0),
            momentum=X.new_zeros(m, d) if cfg.momentum > 0 else X.new_zeros(0),
            q=self._random_q(0, m, X),
        )

    def _views(self, A: torch.Tensor, mat: _Matrix) -> torch.Tensor:
        return A[:, mat.offset : mat.offset + mat.n * mat.k].view(A.shape[0], mat.n, mat.k)

    @torch.no_grad()
    def reduce_gradients(self, G: torch.Tensor) -> None:
        st, cfg, ledger = self.state, self.config, self.comm.ledger
        m, d = G.shape
        U = self.unc_index.numel()
        with ledger.phase("compute"):
            # 1. error feedback
            M = G + st.error if cfg.error_feedback else G.clone()
        with ledger.phase("compress"):
            if not cfg.warm_start and st.t > 1:
                st.q = self._random_q(st.t, m, G)
            # 2. P = M Q, next to the values that travel uncompressed
            buf = M.new_empty(m, U + self.p_numel)
            buf[:, :U] = M[:, self.unc_index.to(M.device)]
            for mat in self.matrices:
                Q = st.q[:, mat.q_off : mat.q_off + mat.k * mat.r].view(m, mat.k, mat.r)
                P = buf[:, U + mat.p_off : U + mat.p_off + mat.n * mat.r].view(m, mat.n, mat.r)
                torch.bmm(self._views(M, mat), Q, out=P)
        with ledger.phase("communicate"):
            # 3. one all-reduce for the uncompressed values and every P
            buf = self.comm.all_reduce(buf, op="mean")
        with ledger.phase("compress"):
            # 4. orthogonalise P, then Q = M^T P_hat
            Qs = M.new_empty(m, self.q_numel)
            hats = []
            for mat in self.matrices:
                P_hat = orthogonalize(
                    buf[:, U + mat.p_off : U + mat.p_off + mat.n * mat.r].reshape(m, mat.n, mat.r).clone(),
                    cfg.orthogonalization_epsilon,
                )
                hats.append(P_hat)
                Q = Qs[:, mat.q_off : mat.q_off + mat.k * mat.r].view(m, mat.k, mat.r)
                torch.bmm(self._views(M, mat).transpose(1, 2), P_hat, out=Q)
        with ledger.phase("communicate"):
            # 5. all-reduce the mean of Q
            Qs = self.comm.all_reduce(Qs, op="mean")
        with ledger.phase("compress"):
            # 6. decompress: P_hat Q^T for the matrices, the mean for the rest
            out = M.new_empty(m, d)
            out[:, self.unc_index.to(M.device)] = buf[:, :U]
            for mat, P_hat in zip(self.matrices, hats):
                Q = Qs[:, mat.q_off : mat.q_off + mat.k * mat.r].view(m, mat.k, mat.r)
                torch.bmm(P_hat, Q.transpose(1, 2), out=self._views(out, mat))
        with ledger.phase("compute"):
            # 7. local error on the compressed matrices; the rest was sent exactly
            if cfg.error_feedback:
                st.error.zero_()
                for mat in self.matrices:
                    self._views(st.error, mat).copy_(self._views(M, mat) - self._views(out, mat))
            # 8. momentum after decompression
            lam = cfg.momentum
            if lam > 0:
                st.momentum.mul_(lam).add_(out)
                direction = out + lam * st.momentum if cfg.nesterov else st.momentum
            else:
                direction = out
            # 9. the direction replaces the gradient
            G.copy_(direction)
        st.q = Qs.clone() if cfg.warm_start else st.q
        st.t += 1

    def set_lr(self, lr: float) -> None:
        """Recorded only: PowerSGD's memories are in gradient units (papers/001 Alg. 2)."""
        super().set_lr(lr)
