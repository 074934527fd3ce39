"""Sketched-SGD (Ivkin et al. 2019, arXiv:1903.04488) and its two top-k baselines.

Worker i, gradient g_i, momentum factor mu, k coordinates per step, P k candidates
(Ivkin et al. 2019, arXiv:1903.04488, Alg. 3, "empirical training"):

1. momentum correction: u_i <- mu u_i + g_i; error accumulation: v_i <- v_i + u_i;
2. ``sketched``: Count Sketch S_i = S(v_i) with ``rows`` x ``cols`` counters; the bucket
   h_j(c) and sign s_j(c) of every coordinate are drawn once from a key shared by all
   workers (``_common.shared_key``), so the sketches are linear and summable;
3. round 1: one all-reduce (mean) of [S_i, uncompressed values];
4. HEAVYMIX on the merged sketch S (Alg. 1 with P k candidates): every coordinate's
   estimate ghat_c = median_j s_j(c) S[j, h_j(c)], the l2 estimate
   l2hat^2 = median_j sum_b S[j, b]^2; the heavy set H = {c : ghat_c^2 >= l2hat^2/(P k)}
   is kept whole and the candidates are completed with the next largest |ghat_c|
   (Ivkin et al. 2019, arXiv:1903.04488, Sec. 5.2 queries every coordinate and keeps the largest; Alg. 1 fills
   at random) -- i.e. the P k largest |ghat_c|, which contain H whenever |H| <= P k;
5. round 2: all-reduce (mean) of the exact v_i at the P k candidates;
6. the k largest |mean| of them make the update gtilde (k-sparse);
7. momentum-factor masking: u_i, v_i <- 0 where gtilde != 0 (Alg. 3 line 13);
8. G <- gtilde (+ the uncompressed part), so the plain SGD step is x <- x - eta gtilde.

Uncompressed tensors (1-D shapes, i.e. biases and norms, of the layout given to ``setup``) get
momentum SGD: u_i <- mu u_i + g_i and the mean of u travels exactly in round 1.

Baselines with the same momentum correction, masking and uncompressed biases:

* ``truetopk``: one all-reduce of the full v_i (mean), top k of the mean (reference:
  the true top-k of the summed gradient);
* ``localtopk``: each worker all-gathers its own top k of v_i (fp32 values + int32
  indices); the update is the mean over workers of these sparse vectors (their union);
  a worker masks the coordinates it sent.

Bytes (ledger), as Ivkin et al. 2019 (arXiv:1903.04488) counts: ``sketched`` records 4 (|S| + P k + k + 2 U) bytes
per worker per step (sketch and candidate values up, k updated values and the U
uncompressed values back; indices not counted, see docs/centralized.md); ``truetopk``
and ``localtopk`` record what their collectives send.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gossip.algorithms.base import ParamLayout, WireFormat
from gossip.algorithms._centralized import CentralizedBase, check_fraction
from gossip.algorithms._common import check_int, shared_key

__all__ = [
    "CountSketch",
    "LocalTopK",
    "LocalTopKConfig",
    "Sketched",
    "SketchedConfig",
    "TopKState",
    "TrueTopK",
    "TrueTopKConfig",
]

_HASH_STREAM = 3


@dataclass(frozen=True, kw_only=True)
class TrueTopKConfig:
    """``k`` (coordinates per step) or ``p`` (their fraction of the compressed
    coordinates, default 0.01); ``momentum`` mu in [0, 1) (0.9). The 1-D tensors of the
    layout given to ``setup`` (biases, norms) travel uncompressed; without a layout
    every coordinate is compressed."""

    k: int | None = None
    p: float | None = None
    momentum: float = 0.9
    seed: int = 0

    _algo = "truetopk"

    def __post_init__(self) -> None:
        algo = self._algo
        if self.k is not None and self.p is not None:
            raise ValueError(f"{algo}: give `k` or `p`, not both")
        if self.k is not None:
            check_int("k", self.k, minimum=1)
        p = 0.01 if self.k is None and self.p is None else self.p
        if p is not None and (
            isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1
        ):
            raise ValueError(f"Arg `p` of {algo} must be a number in (0, 1], got {p!r}")
        object.__setattr__(self, "p", None if p is None else float(p))
        check_fraction("momentum", self.momentum)
        check_int("seed", self.seed, minimum=0)

    def k_for(self, n: int) -> int:
        """k for ``n`` compressed coordinates (at most n)."""
        k = self.k if self.k is not None else max(1, round(self.p * n))
        return min(k, n)


@dataclass(frozen=True, kw_only=True)
class LocalTopKConfig(TrueTopKConfig):
    """As ``truetopk``."""

    _algo = "localtopk"


@dataclass(frozen=True, kw_only=True)
class SketchedConfig(TrueTopKConfig):
    """As ``truetopk`` plus the Count Sketch: ``rows`` (5), ``cols`` (None: P k),
    ``candidates`` P (4): the sketch proposes P k coordinates whose exact values are
    fetched in a second round."""

    rows: int = 5
    cols: int | None = None
    candidates: int = 4

    _algo = "sketched"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("rows", self.rows, minimum=1)
        check_int("candidates", self.candidates, minimum=1)
        if self.cols is not None:
            check_int("cols", self.cols, minimum=1)

    def cols_for(self, k: int) -> int:
        return self.cols if self.cols is not None else self.candidates * k


class CountSketch:
    """A Count Sketch of ``rows`` x ``cols`` counters over vectors of length ``d``.

    Buckets and signs come from a generator seeded by ``key``: every holder of the key
    builds the same sketch, so ``sketch(a) + sketch(b) == sketch(a + b)`` across workers.
    """

    def __init__(self, d: int, rows: int, cols: int, key: int) -> None:
        self.d, self.rows, self.cols = d, rows, cols
        g = torch.Generator().manual_seed(key & 0x7FFFFFFFFFFFFFFF)
        buckets = torch.randint(cols, (rows, d), generator=g)
        self.signs = torch.randint(2, (rows, d), generator=g).to(torch.float32).mul_(2).sub_(1)
        # flat counter index j * cols + h_j(c)
        self.index = (buckets + torch.arange(rows).unsqueeze(1) * cols).reshape(-1)

    @property
    def size(self) -> int:
        return self.rows * self.cols

    def sketch(self, V: torch.Tensor) -> torch.Tensor:
        """(m, d) -> (m, rows * cols)."""
        m = V.shape[0]
        signed = (V.unsqueeze(1) * self.signs.to(V.dtype)).reshape(m, -1)
        S = V.new_zeros(m, self.size)
        S.scatter_add_(1, self.index.expand(m, -1), signed)
        return S

    def estimates(self, S: torch.Tensor) -> torch.Tensor:
        """(m, rows * cols) -> (m, d): median over rows of s_j(c) S[j, h_j(c)]."""
        m = S.shape[0]
        est = S[:, self.index].view(m, self.rows, self.d) * self.signs.to(S.dtype)
        return est.median(dim=1).values if self.rows > 1 else est[:, 0]

    def l2_squared(self, S: torch.Tensor) -> torch.Tensor:
        """(m,): median over rows of the row's sum of squared counters."""
        sq = S.view(S.shape[0], self.rows, self.cols).pow(2).sum(dim=2)
        return sq.median(dim=1).values

    def heavymix(self, S: torch.Tensor, n: int) -> torch.Tensor:
        """Indices (m, n) of the candidates: the heavy set H (estimate^2 >= l2^2 / n)
        completed with the next largest estimates; H is contained when |H| <= n."""
        est = self.estimates(S).abs()
        heavy = est.pow(2) >= self.l2_squared(S).unsqueeze(1) / n
        # heavy coordinates first, then by |estimate| (ties by lower index via topk on a
        # key that puts every heavy coordinate above every light one)
        key = torch.where(heavy, est + est.max() + 1, est)
        return torch.topk(key, min(n, self.d), dim=1, sorted=True).indices


