"""Checks shared by the centralized-algorithm tests."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from gossip import algorithms, comm
from gossip.algorithms import ParamLayout


def random_grads(n: int, d: int, t: int, seed: int = 3) -> torch.Tensor:
    """(t, n, d) standard normal gradients: t steps of n nodes, seeded."""
    return torch.randn(t, n, d, generator=torch.Generator().manual_seed(seed))


def sign_ref(p: torch.Tensor, offsets: Sequence[int] = (0,)) -> torch.Tensor:
    """The scaled sign written plainly: ||p_b||_1 / d_b * sign(p_b) per block starting at
    ``offsets`` (0 counted as positive), the sums in float64."""
    out = torch.empty_like(p)
    bounds = list(offsets) + [p.numel()]
    for a, b in zip(bounds, bounds[1:]):
        blk = p[a:b].double()
        out[a:b] = (blk.abs().sum() / (b - a) * torch.where(blk < 0, -1.0, 1.0)).float()
    return out


def reduce_step(alg: Any, G: torch.Tensor, lr: float | None = None) -> torch.Tensor:
    """One ``reduce_gradients`` of a copy of the (n, d) gradients ``G`` (after ``set_lr(lr)``
    when given); the rewritten copy."""
    if lr is not None:
        alg.set_lr(lr)
    G = G.clone()
    alg.reduce_gradients(G)
    return G


def run_reduce(name: str, opts: dict, grads: torch.Tensor, lrs: Sequence[float] | None,
               layout: ParamLayout | None = None, c: comm.SimulatedCommunicator | None = None,
               ) -> tuple[torch.Tensor, Any, comm.SimulatedCommunicator]:
    """Build algorithm ``name`` with ``opts`` on a simulated world of ``grads.shape[1]``
    nodes (on ``c`` if given, whose ledger then adds this run's bytes), set it up on
    zeros with ``layout`` and reduce every step of ``grads`` (T, n, d) with ``lrs`` (one
    per step, or None); ``(the (T, n, d) reduced gradients, the algorithm, its
    communicator)``."""
    T_, n, d = grads.shape
    c = comm.SimulatedCommunicator(world_size=n) if c is None else c
    alg = algorithms.build(name, c, **opts)
    alg.setup(torch.zeros(n, d), layout)
    outs = [reduce_step(alg, grads[t], None if lrs is None else lrs[t]) for t in range(T_)]
    return torch.stack(outs), alg, c


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
        return reduce_step(alg, grads[t], None if lrs is None else lrs[t])

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
