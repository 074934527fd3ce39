"""Checks shared by the centralized-algorithm tests."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from gossip import comm
from gossip.algorithms import ParamLayout


def layout_of(offsets: Sequence[int] | None, d: int) -> ParamLayout | None:
    """A layout of 1-D tensors starting at ``offsets`` in a flat vector of ``d`` values
    (None: no layout, one tensor)."""
    if offsets is None:
        return None
    bounds = list(offsets) + [d]
    return ParamLayout(tuple((b - a,) for a, b in zip(bounds, bounds[1:])))


def assert_restore_bit_identical(
    build: Callable[[Any], Any], grads: torch.Tensor, split: int, lrs: Sequence[float] | None = None,
    layout: ParamLayout | None = None,
) -> None:
    """Run ``split`` steps, save the state, run the rest; a fresh algorithm restored from
    that state must produce the same rewritten gradients bit for bit.

    ``build(communicator)`` returns a new algorithm; ``grads`` is (T, n, d); ``lrs``
    (one per step) are passed to ``set_lr`` when given.
    """
    T_, n, d = grads.shape

    def step(alg: Any, t: int) -> torch.Tensor:
        if lrs is not None:
            alg.set_lr(lrs[t])
        G = grads[t].clone()
        alg.reduce_gradients(G)
        return G

    a = build(comm.SimulatedCommunicator(world_size=n))
    a.setup(torch.zeros(n, d), layout)
    for t in range(split):
        step(a, t)
    sd = a.state_dict()
    cont = [step(a, t) for t in range(split, T_)]
    b = build(comm.SimulatedCommunicator(world_size=n))
    b.setup(torch.zeros(n, d), layout)
    b.load_state_dict(sd)
    for t in range(split, T_):
        assert torch.equal(step(b, t), cont[t - split]), f"step {t + 1} differs after the restore"