def _once_per_distinct_row(fn, T: torch.Tensor) -> torch.Tensor:
    """``fn(T)`` for a function of each row on its own: computed on one row and expanded
    where every row of ``T`` is the same, as an all-reduce leaves the nodes of a
    simulation (each would otherwise repeat the work of the others); row by row otherwise."""
    if T.shape[0] > 1 and bool((T == T[:1]).all()):
        out = fn(T[:1])
        return out.expand(T.shape[0], *out.shape[1:])
    return fn(T)


@dataclass
class TopKState:
    """``t`` counts steps from 1; ``lr`` is the step size last set (not used: the
    memories are in gradient units). ``u`` (m, d): momentum; ``v`` (m, d): the error
    accumulation (0 on uncompressed coordinates)."""

    t: int
    lr: float
    u: torch.Tensor
    v: torch.Tensor


class _TopKFamily(CentralizedBase):
    shards_flat = False  # its blocks are the tensors
    fault_tolerant = True
    local_state = ("v",)  # the worker's own error accumulation: a healed worker starts it at zero

    def __init__(self, config: Any, comm: Any) -> None:
        super().__init__(config, comm)
        self.unc_index = torch.zeros(0, dtype=torch.int64)
        self.cmp_index: torch.Tensor | None = None
        self.k = 0

    @classmethod
    def momentum_of(cls, config: Any) -> float:
        return config.momentum

    def wire_format(self) -> WireFormat:
        """``<name>:k=K``, and the fp32 values each worker sends per step per coordinate."""
        d = self.layout.dim if self.layout is not None else 1
        return WireFormat(f"{self.name}:k={self.k}", round(32.0 * self._wire_values() / max(1, d), 4))

    def _wire_values(self) -> int:
        return self.layout.dim if self.layout is not None else 0  # the full all-reduce

    def setup(self, X: torch.Tensor, layout: ParamLayout | None = None) -> None:
        m, d = X.shape
        cfg = self.config
        given = layout is not None
        layout = self._take_layout(X, layout)
        if given:
            is_vec = torch.zeros(d, dtype=torch.bool)
            off = 0
            for sh in layout.shapes:
                numel = math.prod(sh)
                if len(sh) <= 1:
                    is_vec[off : off + numel] = True
                off += numel
            self.unc_index = torch.nonzero(is_vec).view(-1)
            self.cmp_index = torch.nonzero(~is_vec).view(-1)
        else:
            self.cmp_index = torch.arange(d)
        if self.cmp_index.numel() == 0:
            raise ValueError(f"{self.name}: no tensor to compress (every shape is 1-D)")
        self.k = cfg.k_for(int(self.cmp_index.numel()))
        self._setup_extra(int(self.cmp_index.numel()))
        self.state = TopKState(t=1, lr=1.0, u=X.new_zeros(m, d), v=X.new_zeros(m, d))

    def _setup_extra(self, n: int) -> None:
        pass

    def _record(self, values: int) -> None:
        """Record ``4 * values`` bytes sent by every hosted node (ring successor) and
        received from a foreign predecessor, as one all_reduce call."""
        c = self.comm
        n = c.world_size
        if n <= 1:
            return
        nodes = np.asarray(c.nodes.cpu().numpy(), dtype=np.int64)
        b = 4 * values
        c.ledger.record(nodes, (nodes + 1) % n, b, op="all_reduce")
        pred = (nodes - 1) % n
        foreign = pred[~np.isin(pred, nodes)]
        if foreign.size:
            c.ledger.record(foreign, (foreign + 1) % n, b, op="all_reduce")

    @torch.no_grad()
    def reduce_gradients(self, G: torch.Tensor) -> None:
        st, cfg, ledger = self.state, self.config, self.comm.ledger
        m, d = G.shape
        dev = G.device
        cidx, uidx = self.cmp_index.to(dev), self.unc_index.to(dev)
        with ledger.phase("compute"):
            # 1. momentum correction and error accumulation (v only where compressed)
            st.u.mul_(cfg.momentum).add_(G)
            V = st.u[:, cidx] + st.v[:, cidx]
        # 2-6. the algorithm's selection: (m, k) indices into the compressed coordinates
        #      and their (mean) values, plus the mean of u on the uncompressed ones
        sel, vals, unc = self._select(V, st.u[:, uidx])
        with ledger.phase("compute"):
            st.v[:, cidx] = V
            # 7. momentum-factor masking where the update is non-zero
            mask_idx = self._mask_index(sel)
            flat = cidx[mask_idx]
            st.u.scatter_(1, flat, 0.0)
            st.v.scatter_(1, flat, 0.0)
            # 8. the direction replaces the gradient
            out = G.new_zeros(m, d)
            out.scatter_(1, cidx[sel], vals)
            out[:, uidx] = unc
            G.copy_(out)
        st.t += 1

    def _mask_index(self, sel: torch.Tensor) -> torch.Tensor:
        return sel


