"""gossip: a PyTorch runtime for communication-efficient distributed training."""

__version__ = "0.1.0"
__all__ = ["__version__"]
