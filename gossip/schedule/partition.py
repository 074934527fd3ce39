"""Partitions of a model's gradient tensors into contiguous groups (Wang et al. 2021, arXiv:2103.15195, Sec. 4).

A model's N gradient tensors are taken in the order back-propagation produces them
(``order``: parameter indices, first produced first). A partition cuts that sequence
into y contiguous groups, given by the number of tensors in each group (``sizes``).
The scheduler lays the gradients out in backward order, so every group is one
contiguous slice of its flat gradient buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["Partition", "parse_merge", "MERGE_MODES"]

#: the named modes of ``--merge`` (an integer N >= 1 is the fourth kind)
MERGE_MODES = ("layer", "whole", "auto")


@dataclass(frozen=True)
class Partition:
    """``sizes[k]`` tensors in group k, in backward order; ``sum(sizes) == N``."""

    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        try:
            sizes = tuple(int(s) for s in self.sizes)
        except (TypeError, ValueError):
            raise TypeError(f"Partition sizes must be a sequence of ints, got {self.sizes!r}") from None
        if not sizes or any(s < 1 for s in sizes):
            raise ValueError(f"Partition sizes must be a non-empty sequence of ints >= 1, got {sizes}")
        object.__setattr__(self, "sizes", sizes)

    # ---------------------------------------------------------------- constructors
    @classmethod
    def layer(cls, n: int) -> "Partition":
        """One group per tensor: layer-wise compression."""
        return cls((1,) * _check_n(n))

    @classmethod
    def whole(cls, n: int) -> "Partition":
        """One group: the whole model compressed and sent at once."""
        return cls((_check_n(n),))

    @classmethod
    def from_bounds(cls, bounds: Sequence[int], n: int) -> "Partition":
        """From the group start indices (first 0, strictly increasing, < n)."""
        b = [int(x) for x in bounds]
        if not b or b[0] != 0 or any(q <= p for p, q in zip(b, b[1:])) or b[-1] >= n:
            raise ValueError(f"group starts must begin at 0, increase strictly and stay < {n}, got {b}")
        return cls(tuple(q - p for p, q in zip(b, b[1:] + [n])))

    # ---------------------------------------------------------------- views
    @property
    def groups(self) -> int:
        return len(self.sizes)

    @property
    def tensors(self) -> int:
        return sum(self.sizes)

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        """(first, end) tensor positions in backward order of each group."""
        out, a = [], 0
        for s in self.sizes:
            out.append((a, a + s))
            a += s
        return tuple(out)

    def group_of(self) -> tuple[int, ...]:
        """Group index of each tensor position."""
        return tuple(k for k, s in enumerate(self.sizes) for _ in range(s))

    def numels(self, tensor_numels: Sequence[int]) -> tuple[int, ...]:
        """Values per group, given the tensors' sizes in backward order."""
        if len(tensor_numels) != self.tensors:
            raise ValueError(
                f"the partition covers {self.tensors} tensors, got sizes of {len(tensor_numels)}"
            )
        return tuple(sum(tensor_numels[a:b]) for a, b in self.bounds)

    def __str__(self) -> str:
        return f"{self.groups} group(s) of {list(self.sizes)} tensors"


def _check_n(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of tensors must be an int >= 1, got {n!r}")
    return n


def parse_merge(value: object) -> str | int:
    """``--merge`` value: 'layer', 'whole', 'auto' or an integer N >= 1 (as int or text).

    Raises ValueError with one line naming what is accepted.
    """
    accepted = "accepted: layer, whole, auto or a number of groups N >= 1"
    if isinstance(value, bool):
        raise ValueError(f"--merge {value!r} is not valid; {accepted}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"--merge {value} is not valid; {accepted}")
        return value
    if isinstance(value, str):
        v = value.strip().lower()
        if v in MERGE_MODES:
            return v
        if v.isdigit() and int(v) >= 1:
            return int(v)
    raise ValueError(f"--merge {value!r} is not valid; {accepted}")
