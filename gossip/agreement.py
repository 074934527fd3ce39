"""Deprecated: moved to :mod:`gossip.train.agreement`.

This path re-exports the public names of :mod:`gossip.train.agreement` for one release and
warns once, at import, with a ``DeprecationWarning`` naming the new path.
"""

from gossip import _moved
from gossip.train import agreement as _new

__moved_to__ = "gossip.train.agreement"
_moved.reexport(globals(), _new)
