"""Deprecated: moved to :mod:`gossip.train.loop`.

This path re-exports the public names of :mod:`gossip.train.loop` for one release and
warns once, at import, with a ``DeprecationWarning`` naming the new path.
"""

from gossip import _moved
from gossip.train import loop as _new

__moved_to__ = "gossip.train.loop"
_moved.reexport(globals(), _new)
