"""Command-line pieces the experiment scripts share.

``--methods`` takes a comma-separated subset of a script's named methods; every
script declares and checks it the same way::

    _cli.add_methods(p, METHODS)
    a = p.parse_args(argv)
    names = _cli.methods(p, a.methods, METHODS)   # p.error (exit 2, one line) if bad
"""

from __future__ import annotations

import argparse
from typing import Iterable

__all__ = ["add_methods", "methods"]


def add_methods(p: argparse.ArgumentParser, known: Iterable[str], default: Iterable[str] | None = None) -> None:
    """Add ``--methods`` (default: every known method, or ``default``) to ``p``."""
    known = list(known)
    p.add_argument("--methods", default=",".join(known if default is None else default),
                   help=f"comma-separated, of {', '.join(known)}")


def methods(p: argparse.ArgumentParser, value: str, known: Iterable[str], *, flag: str = "--methods") -> list[str]:
    """The names in ``value`` (comma-separated, blanks ignored), in its order. An
    unknown name, or none at all, stops the script through ``p.error``: one line
    naming ``flag``, what was wrong and the known names, exit status 2."""
    known = list(known)
    names = [m.strip() for m in value.split(",") if m.strip()]
    unknown = [m for m in names if m not in known]
    if unknown or not names:
        p.error(f"{flag}: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(known)}")
    return names