class Sketched(_TopKFamily):
    """Sketched-SGD (Ivkin et al. 2019, arXiv:1903.04488, Alg. 3); steps in the module docstring."""

    name = "sketched"
    Config = SketchedConfig
    summary = "Sketched-SGD (Ivkin et al. 2019, arXiv:1903.04488): Count Sketch all-reduce, HEAVYMIX top-Pk, exact second round"

    def _setup_extra(self, n: int) -> None:
        cfg = self.config
        self.num_candidates = min(n, cfg.candidates * self.k)
        self.cs = CountSketch(n, cfg.rows, cfg.cols_for(self.k), shared_key(cfg.seed, 0, _HASH_STREAM))

    @property
    def values_per_step(self) -> int:
        """|S| + P k + k + 2 U: the values Ivkin et al. 2019 (arXiv:1903.04488) counts per worker per step."""
        return self.cs.size + self.num_candidates + self.k + 2 * int(self.unc_index.numel())

    def _wire_values(self) -> int:
        return self.values_per_step

    def _select(self, V, Uu):
        ledger = self.comm.ledger
        m, U = V.shape[0], Uu.shape[1]
        with ledger.phase("compress"):
            buf = torch.cat([self.cs.sketch(V), Uu], dim=1)
        with ledger.phase("communicate"):
            # 3. round 1: merged sketch (mean) and the uncompressed values
            buf = self.comm.all_reduce(buf, op="mean", record=False)
        with ledger.phase("compress"):
            S, unc = buf[:, : self.cs.size], buf[:, self.cs.size :]
            # 4. HEAVYMIX: P k candidates, identical on every worker (computed once for
            #    all the hosted nodes, which hold the same merged sketch)
            cand = _once_per_distinct_row(lambda rows: self.cs.heavymix(rows, self.num_candidates), S)
            exact = torch.gather(V, 1, cand)
        with ledger.phase("communicate"):
            # 5. round 2: exact values at the candidates
            exact = self.comm.all_reduce(exact, op="mean", record=False)
        self._record(self.values_per_step)
        self.comm.ledger.count("all_reduce", 2)
        with ledger.phase("compress"):
            # 6. the k largest of them
            top = torch.topk(exact.abs(), self.k, dim=1, sorted=False).indices
            sel = torch.gather(cand, 1, top)
            vals = torch.gather(exact, 1, top)
        return sel, vals, unc


