"""gossip: a PyTorch runtime for communication-efficient distributed training.

Subpackages: :mod:`gossip.compress` (compressors and the wire format),
:mod:`gossip.comm` (communicators and the ledger), :mod:`gossip.algorithms`
(allreduce, dpsgd, naive, dcd, ecd). The graphs live in the separate, torch-free
package :mod:`topologies`. The training CLI is ``python -m gossip.train``.
"""

from gossip.runtime import FlatParams, GossipOptimizer

__version__ = "0.1.0"
__all__ = ["FlatParams", "GossipOptimizer", "__version__"]
