"""Pieces shared by the algorithm families: per-node random keys and config checks."""

from __future__ import annotations

from gossip._checks import check_int as _check_int

import numpy as np
import torch

__all__: list[str] = []

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return x ^ (x >> np.uint64(31))


def node_keys(seed: int, nodes: torch.Tensor, step: int, stream: int = 0) -> torch.Tensor:
    """One int64 random key per hosted node for (seed, node, step, stream).

    Keys are a pure function of their arguments, so node j draws the same key whether
    it is hosted alone under torchrun or next to a thousand others in the simulation,
    and a restored run draws exactly the keys it would have drawn. ``stream`` separates
    independent uses within one step.
    """
    ids = nodes.detach().cpu().numpy().astype(np.uint64)
    with np.errstate(over="ignore"):
        h = _splitmix64(np.full_like(ids, np.uint64(seed & 0xFFFFFFFFFFFFFFFF)))
        h = _splitmix64(h ^ ids)
        h = _splitmix64(h ^ np.uint64(step & 0xFFFFFFFFFFFFFFFF))
        h = _splitmix64(h ^ np.uint64(stream & 0xFFFFFFFFFFFFFFFF))
    return torch.from_numpy(h.view(np.int64).copy())


def shared_key(seed: int, step: int, stream: int = 0) -> int:
    """One int64 key that every node computes identically (shared randomness)."""
    k = node_keys(seed, torch.zeros(1, dtype=torch.int64), step, stream + (1 << 40))
    return int(k[0])


def step_tag(step: int) -> int:
    """The 32-bit tag that goes in every payload header of a step."""
    return step & 0xFFFFFFFF


def check_int(name: str, value, *, minimum: int) -> None:
    """An algorithm Config's integer option (the shared check, ``Arg `name``` in messages)."""
    _check_int(f"Arg `{name}`", value, minimum=minimum)