class TrueTopK(_TopKFamily):
    """Top k of the mean of v over all workers (one full all-reduce)."""

    name = "truetopk"
    Config = TrueTopKConfig
    summary = "true top-k of the summed momentum-corrected gradient (Ivkin et al. 2019, arXiv:1903.04488, baseline; full all-reduce)"

    def _select(self, V, Uu):
        ledger = self.comm.ledger
        with ledger.phase("communicate"):
            buf = self.comm.all_reduce(torch.cat([V, Uu], dim=1), op="mean")
        with ledger.phase("compress"):
            n = V.shape[1]
            mean, unc = buf[:, :n], buf[:, n:]
            sel = _once_per_distinct_row(lambda rows: torch.topk(rows.abs(), self.k, dim=1, sorted=False).indices, mean)
            vals = torch.gather(mean, 1, sel)
        return sel, vals, unc


class LocalTopK(_TopKFamily):
    """Each worker's own top k, all-gathered; the update is their mean (union)."""

    name = "localtopk"
    Config = LocalTopKConfig
    summary = "local top-k of each worker, all-gathered, union averaged (Ivkin et al. 2019, arXiv:1903.04488, baseline)"

    def _select(self, V, Uu):
        ledger = self.comm.ledger
        m, n = V.shape
        W, k = self.comm.world_size, self.k
        with ledger.phase("compress"):
            own = torch.topk(V.abs(), k, dim=1, sorted=False).indices
            own_vals = torch.gather(V, 1, own)
            payload = torch.cat(
                [own_vals.float().contiguous().view(torch.int32), own.to(torch.int32)], dim=1
            )
        with ledger.phase("communicate"):
            got = self.comm.all_gather(payload)  # (W, 2k)
            unc = self.comm.all_reduce(Uu, op="mean") if Uu.shape[1] else Uu.clone()
        with ledger.phase("compress"):
            gv = got[:, :k].contiguous().view(torch.float32).to(V.dtype)
            gi = got[:, k:].to(torch.int64)
            dense = V.new_zeros(n)
            dense.index_add_(0, gi.reshape(-1), gv.reshape(-1))
            dense.div_(W)
            union = torch.unique(gi)
            sel = union.unsqueeze(0).expand(m, -1).contiguous()
            vals = dense[union].unsqueeze(0).expand(m, -1).contiguous()
        self._own = own
        return sel, vals, unc

    def _mask_index(self, sel):
        # a worker clears the coordinates it sent
        return self._own

    def _wire_values(self) -> int:
        return 2 * self.k + int(self.unc_index.numel())  # k values and k indices, the rest exact
