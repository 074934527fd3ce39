"""Scheduling compressed communication (Wang et al. 2021, arXiv:2103.15195): the pieces MergeComp plans with.

* :class:`Partition` -- tensors in backward order cut into contiguous groups;
* :class:`CostModel`, :func:`fit_linear`, :func:`best_partition`, :func:`alg2` -- the
  linear cost model of Assumption 5, the exact best split for a number of groups, and
  Algorithm 2 over the number of groups.

MergeComp itself, a scheduling policy of the error-feedback family, lives with the
algorithms (:mod:`gossip.algorithms.mergecomp`; ``algorithms.build("efsgd", comm,
merge="auto")``); its names are still importable from here.
"""

from gossip.schedule.cost import CostModel, Linear, alg2, best_partition, fit_linear
from gossip.schedule.partition import MERGE_MODES, Partition, parse_merge

__all__ = [
    "CostModel",
    "DEFAULT_ALPHA",
    "Linear",
    "MERGE_MODES",
    "MergeComp",
    "MergeCompConfig",
    "MergeCompState",
    "Partition",
    "alg2",
    "best_partition",
    "fit_linear",
    "parse_merge",
]

_MOVED = ("DEFAULT_ALPHA", "MergeComp", "MergeCompConfig", "MergeCompState")


def __getattr__(name: str):
    if name in _MOVED:  # lazily: gossip.algorithms.mergecomp imports this package
        from gossip.algorithms import mergecomp

        return getattr(mergecomp, name)
    raise AttributeError(f"module 'gossip.schedule' has no attribute {name!r}")
