"""Deprecated: moved to :mod:`gossip.tools.leaderboard`.

This path re-exports the public names of :mod:`gossip.tools.leaderboard` for one release
and warns once, at import, with a ``DeprecationWarning`` naming the new path.
"""

from gossip import _moved
from gossip.tools import leaderboard as _new

__moved_to__ = "gossip.tools.leaderboard"
_moved.reexport(globals(), _new)
