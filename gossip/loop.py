"""Deprecated: moved to :mod:`gossip.train.loop`.

This path re-exports the public names of :mod:`gossip.train.loop` for one release and
warns once, at import, with a ``DeprecationWarning`` naming the new path.
"""

import warnings as _warnings

_warnings.warn("gossip.loop is deprecated: it moved to gossip.train.loop; import that instead",
               DeprecationWarning, stacklevel=2)

from gossip.train import loop as _moved  # noqa: E402

globals().update({_k: _v for _k, _v in vars(_moved).items() if not _k.startswith("_")})
__all__ = list(_moved.__all__)
__moved_to__ = "gossip.train.loop"
