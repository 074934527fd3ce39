"""CHOCO-SGD (Koloskova, Stich, Jaggi, ICML 2019, Algorithm 2): gossip with any
contractive compressor, biased ones (top-k, sign, unscaled random-k) included.

Node i, neighbours N(i), mixing weights W_ij (rows sum to 1), consensus step gamma,
compressor Q, local update u_i (``-eta * g_i`` for plain SGD):

    x_i^{t+1/2} = x_i^t + u_i^t                          (the local optimizer's step)
    q_i^t       = Q(x_i^{t+1/2} - xhat_i^t)               (sent to every neighbour)
    xhat_j^{t+1} = xhat_j^t + q_j^t      for j in N(i) and j = i
    x_i^{t+1}   = x_i^{t+1/2} + gamma sum_j W_ij (xhat_j^{t+1} - xhat_i^{t+1})

xhat_j is node j's public estimate; every neighbour of j and j itself hold the same
one, as they add the same decoded q_j. Memory is O(d) per node, whatever the degree:
a node keeps its own xhat_i and ``s_i = sum_j W_ij xhat_j`` (self included), updated
as ``s_i += W_ii q_i + sum_{j != i} W_ij q_j``, so that the last line is
``x_i^{t+1} = x_i^{t+1/2} + gamma (s_i - xhat_i)`` (rows of W sum to 1).
``track_replicas=True`` also keeps the deg x d per-neighbour estimates, for tests of
the invariants: every holder's copy of xhat_j equals node j's own bit for bit, and
``s_i`` equals ``sum_j W_ij xhat_j`` up to rounding (``replica_drift``).

The compressor must be a delta-contraction (``E||Q(x) - x||^2 <= (1 - delta) ||x||^2``:
topk, randomk, randomblock, sign, blocksign, identity) or unbiased with a declared
variance factor omega (quant, qsgd, ternary, randk), which is used as Q / (1 + omega),
a 1/(1+omega)-contraction (the paper's remark after its Assumption 1). Both sides apply
the factor to the decoded payload: the bytes on the wire are Q's own.

Start. With ``start="x1"`` (the default) the estimates start at x_1, exchanged once in
full precision (setup traffic in the ledger, like DCD's and ECD's replicas); the
compressor then carries only how far each model has moved. ``start="zero"`` is the
paper's xhat = 0: no setup traffic, but the compressor must first carry x_1 itself.

Local steps. With ``local_steps`` H > 1, steps t with t % H != 0 are local
(``x_i <- x_i + u_i``; nothing is sent and the estimates and ``s_i`` stay as they are)
and the four steps above run at t = H, 2H, ...: 1/H of the bytes. The step counter t
keeps counting every step, so the payload tags and random keys are those of the step
that gossips, and H = 1 is the algorithm above exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from gossip import compress as _compress
from gossip.algorithms._common import check_int, step_tag
from gossip.algorithms.base import ParamLayout
from gossip.algorithms.decentralized import GossipBase

__all__ = ["Choco", "ChocoConfig", "ChocoState"]

#: the starts of the estimates xhat: x_1 (exchanged at setup) or zero (the paper)
STARTS = ("x1", "zero")


def _guaranteed() -> list[str]:
    """Registered compressors CHOCO accepts: contractive, or unbiased with an omega."""
    out = []
    for name in _compress.available():
        try:
            c = _compress.build(name)
        except (ValueError, TypeError):
            continue
        if c.contractive or c.unbiased:
            out.append(name)
    return out


@dataclass(frozen=True, kw_only=True)
class ChocoConfig:
    """CHOCO-SGD: compressed differences to public estimates, consensus step ``gamma``.

    ``compressor``: any contraction or unbiased compressor (default ``sign``, the scaled
    sign ||x||_1/d sign(x), 1 bit per value). ``gamma`` in (0, 1]: the consensus step;
    1 with the identity compressor is adapt-then-combine D-PSGD. The default 0.1 is the
    largest of 0.02, 0.05, 0.1, 0.2, 0.5, 1 at which top-1% stays stable on a
    label-sorted ring of 8 (experiments/choco_gamma.py; it diverges from 0.2 on); scaled sign and the
    quantizers tolerate 1 and mix faster there. ``start``: ``"x1"`` or ``"zero"``, where
    the estimates start (module docstring). ``local_steps`` H: gossip only after every
    H-th step, local steps between (1: every step). ``track_replicas``: also keep each
    neighbour's estimate, for tests of the invariants.
    """

    compressor: str = "sign"
    gamma: float = 0.1
    seed: int = 0
    start: str = "x1"
    local_steps: int = 1
    track_replicas: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.compressor, str) or not self.compressor:
            raise TypeError(f"Arg `compressor` must be a compressor spec string, got {self.compressor!r}")
        c = _compress.build(self.compressor)  # raises a ValueError naming what is accepted
        if not (c.contractive or c.unbiased):
            raise ValueError(
                f"Arg `compressor` of choco must be a contraction or unbiased, got {self.compressor!r} "
                f"(declares neither); accepted: {', '.join(_guaranteed())}"
            )
        g = self.gamma
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not (0.0 < g <= 1.0) or not math.isfinite(g):
            raise ValueError(f"Arg `gamma` (consensus step) must be a number in (0, 1], got {g!r}")
        object.__setattr__(self, "gamma", float(g))
        check_int("seed", self.seed, minimum=0)
        if self.start not in STARTS:
            raise ValueError(f"Arg `start` must be one of {', '.join(map(repr, STARTS))}, got {self.start!r}")
        check_int("local_steps", self.local_steps, minimum=1)
        if not isinstance(self.track_replicas, bool):
            raise TypeError(f"Arg `track_replicas` must be a bool, got {self.track_replicas!r}")


@dataclass
class ChocoState:
    """Everything CHOCO's next step reads.

    ``t``: the step counter (1 at the first step; the payload tag and the random keys
    derive from it). ``xhat``: each hosted node's own public estimate, (m, d). ``mix``:
    ``s_i = sum_j W_ij xhat_j``, self included, (m, d). ``replicas``: with
    ``track_replicas``, each hosted node's copies of its padded neighbours' estimates,
    (m, D, d); empty otherwise.
    """

    t: int
    xhat: torch.Tensor
    mix: torch.Tensor
    replicas: torch.Tensor


class _Scaled:
    """A compressor whose decoded values are multiplied by ``factor``: Q / (1 + omega).

    Encoding and the bytes are the inner compressor's; sender and receivers scale
    the same decoded values the same way, so every holder's estimate stays identical.
    """

    def __init__(self, inner: Any, factor: float) -> None:
        self.inner = inner
        self.factor = factor

    def payload_nbytes(self, numel: int) -> int:
        return self.inner.payload_nbytes(numel)

    def encode(self, X: torch.Tensor, keys: torch.Tensor, tag: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.encode(X, keys, tag=tag, out=out)

    def decode(self, P: torch.Tensor, numel: int, tag: int | None = None, out: torch.Tensor | None = None,
               *, share: bool = False, intact: bool = False) -> torch.Tensor:
        kw = {"intact": True} if intact else {}  # only when asked: the inner decode takes it then
        if out is None:
            return self.inner.decode(P, numel, tag=tag, **kw) * self.factor
        return self.inner.decode(P, numel, tag=tag, out=out, **kw).mul_(self.factor)  # scaled in place: never a view


class Choco(GossipBase):
    """CHOCO-SGD, Koloskova et al. (2019) Algorithm 2; see the module docstring.

    Step 1:  x_i^{t+1/2} = x_i^t + u_i
    Step 2:  q_i = Q(x_i^{t+1/2} - xhat_i); send q_i, receive q_j from every neighbour
    Step 3:  xhat_i += q_i;  s_i += W_ii q_i + sum_{j != i} W_ij q_j
    Step 4:  x_i^{t+1} = x_i^{t+1/2} + gamma (s_i - xhat_i)
    With ``local_steps`` H > 1, steps t with t % H != 0 are local (x_i <- x_i + u_i,
    nothing sent, estimates unchanged) and steps 1-4 run at t = H, 2H, ...
    """

    name = "choco"
    fault_tolerant = True
    Config = ChocoConfig
    state_copies = 9
    summary = "CHOCO-SGD (Koloskova et al. 2019): compressed gossip that takes biased compressors (top-k, sign)"
    robust_refusal = (
        'its public copies x-hat add up every compressed message, so a clipped difference of one '
        "step does not bound what a Byzantine node has moved its copy by; ClippedGossip's guarantee"
        ' (arXiv:2202.01545) is for exact models')
    needs_static_graph = True

    def __init__(self, config: ChocoConfig, comm: Any) -> None:
        super().__init__(config, comm)
        self._q: Any = self.compressor  # what step() encodes and decodes: Q or Q / (1 + omega)

    @property
    def period(self) -> int:
        return self.config.local_steps

    def setup(self, X: torch.Tensor, layout: ParamLayout | None = None) -> None:
        m, d = X.shape
        self._take_layout(X, layout)
        c = self.compressor
        if c.contractive:
            self._q = c
        else:  # unbiased, with its variance factor for d values
            omega = c.omega(d)
            if omega is None:
                raise ValueError(f"choco: compressor {c.spec!r} is unbiased but declares no variance factor omega")
            self._q = c if omega == 0 else _Scaled(c, 1.0 / (1.0 + float(omega)))
        track = self.config.track_replicas
        replicas = X.new_zeros(0)
        if self.config.start == "zero":
            xhat = torch.zeros_like(X)
            mix = torch.zeros_like(X)
            if track:
                replicas = X.new_zeros(self._pad_idx.shape + (d,))
        else:
            # x_1 once in full precision: the estimates start exact on every holder
            with self.comm.ledger.setup():
                mix, rec = self._exact_mix(X)
            xhat = X.detach().clone()
            if track:
                ident = _compress.build("identity")
                replicas = self._received_rows(rec, d, step_tag(0), ident, X.dtype)
        self.state = ChocoState(t=1, xhat=xhat, mix=mix, replicas=replicas)

    def step(self, X: torch.Tensor, U: torch.Tensor) -> None:
        s = self.state
        t = s.t
        if t % self.config.local_steps:  # a local step: no gossip
            X.add_(U)
            s.t = t + 1
            return
        # Step 1 (the steps' temporaries live in buffers reused across steps)
        half = torch.add(X, U, out=self._buf("half", X.shape, X.dtype, X.device))
        # Step 2
        Z = torch.sub(half, s.xhat, out=self._buf("z", X.shape, X.dtype, X.device))
        own, mixed, rec, _ = self._gossip(Z, t, self._q, want_own=True)
        # Step 3
        s.xhat.add_(own)
        s.mix.add_(torch.mul(own, self._self_w(X), out=Z).add_(mixed))
        if s.replicas.numel():
            s.replicas.add_(self._received_rows(rec, X.shape[1], step_tag(t), self._q, X.dtype))
        # Step 4
        X.copy_(half.add_(torch.sub(s.mix, s.xhat, out=Z), alpha=self.config.gamma))
        s.t = t + 1

    # --- checks available in tracked mode ------------------------------------------
    def replica_sum(self, X: torch.Tensor) -> torch.Tensor:
        """sum_j W_ij xhat_j recomputed from the node's own estimate and the tracked copies."""
        s = self.state
        if s.replicas.numel() == 0:
            raise RuntimeError(f"{self.name}: construct with track_replicas=True to check replicas")
        w = self._pad_w64.to(X.dtype).unsqueeze(-1)
        return self._self_w(X) * s.xhat + (w * s.replicas).sum(dim=1)
