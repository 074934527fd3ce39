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
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

import pytest

from tests.conftest import REPO, run_process

README = REPO / "README.md"
SECTION = "## Library API"
TIMEOUT = 180  # seconds per snippet

_TORCHRUN = re.compile(r"^<!--\s*torchrun\s+--nproc_per_node[ =](\d+)\s*-->$")


@dataclass(frozen=True)
class Snippet:
    line: int  # README line of the first line of code (1-based)
    code: str
    nproc: int | None  # processes under torchrun; None: one plain interpreter

    def numbered(self) -> str:
        return "\n".join(f"{self.line + k:4d} | {text}" for k, text in enumerate(self.code.splitlines()))


def snippets(text: str, section: str = SECTION) -> list[Snippet]:
    """The ``python`` blocks between ``section`` and the next heading of its level or above."""
    lines = text.splitlines()
    try:
        start = lines.index(section)
    except ValueError:
        return []
    level = len(section) - len(section.lstrip("#"))
    heading = re.compile(rf"^#{{1,{level}}} ")
    found: list[Snippet] = []
    k = start + 1
    while k < len(lines) and not heading.match(lines[k]):
        if lines[k].strip() in ("```python", "```py"):
            end = next((j for j in range(k + 1, len(lines)) if lines[j].strip() == "```"), None)
            if end is None:
                raise ValueError(f"README.md line {k + 1}: the ```python fence is never closed")
            before = next((lines[j].strip() for j in range(k - 1, start, -1) if lines[j].strip()), "")
            marker = _TORCHRUN.match(before)
            found.append(Snippet(k + 2, "\n".join(lines[k + 1 : end]) + "\n",
                                 int(marker.group(1)) if marker else None))
            k = end
        k += 1
    return found


SNIPPETS = snippets(README.read_text(encoding="utf-8"))


def test_the_library_section_has_snippets():
    assert SNIPPETS, f"README.md has no ```python block under a {SECTION!r} heading: was it renamed?"


def test_snippets_are_found_with_their_launch():
    text = "\n".join([
        "## Library API", "intro", "```python", "a = 1", "```", "",
        "<!-- torchrun --nproc_per_node 3 -->", "```python", "b = 2", "c = 3", "```",
        "```", "not python", "```", "### a subsection", "```python", "d = 4", "```",
        "## Next", "```python", "outside = True", "```",
    ])
    got = snippets(text)
    assert got == [Snippet(4, "a = 1\n", None), Snippet(9, "b = 2\nc = 3\n", 3), Snippet(17, "d = 4\n", None)]
    with pytest.raises(ValueError, match=r"line 2: the ```python fence is never closed"):
        snippets("## Library API\n```python\nx = 1\n")


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda s: f"README.md-line{s.line}")
def test_readme_snippet_runs(snippet, tmp_path):
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
        hint = ""
        if snippet.nproc is None and "launch with torchrun" in r.stderr:
            hint = ("\nThis snippet needs torchrun: put <!-- torchrun --nproc_per_node 2 --> "
                    "on the line before its fence.")
        pytest.fail(
            f"README.md snippet at line {snippet.line}, run with {how}, exited with {r.returncode}:\n"
            f"{snippet.numbered()}\n--- stdout\n{r.stdout[-2000:]}\n--- stderr\n{r.stderr[-4000:]}{hint}",
            pytrace=False,
        )
