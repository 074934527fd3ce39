"""Helpers shared by the block-scaled stochastic quantizers (quant, qsgd, ternary)."""

from __future__ import annotations

import torch

from . import _kernels

__all__: list[str] = []


def block_size(block: int | None, d: int) -> int:
    return d if block is None or block >= d else block


def nblocks(block: int | None, d: int) -> int:
    B = block_size(block, d)
    return (d + B - 1) // B


def split(X: torch.Tensor, B: int):
    """Yield (x3, start, first_block): x3 is (m, nb, B) over full blocks, then the tail block."""
    m, d = X.shape
    nb = d // B
    if nb:
        yield X[:, : nb * B].view(m, nb, B), 0, 0
    if nb * B < d:
        yield X[:, nb * B:].reshape(m, 1, d - nb * B), nb * B, nb


def safe_inverse(L: float, R: torch.Tensor) -> torch.Tensor:
    """fp32 ``inv`` close to ``L / R`` with ``inv * R <= L`` exactly, 0 where R == 0.

    Rounded down when needed so that ``fl(v * inv) <= L`` for every ``0 <= v <= R``:
    codes never exceed the top level.
    """
    inv = torch.where(R > 0, L / R, torch.zeros_like(R))
    over = inv.double() * R.double() > L  # exact: a product of two fp32 fits in fp64
    return torch.where(over, torch.nextafter(inv, torch.zeros_like(inv)), inv)


def round_blocks(x3, a, s, keys, seeds, start: int, L: int, mode: int, out: torch.Tensor) -> None:
    """Stochastically round one block group into the integer codes ``out`` (m, nb, B)."""
    k = _kernels.SR.variant((mode, out.dtype, L))
    tie = _kernels.run(k, x3.numel(), x3, a, s, seeds, start, float(L), mode, out)
    if bool(tie.any()):
        _kernels.resolve_ties(out, tie, x3, a, s, keys, start, float(L), mode)


def minmax(x3: torch.Tensor):
    """Per-block (min, max), each (m, nb, 1)."""
    return _kernels.run(_kernels.MINMAX, x3.numel(), x3)


def absmax(x3: torch.Tensor) -> torch.Tensor:
    """Per-block max |x|, (m, nb, 1)."""
    return _kernels.run(_kernels.ABSMAX, x3.numel(), x3)


def ordered_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in float64, in index order: (..., n) -> (...) float64.

    The scales that travel (L1 and L2 norms) must not depend on how many rows are
    encoded together or on the backend, or a row alone and the same row in a batch
    would give different bytes. ATen's vectorised reductions choose their
    accumulation order from the tensor's shape, so the sum is taken as a sequential
    float64 prefix sum instead (error about n * 2**-53 relative).
    """
    return v.to(torch.float64).cumsum(dim=-1)[..., -1]
