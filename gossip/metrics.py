"""Deprecated: moved to :mod:`gossip.train.metrics`.

This path re-exports the public names of :mod:`gossip.train.metrics` for one release and
warns once, at import, with a ``DeprecationWarning`` naming the new path.
"""

from gossip import _moved
from gossip.train import metrics as _new

__moved_to__ = "gossip.train.metrics"
_moved.reexport(globals(), _new)
