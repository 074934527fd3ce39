"""Deprecated: moved to :mod:`gossip.tools.units`.

This path re-exports the public names of :mod:`gossip.tools.units` for one release
and warns once, at import, with a ``DeprecationWarning`` naming the new path.
"""

import warnings as _warnings

_warnings.warn("gossip.units is deprecated: it moved to gossip.tools.units; import that instead",
               DeprecationWarning, stacklevel=1 if __name__ == "__main__" else 2)

from gossip.tools import units as _moved  # noqa: E402

globals().update({_k: _v for _k, _v in vars(_moved).items() if not _k.startswith("_")})
__all__ = list(_moved.__all__)
__moved_to__ = "gossip.tools.units"
