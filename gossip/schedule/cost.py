"""The cost model of Wang et al. 2021 (arXiv:2103.15195) Sec. 4.3 and the partition search.

Assumption 5 (linear overhead): compressing a group of x values costs
h(x) = B_h + gamma_h x and communicating it g(x) = B_g + gamma_g x. Here the
compression cost is split in two linear parts because they happen at different
times: encoding (with error feedback) h_enc runs in the backward pass as soon as the
group is ready, decoding (and the replicated server step) h_dec after backward.
h = h_enc + h_dec is the paper's h.

Pipeline of one iteration with partition X = (x_1, ..., x_y) in backward order
(:meth:`CostModel.predict`)::

    t   = A                                   forward, optimizer step, data (measured)
    for group k:  t += a(group k) + h_enc(x_k)     backward of its tensors, then encode
                  e_k = max(t, e_{k-1}) + g(x_k)   communication overlaps what follows
    d   = t;  for group k:  d = max(d, e_k) + h_dec(x_k)
    F(X) = d

This is eq. (7), A + sum h + sum g - sum p, with the overlap p made explicit: the
compute path (backward and encoding) is serial, communication of group k starts when
it is encoded and the link is free.

Search. For a fixed y, sum h(x_k) and sum g(x_k) do not depend on the split (Lemma 2);
what does is when each group can start. :func:`best_partition` finds the split
minimising the end of communication e_y exactly by dynamic programming over (groups,
tensors): e_k depends on the earlier groups only through e_{k-1} and is monotone in
it, so keeping the smallest e_{k-1} per prefix is optimal. O(y N^2) instead of the
2^(N-1) partitions of Lemma 1 (or O(N^(Y-2) log N) of the paper's Theorem 3). The
decoding tail is added afterwards; it is the same for every split except for how
much of it overlaps the last communications.

:func:`alg2` is Wang et al. 2021 (arXiv:2103.15195) Algorithm 2 over any F_min(y).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np

from gossip.schedule.partition import Partition

__all__ = ["Linear", "fit_linear", "CostModel", "best_partition", "alg2"]


@dataclass(frozen=True)
class Linear:
    """cost(x) = base + per_value * x, in seconds (x in values)."""

    base: float
    per_value: float

    def __call__(self, x: float | np.ndarray) -> float | np.ndarray:
        return self.base + self.per_value * x

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def fit_linear(x: Sequence[float], y: Sequence[float]) -> Linear:
    """Least-squares line through (x, y), with both coefficients kept >= 0.

    A negative slope or intercept (noise on a nearly flat or nearly proportional cost)
    is clamped to 0 and the other coefficient refitted alone.
    """
    xa, ya = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if xa.shape != ya.shape or xa.size == 0:
        raise ValueError(f"fit_linear needs matching non-empty samples, got {xa.size} and {ya.size}")
    if not (np.all(np.isfinite(xa)) and np.all(np.isfinite(ya))):
        raise ValueError("fit_linear: samples must be finite")
    if xa.size >= 2 and np.ptp(xa) > 0:
        slope, base = np.polyfit(xa, ya, 1)
    else:
        slope, base = 0.0, float(ya.mean())
    if slope < 0:
        slope, base = 0.0, float(ya.mean())
    if base < 0:
        base = 0.0
        slope = float((xa @ ya) / (xa @ xa)) if (xa @ xa) > 0 else 0.0
        slope = max(slope, 0.0)
    return Linear(float(base), float(slope))


@dataclass(frozen=True)
class CostModel:
    """Measured or synthetic costs of one iteration; tensors in backward order.

    ``numels[j]``: values of tensor j; ``compute[j]``: backward time spent before
    tensor j's gradient is ready (since the previous one); ``head``: time from the
    end of the previous step to the first gradient (optimizer step, data, forward).
    """

    numels: tuple[int, ...]
    compute: tuple[float, ...]
    head: float
    encode: Linear
    decode: Linear
    comm: Linear

    def __post_init__(self) -> None:
        if len(self.numels) != len(self.compute) or not self.numels:
            raise ValueError(
                f"CostModel: {len(self.numels)} tensor sizes and {len(self.compute)} compute times"
            )

    @property
    def tensors(self) -> int:
        return len(self.numels)

    def compress(self, x: float) -> float:
        """h(x) of Assumption 5: encoding plus decoding."""
        return float(self.encode(x) + self.decode(x))

    def predict(self, partition: Partition) -> float:
        """Predicted iteration time F(X) of the pipeline in the module docstring."""
        xs = partition.numels(self.numels)
        t, e, ends = self.head, 0.0, []
        for (a, b), x in zip(partition.bounds, xs):
            t += sum(self.compute[a:b]) + self.encode(x)
            e = max(t, e) + self.comm(x)
            ends.append(e)
        d = t
        for e_k, x in zip(ends, xs):
            d = max(d, e_k) + self.decode(x)
        return float(d)

    def to_dict(self) -> dict:
        return {
            "tensors": self.tensors,
            "values": int(sum(self.numels)),
            "head_s": self.head,
            "backward_s": float(sum(self.compute)),
            "h": {"base": self.encode.base + self.decode.base,
                  "per_value": self.encode.per_value + self.decode.per_value},
            "h_encode": self.encode.to_dict(),
            "h_decode": self.decode.to_dict(),
            "g": self.comm.to_dict(),
        }


def best_partition(model: CostModel, groups: int) -> Partition:
    """The split into ``groups`` contiguous groups that ends communication earliest.

    Exact for the model (see the module docstring); ties go to the earliest cut.
    """
    n = model.tensors
    if isinstance(groups, bool) or not isinstance(groups, int) or not 1 <= groups <= n:
        raise ValueError(f"groups must be an int from 1 to the {n} tensors, got {groups!r}")
    xs = np.concatenate([[0], np.cumsum(np.asarray(model.numels, dtype=np.float64))])
    ac = np.concatenate([[0], np.cumsum(np.asarray(model.compute, dtype=np.float64))])
    # E[j]: earliest end of communication of the first k groups covering tensors [0, j)
    inf = math.inf
    E = np.full(n + 1, inf)
    E[0] = 0.0
    back = np.zeros((groups + 1, n + 1), dtype=np.int64)
    j = np.arange(n + 1)
    for k in range(1, groups + 1):
        # compute path after k groups ending at tensor j: head + backward + k encodes
        t = model.head + ac + k * model.encode.base + model.encode.per_value * xs
        # cand[i, j] = max(t[j], E[i]) + g(xs[j] - xs[i]) for i < j
        cand = np.maximum(t[None, :], E[:, None]) + model.comm.base + model.comm.per_value * (
            xs[None, :] - xs[:, None]
        )
        cand[j[:, None] >= j[None, :]] = inf
        back[k] = np.argmin(cand, axis=0)
        E = cand[back[k], j]
    if not math.isfinite(E[n]):  # pragma: no cover - groups <= n guarantees a split
        raise RuntimeError("best_partition: no feasible split")
    cuts, end = [], n
    for k in range(groups, 0, -1):
        start = int(back[k, end])
        cuts.append(end - start)
        end = start
    return Partition(tuple(reversed(cuts)))


def alg2(
    f_min: Callable[[int], float], max_groups: int, alpha: float
) -> tuple[int, dict[int, float]]:
    """Wang et al. 2021 (arXiv:2103.15195) Algorithm 2 over ``f_min(y)`` (the best iteration time with y groups).

    Returns the chosen y and every F_min(y) evaluated. For y = 2..Y: stop at y - 1 when
    y is worse; stop at y when it gains less than ``alpha * F_min(y-1)``.
    """
    if isinstance(max_groups, bool) or not isinstance(max_groups, int) or max_groups < 1:
        raise ValueError(f"max_groups (Y) must be an int >= 1, got {max_groups!r}")
    if not (0 < alpha < 1):
        raise ValueError(f"alpha must lie in (0, 1), got {alpha!r}")
    seen = {1: float(f_min(1))}
    for y in range(2, max_groups + 1):
        seen[y] = float(f_min(y))
        if seen[y - 1] < seen[y]:
            return y - 1, seen
        if seen[y - 1] - seen[y] < alpha * seen[y - 1]:
            return y, seen
    return max(seen), seen
