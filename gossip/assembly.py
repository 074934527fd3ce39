"""Deprecated: moved to :mod:`gossip.train.assembly`.

This path re-exports the public names of :mod:`gossip.train.assembly` for one release and
warns once, at import, with a ``DeprecationWarning`` naming the new path.
"""

from gossip import _moved
from gossip.train import assembly as _new

__moved_to__ = "gossip.train.assembly"
_moved.reexport(globals(), _new)
