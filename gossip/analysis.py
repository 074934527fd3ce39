"""Deprecated: moved to :mod:`gossip.tools.analysis`.

This path re-exports the public names of :mod:`gossip.tools.analysis` for one release
and warns once, at import, with a ``DeprecationWarning`` naming the new path.
"""

from gossip import _moved
from gossip.tools import analysis as _new

__moved_to__ = "gossip.tools.analysis"
_moved.reexport(globals(), _new)
