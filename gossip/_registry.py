"""The one registry mechanism of every family of named parts.

Algorithms, compressors, topologies, models and data sets are each a
:class:`Registry` (names in registration order, each with its entry and a one-line
summary; ``register`` the one way in, ``available()`` the one listing, name -> summary).
The class lives in ``topologies.registry``: topologies is the package below gossip and
imports nothing of it, so both use the same mechanism.
"""

from __future__ import annotations

from topologies.registry import Registry

__all__ = ["Registry"]
