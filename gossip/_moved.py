"""The one helper behind the modules kept at their old paths for a release.

A module that moved (``gossip.config`` to ``gossip.train.config``, ...) leaves a thin
module at its old path that imports the new one and calls :func:`reexport`: importing
the old path warns once (a ``DeprecationWarning`` naming the new path, pointing at the
importer) and gives the new module's public names, the same objects, with the same
``__all__``. Each old module also states ``__moved_to__ = "NEW.PATH"`` (tests read it).
"""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Any

__all__ = ["reexport"]


def reexport(old: dict[str, Any], new: ModuleType, *, command: bool = False) -> None:
    """Make the module whose globals are ``old`` a deprecated alias of ``new``.
    ``command``: the old path was also run as ``python -m OLD``; the warning names the
    new command."""
    name = old["__spec__"].name if old.get("__spec__") is not None else old["__name__"]
    hint = f" (python -m {new.__name__})" if command else ""
    # stacklevel: this helper, the old module's body, then whoever imported it (the import
    # system's own frames are skipped); run as __main__, the old module's body itself
    warnings.warn(f"{name} is deprecated: it moved to {new.__name__}; import that instead{hint}",
                  DeprecationWarning, stacklevel=2 if old["__name__"] == "__main__" else 3)
    old.update({k: v for k, v in vars(new).items() if not k.startswith("_")})
    old["__all__"] = list(new.__all__)
