"""Pieces shared by the centralized (compressed all-reduce) algorithms.

* :class:`ErrorFeedback` wraps any compressor: it sends ``C(x + s e)`` and keeps
  ``e <- (x + s e) - C(x + s e)``, so that ``sent + new error == to be sent``.
* :class:`CentralizedBase` is the base of the algorithms that own their step size and
  momentum: they get the current learning rate through :meth:`CentralizedBase.set_lr`
  and rewrite the gradient into the final *direction* ``D`` such that a plain SGD step
  ``x <- x - lr * D`` (user optimizer with momentum 0) performs the paper's update.
* Config checks shared by their Configs.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gossip import compress as _compress
from gossip._checks import check_float
from gossip.algorithms.base import Pending, Algorithm

__all__ = ["CentralizedBase"]


class ErrorFeedback:
    """Error feedback around a compressor (a wrapper: it works with any of them).

    ``__call__(X, memory, rescale=s, keys=..., tag=...)``:

    1. ``P = X + s * memory`` (``s = 0`` means the memory is ignored, as at the
       first step where ``eta_{-1} = 0``);
    2. ``payload = C.encode(P)`` and ``sent = C.decode(payload)``;
    3. ``memory <- P - sent`` (in place), so ``sent + memory == P`` to rounding.

    Returns ``(P, payload, sent)``. The memory is owned by the caller's State, so
    it is saved and restored with it.
    """

    def __init__(self, compressor: Any) -> None:
        self.compressor = compressor

    def __call__(
        self,
        X: torch.Tensor,
        memory: torch.Tensor,
        *,
        rescale: float,
        keys: torch.Tensor,
        tag: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # 1. error-corrected vector; s = 0 must not touch the memory (it may hold
        #    anything after a restore with a different schedule)
        if rescale == 0.0:
            P = X.clone()
        elif rescale == 1.0:  # 1 * e is e: the same values, one pass over the memory fewer
            P = X + memory
        else:
            P = X + rescale * memory
        # 2. what goes on the wire and what the receivers will decode
        payload = self.compressor.encode(P, keys, tag=tag)
        sent = self.compressor.decode(payload, P.shape[1], tag=tag).to(P.dtype)
        # 3. the part that was not sent is carried to the next step, written in place
        if memory.dtype == P.dtype:
            torch.sub(P, sent, out=memory)
        else:
            memory.copy_(P - sent)
        return P, payload, sent

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.compressor.spec})"


class CentralizedBase(Algorithm):
    """Gradient algorithms that own their step-size rescaling and momentum.

    ``set_lr(lr)`` must be called with the step size ``eta_t`` of the coming step
    before :meth:`reduce_gradients` (the training loop does it every step). Without
    any call the step size is taken as constant (``eta_t / eta_{t-1} = 1``).
    """

    shards_flat = True

    acts_on = "gradient"
    decentralized = False
    #: the compressed direction is the whole update: no local momentum unless asked for
    local_momentum_default = 0.0

    def set_lr(self, lr: float) -> None:
        """Tell the algorithm the step size ``eta_t`` the optimizer will use next."""
        if isinstance(lr, bool) or not isinstance(lr, (int, float)):
            raise TypeError(f"Arg `lr` must be a number, got {type(lr).__name__} {lr!r}")
        if not math.isfinite(lr) or lr <= 0:
            raise ValueError(f"Arg `lr` must be a positive finite number, got {lr}")
        if self.state is None:
            raise RuntimeError(f"{self.name}: call setup() before set_lr()")
        self.state.lr = float(lr)

    def _lr_ratio(self) -> float:
        """eta_{t-1} / eta_t, with eta_{-1} = 0 (Zheng et al. 2019, arXiv:1905.10936, Alg. 2 line 1)."""
        return self.state.prev_lr / self.state.lr


def check_spec(spec: Any, algo: str) -> Any:
    if not isinstance(spec, str) or not spec:
        raise TypeError(
            f"Arg `compressor` of {algo} must be a compressor spec string, got {spec!r}"
        )
    return _compress.build(spec)  # raises a ValueError naming what is accepted


def check_fraction(name: str, value: Any, *, lo_open: bool = False) -> None:
    """``0 <= value < 1`` (``0 < value < 1`` with ``lo_open``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"Arg `{name}` must be a number, got {type(value).__name__} {value!r}")
    try:
        check_float(f"Arg `{name}`", value, lo=0.0, hi=1.0, lo_open=lo_open, hi_open=True)
    except ValueError:  # the historical wording names the argument in the rule
        rule = "0 < {0} < 1" if lo_open else "0 <= {0} < 1"
        raise ValueError(f"Arg `{name}` must satisfy {rule.format(name)}, got {value}") from None
