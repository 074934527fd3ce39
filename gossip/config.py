"""Deprecated: moved to :mod:`gossip.train.config`.

This path re-exports the public names of :mod:`gossip.train.config` for one release and
warns once, at import, with a ``DeprecationWarning`` naming the new path.
"""

from gossip import _moved
from gossip.train import config as _new

__moved_to__ = "gossip.train.config"
_moved.reexport(globals(), _new)
