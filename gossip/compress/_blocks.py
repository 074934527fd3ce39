"""Helpers shared by the block-scaled stochastic quantizers (quant, qsgd, ternary)."""

from __future__ import annotations

import torch

from . import _kernels

__all__: list[str] = []


def check_block(cfg) -> None:
    """The ``block`` parameter of a block-scaled quantizer's Config."""
    b = cfg.block
    if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
        cfg._fail("block", "must be a positive integer (elements per block) or omitted for one block per row")


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


def round_group(x3, a, s, keys, seeds, start: int, b0: int, B: int, L: int, mode: int, out) -> None:
    """Stochastically round a group from ``split`` (first block b0 of full size B) into ``out``."""
    _kernels.stochastic_round(x3, a, s, keys, seeds, start, L, mode, out)


def scale_group(x3, keys, seeds, start: int, b0: int, B: int, L: int, mode: int, out):
    """Block scales (a, R, s) and rounding of a group from ``split`` (modes 0 and 2)."""
    return _kernels.scale_and_round(x3, keys, seeds, start, L, mode, out)


safe_inverse = _kernels.safe_inverse


def divide(x: torch.Tensor, c: float) -> torch.Tensor:
    """``x / c`` correctly rounded on every device.

    CUDA's true division by a Python (or CPU) scalar multiplies by the scalar's
    reciprocal, which differs from the division in the last bit for most values; the
    scales that travel must be the same bytes on CPU and CUDA, so the divisor is a
    tensor of x's shape on x's device (an element-wise IEEE division everywhere).
    """
    return torch.div(x, torch.full_like(x, c))


def ordered_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in float64, in index order: (..., n) -> (...) float64.

    The scales that travel (L1 and L2 norms) must not depend on how many rows are
    encoded together or on the backend, or a row alone and the same row in a batch
    would give different bytes. ATen's vectorised reductions choose their
    accumulation order from the tensor's shape, so the sum is taken as a sequential
    float64 prefix sum instead (error about n * 2**-53 relative).
    """
    return v.to(torch.float64).cumsum(dim=-1)[..., -1]
