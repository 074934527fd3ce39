"""What the data modules share: argument checks and the derived random streams.

Seeds are non-negative integers; every generator of :mod:`gossip.data` is derived from
one with :func:`numpy.random.SeedSequence` and a distinct stream number, so the
partition, the shuffles and the augmentation of different nodes never share a random
stream.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gossip._checks import check_int

# Stream numbers for derived generators: one per use, so streams never overlap.
_STREAM_PARTITION = 1
_STREAM_SHUFFLE = 2
_STREAM_TRANSFORM = 3
_STREAM_SYNTHETIC = 4


def _check_int(name: str, value: Any, *, minimum: int) -> int:
    return check_int(name, value, minimum=minimum)


def _check_seed(seed: Any, name: str = "seed") -> int:
    seed = _check_int(name, seed, minimum=0)
    if seed >= 2**63:
        raise ValueError(f"{name} must be < 2**63, got {seed}")
    return seed


def _derive_seed(seed: int, *stream: int) -> int:
    """A 64-bit seed for the stream ``(seed, *stream)``, well mixed and platform independent."""
    state = np.random.SeedSequence([seed, *stream]).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 32 | int(state[1])) & (2**63 - 1)


def _generator(seed: int, *stream: int) -> torch.Generator:
    return torch.Generator().manual_seed(_derive_seed(seed, *stream))

