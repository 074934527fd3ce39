"""Command-line pieces the experiment scripts share.

Every study and benchmark declares its options once, in ``options(p)``, and runs in
``main(argv)``; the parser is built here, the same for ``python -m experiments run
NAME`` and ``python -m experiments.NAME``::

    def options(p):
        p.add_argument("--steps", type=int, default=10)

    def main(argv=None):
        p, a = _cli.parse(argv, options, __doc__, "NAME")
        ...

``--methods`` takes a comma-separated subset of a script's named methods; every
script declares and checks it the same way::

    _cli.add_methods(p, METHODS)
    a = p.parse_args(argv)
    names = _cli.methods(p, a.methods, METHODS)   # p.error (exit 2, one line) if bad
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

__all__ = ["add_methods", "methods", "REPO", "module_command", "module_env", "parser", "parse"]

REPO = Path(__file__).resolve().parents[1]
"""The repository root: where ``experiments`` is importable from."""


def module_command(name: str) -> list[str]:
    """The command that starts the experiment module ``name`` in a child Python:
    ``[python, "-m", "experiments.NAME"]`` (run it with :func:`module_env`)."""
    return [sys.executable, "-m", f"experiments.{name}"]


def module_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with the repository first on
    ``PYTHONPATH``, so that a child imports ``experiments`` from any folder."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def parser(options: Callable[[argparse.ArgumentParser], None], doc: str | None, name: str) -> argparse.ArgumentParser:
    """The parser of the experiment ``name``: its docstring's first paragraph as the
    description, the rest as the epilog, and the options ``options(p)`` adds."""
    head, _, rest = (doc or "").strip().partition("\n\n")
    p = argparse.ArgumentParser(prog=f"python -m experiments run {name}", description=head,
                                epilog=rest or None, formatter_class=argparse.RawDescriptionHelpFormatter)
    options(p)
    return p


def parse(argv: Sequence[str] | None, options: Callable[[argparse.ArgumentParser], None], doc: str | None,
          name: str) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser of the experiment ``name`` (:func:`parser`) and ``argv`` parsed by it
    (default: the command line). A bad option stops the script in one line, exit 2."""
    p = parser(options, doc, name)
    return p, p.parse_args(argv)


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
