"""Deprecated: moved to :mod:`gossip.tools.crossover` (``python -m gossip.tools.crossover``).

This path re-exports the public names of :mod:`gossip.tools.crossover` for one release
and warns once, at import, with a ``DeprecationWarning`` naming the new path.
"""

from gossip import _moved
from gossip.tools import crossover as _new

__moved_to__ = "gossip.tools.crossover"
_moved.reexport(globals(), _new, command=True)

if __name__ == "__main__":  # python -m gossip.crossover: the tool, as before
    raise SystemExit(_new.main())
