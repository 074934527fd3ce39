"""Every Python snippet in the README's library section runs as it is written.

Each fenced ``python`` block under the ``## Library API`` heading is written to a
file in an empty temporary directory and run by a fresh interpreter. A snippet that
needs a multi-process launch says so on the line before its fence, with the launch
command as an HTML comment (invisible on the rendered page)::

    <!-- torchrun --nproc_per_node 2 -->
    ```python
    ...
    ```

and then runs under ``torch.distributed.run`` with that many processes over gloo.
A block that is a sketch, not a program (an API outline with ``->`` annotations),
says why on the line before its fence and is not run::

    <!-- not run: an outline of the interface -->

tests/test_docs.py runs the blocks of the documentation pages with the same
machinery (:func:`snippets` over a whole page, :func:`run_snippet`).
"""

from __future__ import annotations

import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, run_process

README = REPO / "README.md"
SECTION = "## Library API"
TIMEOUT = 180  # seconds per snippet

_TORCHRUN = re.compile(r"^<!--\s*torchrun\s+--nproc_per_node[ =](\d+)\s*-->$")
_NOT_RUN = re.compile(r"^<!--\s*not run:\s*\S.*-->$")
_FENCE = re.compile(r"^\s*(```+|~~~+)")


@dataclass(frozen=True)
class Snippet:
    line: int  # line of the first line of code in its file (1-based)
    code: str
    nproc: int | None  # processes under torchrun; None: one plain interpreter
    source: str = "README.md"  # the file, relative to the repository

    def numbered(self) -> str:
        return "\n".join(f"{self.line + k:4d} | {text}" for k, text in enumerate(self.code.splitlines()))


def snippets(text: str, section: str | None = SECTION, source: str = "README.md") -> list[Snippet]:
    """The ``python`` blocks between ``section`` and the next heading of its level or
    above (the whole text with ``section=None``), less those marked ``not run``.
    Lines inside fences are never headings (a shell comment is not a section)."""
    lines = text.splitlines()
    if section is None:
        start, heading = -1, None
    else:
        try:
            start = lines.index(section)
        except ValueError:
            return []
        level = len(section) - len(section.lstrip("#"))
        heading = re.compile(rf"^#{{1,{level}}} ")
    found: list[Snippet] = []
    k = start + 1
    while k < len(lines):
        if heading is not None and heading.match(lines[k]):
            break
        fence = _FENCE.match(lines[k])
        if fence:
            mark = fence.group(1)
            end = next((j for j in range(k + 1, len(lines)) if lines[j].strip() == mark), None)
            if end is None:
                raise ValueError(f"{source} line {k + 1}: the {mark} fence is never closed")
            if lines[k].strip() in ("```python", "```py"):
                before = next((lines[j].strip() for j in range(k - 1, start, -1) if lines[j].strip()), "")
                marker = _TORCHRUN.match(before)
                if not _NOT_RUN.match(before):
                    code = textwrap.dedent("\n".join(lines[k + 1:end]))
                    found.append(Snippet(k + 2, code + "\n", int(marker.group(1)) if marker else None, source))
            k = end
        k += 1
    return found


def run_snippet(snippet: Snippet, tmp_path: Path) -> None:
    """Run ``snippet`` in ``tmp_path`` as its marker says; fail with its numbered code and output."""
    script = tmp_path / "snippet.py"
    script.write_text(snippet.code, encoding="utf-8")
    if snippet.nproc is None:
        cmd, how = [sys.executable, str(script)], "python"
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(snippet.nproc), str(script)]
        how = f"torchrun --nproc_per_node {snippet.nproc}"
    r = run_process(cmd, cwd=tmp_path, timeout=TIMEOUT)
    if r.returncode != 0:
        hint = ("\nIf the block is an outline rather than a program, say so on the line before its "
                "fence: <!-- not run: why -->.")
        if snippet.nproc is None and "launch with torchrun" in r.stderr:
            hint = ("\nThis snippet needs torchrun: put <!-- torchrun --nproc_per_node 2 --> "
                    "on the line before its fence.")
        pytest.fail(
            f"{snippet.source} snippet at line {snippet.line}, run with {how}, exited with {r.returncode}:\n"
            f"{snippet.numbered()}\n--- stdout\n{r.stdout[-2000:]}\n--- stderr\n{r.stderr[-4000:]}{hint}",
            pytrace=False,
        )


SNIPPETS = snippets(README.read_text(encoding="utf-8"))


def test_the_library_section_has_snippets():
    assert SNIPPETS, f"README.md has no ```python block under a {SECTION!r} heading: was it renamed?"


def test_snippets_are_found_with_their_launch():
    text = "\n".join([
        "## Library API", "intro", "```python", "a = 1", "```", "",
        "<!-- torchrun --nproc_per_node 3 -->", "```python", "b = 2", "c = 3", "```",
        "```", "not python", "```", "### a subsection", "```python", "d = 4", "```",
        "```sh", "# a comment, not a heading", "```", "<!-- not run: a sketch -->", "```python", "e ->", "```",
        "- a list item:", "", "  ```python", "  f = 5", "  ```",
        "## Next", "```python", "outside = True", "```",
    ])
    got = snippets(text)
    assert got == [Snippet(4, "a = 1\n", None), Snippet(9, "b = 2\nc = 3\n", 3), Snippet(17, "d = 4\n", None),
                   Snippet(29, "f = 5\n", None)]
    assert [s.code for s in snippets(text, section=None)][-1] == "outside = True\n"
    with pytest.raises(ValueError, match=r"page.md line 2: the ``` fence is never closed"):
        snippets("## Library API\n```python\nx = 1\n", source="page.md")


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda s: f"README.md-line{s.line}")
def test_readme_snippet_runs(snippet, tmp_path):
    run_snippet(snippet, tmp_path)
