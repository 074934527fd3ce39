"""Data sets, their partition across nodes, and exactly resumable per-node batches.

Three pieces, used by the training CLI, each in a module of its own and all exported
here (``from gossip.data import build_dataset, ShardLoader``):

1. **A registry of data sets** (:mod:`gossip.data.datasets`). :func:`build_dataset`
   turns a name into a :class:`Dataset` (float32 inputs, int64 labels, a train and a
   test split, the task it declares); :func:`available_datasets` lists the names:
   ``mnist1d`` (default, generated locally and cached), ``cifar10`` (a local copy),
   ``synthetic`` (logistic-regression labels of Gaussian features), and ``text`` and
   ``wikitext2``, UTF-8 text as bytes for next-byte language modelling
   (:mod:`gossip.data.text`).
2. **Partitioning** (:func:`partition`, :mod:`gossip.data.loader`): ``iid`` gives every
   node an equal random shard; ``sorted`` gives every node a contiguous slice of the
   label-sorted data (the non-iid split of the decentralized-training papers).
3. **Per-node batches** (:class:`ShardLoader`): each node reshuffles its shard every
   epoch with its own generator; ``state_dict``/``load_state_dict`` resume mid-epoch
   with the identical batch sequence. :func:`build_loaders` makes one loader per node
   and :func:`stack_next` draws one batch from each into ``(n, B, ...)`` for the
   in-process simulation.

Seeds are non-negative integers; every generator here is derived from one with
:func:`numpy.random.SeedSequence` and a distinct stream number, so the partition, the
shuffles and the augmentation of different nodes never share a random stream.
Bad data raises :class:`DataError` (defined in :mod:`gossip.errors`).
"""

from __future__ import annotations

from gossip.data.datasets import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    CLASSIFICATION,
    FALLBACK_MODEL,
    LANGUAGE_MODEL,
    TASKS,
    TOKEN_DTYPE,
    Dataset,
    RandomCropFlip,
    available_datasets,
    build_dataset,
    dataset_options,
    default_cache_dir,
    default_model,
    register_dataset,
    token_ids,
)
from gossip.data.loader import (
    PARTITION_SCHEMES,
    ShardLoader,
    build_loaders,
    partition,
    partition_dataset,
    stack_next,
)
from gossip.errors import DataError

__all__ = [
    "CLASSIFICATION",
    "LANGUAGE_MODEL",
    "TASKS",
    "TOKEN_DTYPE",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "PARTITION_SCHEMES",
    "DataError",
    "Dataset",
    "RandomCropFlip",
    "ShardLoader",
    "available_datasets",
    "register_dataset",
    "default_model",
    "FALLBACK_MODEL",
    "build_dataset",
    "build_loaders",
    "dataset_options",
    "default_cache_dir",
    "partition",
    "partition_dataset",
    "stack_next",
    "token_ids",
]
