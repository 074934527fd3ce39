"""The one exception type of the package."""

from __future__ import annotations

__all__ = ["TopologyError"]


class TopologyError(ValueError):
    """A topology parameter or a mixing matrix broke a rule.

    The message names the rule, the offending value (a parameter, a row, an entry) and
    what would fix it. It is a ``ValueError``, so callers that only know the standard
    exceptions can still catch it.
    """
