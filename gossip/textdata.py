"""Deprecated: moved to :mod:`gossip.data.text`.

This path re-exports the public names of :mod:`gossip.data.text` for one release and
warns once, at import, with a ``DeprecationWarning`` naming the new path.
"""

from gossip import _moved
from gossip.data import text as _new

__moved_to__ = "gossip.data.text"
_moved.reexport(globals(), _new)
