"""gossip: a PyTorch runtime for communication-efficient distributed training.

Subpackages: :mod:`gossip.compress` (compressors and the wire format),
:mod:`gossip.comm` (communicators and the ledger), :mod:`gossip.algorithms` (the
algorithm contract and every algorithm), :mod:`gossip.ddp` (the centralized
algorithms as DistributedDataParallel communication hooks). The graphs live in the separate, torch-free
package :mod:`topologies`. The training CLI is ``python -m gossip.train``.

``import gossip`` is cheap: the names below load their modules on first use.
"""

__version__ = "0.1.0"
__all__ = ["FlatParams", "GossipOptimizer", "__version__"]


def __getattr__(name: str):
    if name in ("FlatParams", "GossipOptimizer"):
        from gossip import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'gossip' has no attribute {name!r}")
