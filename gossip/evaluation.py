"""Deprecated: moved to :mod:`gossip.train.evaluation`.

This path re-exports the public names of :mod:`gossip.train.evaluation` for one release and
warns once, at import, with a ``DeprecationWarning`` naming the new path.
"""

from gossip import _moved
from gossip.train import evaluation as _new

__moved_to__ = "gossip.train.evaluation"
_moved.reexport(globals(), _new)
