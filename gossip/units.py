"""Deprecated: moved to :mod:`gossip.tools.units`.

This path re-exports the public names of :mod:`gossip.tools.units` for one release
and warns once, at import, with a ``DeprecationWarning`` naming the new path.
"""

from gossip import _moved
from gossip.tools import units as _new

__moved_to__ = "gossip.tools.units"
_moved.reexport(globals(), _new)
