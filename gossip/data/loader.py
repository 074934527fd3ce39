"""The partition of a data set across nodes, and exactly resumable per-node batches.

1. **Partitioning** (:func:`partition`): ``iid`` gives every node an equal random
   shard; ``sorted`` gives every node a contiguous slice of the label-sorted data (the
   non-iid split of the decentralized-training papers).
2. **Per-node batches** (:class:`ShardLoader`): each node reshuffles its shard every
   epoch with its own generator; ``state_dict``/``load_state_dict`` resume mid-epoch
   with the identical batch sequence. :func:`build_loaders` makes one loader per node
   and :func:`stack_next` draws one batch from each into ``(n, B, ...)`` for the
   in-process simulation.

Seeds are non-negative integers; every generator here is derived from one with
:func:`numpy.random.SeedSequence` and a distinct stream number, so the partition, the
shuffles and the augmentation of different nodes never share a random stream.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor

from gossip.data._common import (_STREAM_PARTITION, _STREAM_SHUFFLE, _STREAM_TRANSFORM, _check_int, _check_seed,
                                 _generator)
from gossip.data.datasets import CLASSIFICATION, Dataset, token_ids

__all__ = [
    "PARTITION_SCHEMES",
    "ShardLoader",
    "build_loaders",
    "partition",
    "partition_dataset",
    "stack_next",
]

PARTITION_SCHEMES = ("iid", "sorted")


# --------------------------------------------------------------------------- partition


def partition(y: Tensor | Sequence[int], world_size: int, scheme: str = "iid", seed: int = 0) -> list[Tensor]:
    """Split the sample indices ``0..len(y)-1`` into ``world_size`` disjoint equal shards.

    - ``iid``: a random permutation drawn from ``seed``, cut into consecutive shards.
    - ``sorted``: the indices sorted by label (stably, so equal labels keep their
      order), cut into consecutive shards; node ``k`` sees a contiguous slice of the
      label-sorted data, hence only one or a few classes. ``seed`` is not used.

    Every shard has ``len(y) // world_size`` indices: the remaining
    ``len(y) % world_size`` samples (the tail of the permutation, or the last ones in
    label order) are dropped, so that every node takes the same number of steps per
    epoch. Returns a list of int64 tensors.
    """
    if scheme not in PARTITION_SCHEMES:
        raise ValueError(f"unknown partition scheme {scheme!r}; known: {', '.join(PARTITION_SCHEMES)}")
    world_size = _check_int("world_size", world_size, minimum=1)
    seed = _check_seed(seed)
    labels = torch.as_tensor(y)
    if labels.dim() != 1:
        raise ValueError(f"y must be 1-D (one label per sample), got shape {tuple(labels.shape)}")
    n = labels.shape[0]
    if n < world_size:
        raise ValueError(f"cannot split {n} samples into world_size = {world_size} non-empty shards")
    if scheme == "iid":
        order = torch.randperm(n, generator=_generator(seed, _STREAM_PARTITION))
    else:
        order = torch.sort(labels, stable=True).indices
    shard = n // world_size
    return [order[k * shard:(k + 1) * shard].clone() for k in range(world_size)]


def partition_dataset(dataset: Dataset, world_size: int, scheme: str = "iid", seed: int = 0) -> list[Tensor]:
    """The training examples' indices split over ``world_size`` nodes, by the data set's task.

    Classification: :func:`partition` of the labels. Language modelling: the windows
    of the training text, ``iid`` a random equal share per node, ``sorted`` a
    contiguous segment of the text per node (node 0 the beginning), the natural
    non-iid split of text. Either way every shard has ``num_train // world_size``
    examples.
    """
    if dataset.task == CLASSIFICATION:
        return partition(dataset.y_train, world_size, scheme, seed)
    # windows in text order play the part of the label order
    return partition(torch.zeros(dataset.num_train, dtype=torch.int64), world_size, scheme, seed)


# --------------------------------------------------------------------------- loader


class ShardLoader:
    """One node's batches over its shard, reshuffled every epoch, exactly resumable.

    Each epoch draws a fresh permutation of ``indices`` from the loader's own
    generator (seeded from ``(seed, node)``) and serves it in slices of
    ``batch_size``. With ``drop_last=True`` (the default) every batch is full and an
    epoch has ``len(indices) // batch_size`` steps, the last partial batch being
    dropped (a different part of the shard each epoch); with ``drop_last=False`` the
    last batch of an epoch is smaller.

    ``next_batch()`` returns ``(x, y)`` and rolls over into the next epoch by itself;
    iterating the loader yields the rest of the current epoch. ``transform``, if given,
    is applied as ``transform(x, generator)`` with a second generator of the loader's
    own (training augmentation). ``state_dict()`` captures the epoch, the position in
    it and both generator states (as uint8 tensors); ``load_state_dict`` on a loader
    built with the same arguments continues with the identical batch sequence.
    ``device``, if given, is where the batches are moved (the data set may stay on
    the CPU); the transform runs there.
    """

    def __init__(
        self,
        dataset_x: Tensor,
        dataset_y: Tensor,
        indices: Tensor | Sequence[int],
        batch_size: int,
        seed: int,
        node: int,
        *,
        drop_last: bool = True,
        transform: Callable[[Tensor, torch.Generator], Tensor] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if not isinstance(dataset_x, Tensor) or not isinstance(dataset_y, Tensor):
            raise TypeError("dataset_x and dataset_y must be tensors")
        if dataset_x.shape[0] != dataset_y.shape[0]:
            raise ValueError(
                f"dataset_x and dataset_y must have the same length, got {dataset_x.shape[0]} and {dataset_y.shape[0]}"
            )
        idx = torch.as_tensor(indices)
        if idx.dim() != 1 or idx.numel() == 0 or idx.dtype.is_floating_point or idx.dtype == torch.bool:
            raise ValueError(f"indices must be a non-empty 1-D integer tensor, got {idx.dtype} {tuple(idx.shape)}")
        idx = idx.to(torch.int64)
        if int(idx.min()) < 0 or int(idx.max()) >= dataset_x.shape[0]:
            raise ValueError(f"indices must lie in [0, {dataset_x.shape[0]}), got [{int(idx.min())}, {int(idx.max())}]")
        self.batch_size = _check_int("batch_size", batch_size, minimum=1)
        self.seed = _check_seed(seed)
        self.node = _check_int("node", node, minimum=0)
        self.drop_last = bool(drop_last)
        if self.drop_last and idx.numel() < self.batch_size:
            raise ValueError(
                f"batch_size {self.batch_size} exceeds the shard size {idx.numel()} of node {self.node} "
                f"with drop_last=True (no batch would ever be served)"
            )
        self.x, self.y, self.indices = dataset_x, dataset_y, idx
        self.transform = transform
        self.device = torch.device(device) if device is not None else None
        self._shuffle_gen = _generator(self.seed, _STREAM_SHUFFLE, self.node)
        self._transform_gen = _generator(self.seed, _STREAM_TRANSFORM, self.node)
        self._epoch = 0
        self._start_epoch()

    # The state of the shuffle generator *before* an epoch's permutation is what a
    # checkpoint stores: reloading it redraws the same permutation.
    def _start_epoch(self) -> None:
        self._epoch_state = self._shuffle_gen.get_state()
        self._perm = torch.randperm(self.indices.numel(), generator=self._shuffle_gen)
        self._position = 0

    @property
    def shard_size(self) -> int:
        return int(self.indices.numel())

    @property
    def steps_per_epoch(self) -> int:
        if self.drop_last:
            return self.shard_size // self.batch_size
        return -(-self.shard_size // self.batch_size)

    @property
    def epoch(self) -> int:
        """Epochs completed (0 during the first one)."""
        return self._epoch

    @property
    def position(self) -> int:
        """Batches already served in the current epoch."""
        return self._position

    def __len__(self) -> int:
        return self.steps_per_epoch

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """The next ``(x, y)`` batch, starting a new epoch when the current one is done."""
        if self._position >= self.steps_per_epoch:
            self._epoch += 1
            self._start_epoch()
        lo = self._position * self.batch_size
        rows = self.indices[self._perm[lo:lo + self.batch_size]].to(self.x.device)
        self._position += 1
        x, y = self.x[rows], self.y[rows.to(self.y.device)]
        if self.device is not None:
            x, y = x.to(self.device), y.to(self.device)
        x = token_ids(x)  # token ids as a model takes them; moved as they are stored (uint8: 1/8 of the bytes)
        if self.transform is not None:
            x = self.transform(x, self._transform_gen)
        return x, y

    def epoch_rows(self) -> Tensor:
        """The data-set rows of the current epoch in serving order (a new epoch begins
        first when this one is done): batch ``k`` is ``rows[k * B:(k + 1) * B]``. With
        :meth:`skip`, a reader that gathers the batches of many loaders at once
        (``gossip.vectorized``) serves each node exactly what ``next_batch`` would."""
        if self._position >= self.steps_per_epoch:
            self._epoch += 1
            self._start_epoch()
        return self.indices[self._perm]

    def skip(self, batches: int) -> None:
        """Count ``batches`` more batches of the current epoch as served (read through
        :meth:`epoch_rows`); the state then continues exactly as after as many ``next_batch``."""
        batches = _check_int("batches", batches, minimum=0)
        if self._position + batches > self.steps_per_epoch:
            raise ValueError(
                f"skip({batches}) at position {self._position} runs past the epoch's {self.steps_per_epoch} batches"
            )
        self._position += batches

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        """The remaining batches of the current epoch (all of the next one if it is done)."""
        if self._position >= self.steps_per_epoch:
            self._epoch += 1
            self._start_epoch()
        while self._position < self.steps_per_epoch:
            yield self.next_batch()

    def _identity(self) -> dict[str, int | bool]:
        return {"seed": self.seed, "node": self.node, "shard_size": self.shard_size,
                "batch_size": self.batch_size, "drop_last": self.drop_last}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly here; tensors, ints and bools only."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "shuffle_generator": self._epoch_state.clone(),
            "transform_generator": self._transform_gen.get_state(),
            **self._identity(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``; the loader must have been built with the same arguments."""
        required = ("epoch", "position", "shuffle_generator", "transform_generator", *self._identity())
        missing = [k for k in required if k not in state]
        if missing:
            raise ValueError(f"ShardLoader state lacks {', '.join(missing)}")
        for key, mine in self._identity().items():
            if state[key] != mine:
                raise ValueError(f"ShardLoader state was saved with {key} = {state[key]!r}, this loader has {mine!r}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.steps_per_epoch:
            raise ValueError(
                f"ShardLoader state has epoch {epoch}, position {position}; expected epoch >= 0 and "
                f"0 <= position <= {self.steps_per_epoch}"
            )
        self._shuffle_gen.set_state(state["shuffle_generator"])
        self._transform_gen.set_state(state["transform_generator"])
        self._epoch = epoch
        self._start_epoch()
        self._position = position


def build_loaders(
    x: Tensor,
    y: Tensor,
    world_size: int,
    batch_size: int,
    *,
    scheme: str = "iid",
    seed: int = 0,
    nodes: Sequence[int] | None = None,
    drop_last: bool = True,
    transform: Callable[[Tensor, torch.Generator], Tensor] | None = None,
) -> list[ShardLoader]:
    """Partition ``(x, y)`` over ``world_size`` nodes and build the loaders of ``nodes``.

    ``nodes`` defaults to all of them (the in-process simulation); under torchrun pass
    ``[rank]``. Every process computes the same partition from ``seed``.
    """
    shards = partition(y, world_size, scheme, seed)
    chosen = range(world_size) if nodes is None else nodes
    loaders = []
    for k in chosen:
        k = _check_int("node", k, minimum=0)
        if k >= world_size:
            raise ValueError(f"node must be < world_size = {world_size}, got {k}")
        loaders.append(ShardLoader(x, y, shards[k], batch_size, seed, k, drop_last=drop_last, transform=transform))
    return loaders


def stack_next(loaders: Sequence[ShardLoader]) -> tuple[Tensor, Tensor]:
    """One batch from each loader, stacked: ``x`` shaped ``(n, B, ...)``, ``y`` ``(n, B)``."""
    if not loaders:
        raise ValueError("stack_next needs at least one loader")
    batches = [loader.next_batch() for loader in loaders]
    sizes = {tuple(b[0].shape) for b in batches}
    if len(sizes) != 1:
        raise ValueError(f"cannot stack batches of different shapes {sorted(sizes)}; use drop_last=True")
    return torch.stack([b[0] for b in batches]), torch.stack([b[1] for b in batches])
