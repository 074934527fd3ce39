"""Scheduling compressed communication: the pieces of MergeComp (papers/004).

* :class:`Partition` -- tensors in backward order cut into contiguous groups;
* :class:`CostModel`, :func:`fit_linear`, :func:`best_partition`, :func:`alg2` -- the
  linear cost model of Assumption 5, the exact best split for a number of groups, and
  Algorithm 2 over the number of groups.

MergeComp itself, dist-EF-SGD compressed and communicated group by group and
overlapped with back-propagation, is a scheduling policy of the EF family:
``gossip.algorithms.build("efsgd", comm, merge="auto")`` (``gossip.algorithms.mergecomp``;
``gossip.train --algo efsgd --merge auto``).
"""

from gossip.schedule.cost import DEFAULT_ALPHA, CostModel, Linear, alg2, best_partition, fit_linear
from gossip.schedule.partition import MERGE_MODES, Partition, parse_merge

__all__ = [
    "CostModel",
    "DEFAULT_ALPHA",
    "Linear",
    "MERGE_MODES",
    "Partition",
    "alg2",
    "best_partition",
    "fit_linear",
    "parse_merge",
]
