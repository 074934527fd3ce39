"""Scheduling compressed communication: MergeComp (papers/004).

* :class:`Partition` -- tensors in backward order cut into contiguous groups;
* :class:`CostModel`, :func:`fit_linear`, :func:`best_partition`, :func:`alg2` -- the
  linear cost model of Assumption 5, the exact best split for a number of groups, and
  Algorithm 2 over the number of groups;
* :class:`MergeComp` -- dist-EF-SGD compressed and communicated group by group,
  overlapped with back-propagation (``gossip.train --algo efsgd --merge auto``).
"""

from gossip.schedule.cost import CostModel, Linear, alg2, best_partition, fit_linear
from gossip.schedule.mergecomp import DEFAULT_ALPHA, MergeComp, MergeCompConfig, MergeCompState
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
