"""Griffe extension: the reStructuredText in our docstrings, read as Markdown.

The docstrings are written for a terminal and for Sphinx-style readers
(``:class:`Foo```, ``.. code-block:: python``, ``Example::`` literal blocks), while
mkdocstrings renders Markdown. This rewrites, before rendering:

1. ``:role:`target``` (class, func, meth, attr, mod, data, exc, obj) into a code span
   of the target (its last part with a leading ``~``, as Sphinx shows it);
2. ``.. code-block:: LANG`` and a paragraph ending in ``::`` followed by an indented
   block into a fenced block of that language (Python for ``::``);

and leaves everything else (double-backtick code, lists, ``Args:`` sections) alone.
Only the rendered site changes; the source docstrings stay as they are.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):`(~?)([^`]+)`")
_DIRECTIVE = re.compile(r"^(\s*)\.\. code-block::\s*(\w*)\s*$")


def _role(match: re.Match) -> str:
    target = match.group(2)
    if match.group(1):
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def rst_to_markdown(text: str) -> str:
    """The docstring ``text`` with roles and literal blocks in Markdown (see the module)."""
    lines = _ROLE.sub(_role, text).splitlines()
    out: list[str] = []
    k = 0
    while k < len(lines):
        line = lines[k]
        directive = _DIRECTIVE.match(line)
        literal = not directive and line.rstrip().endswith("::") and not line.strip().startswith("..")
        if not (directive or literal):
            out.append(line)
            k += 1
            continue
        base = _indent(line)
        j = k + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j == len(lines) or _indent(lines[j]) <= base:  # no indented block follows: not a literal
            out.append(line)
            k += 1
            continue
        end = j
        while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > base):
            end += 1
        while end > j and not lines[end - 1].strip():
            end -= 1
        block = lines[j:end]
        cut = min(_indent(b) for b in block if b.strip())
        if directive:
            lang = directive.group(2) or "text"
        else:
            lang = "python"
            stripped = line.rstrip()[:-2].rstrip()
            if stripped.strip():
                out.append(stripped + ":")
            out.append("")
        pad = " " * base
        out.append(f"{pad}```{lang}")
        out.extend(pad + b[cut:] if b.strip() else "" for b in block)
        out.append(f"{pad}```")
        k = end
    return "\n".join(out)


class RstToMarkdown(Extension):
    """Rewrites each docstring once the object tree is complete."""

    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)
