"""Deprecated: moved to :mod:`gossip.train.fault_tolerance`.

This path re-exports the public names of :mod:`gossip.train.fault_tolerance` for one release and
warns once, at import, with a ``DeprecationWarning`` naming the new path.
"""

from gossip import _moved
from gossip.train import fault_tolerance as _new

__moved_to__ = "gossip.train.fault_tolerance"
_moved.reexport(globals(), _new)
