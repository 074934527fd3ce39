"""The documentation site builds cleanly, documents the public API, and its code runs.

1. ``mkdocs build --strict`` of mkdocs.yml into a temporary directory, from another
   directory: a broken link, a page missing from the nav's targets, a bad reference or
   an unreadable docstring is a warning and fails the build.
2. Every public class and function of every public module's ``__all__`` has a
   docstring and appears, with it, on its page of the built API reference.
3. Every ``python`` block of every page under docs/ runs as written, as the README's
   do (tests/test_readme.py), unless marked ``<!-- not run: why -->``; blocks that are
   the README's own are run there, not twice.

The README's links are checked too (it is not part of the site).

1 and 2 need the ``docs`` extra (``pip install -e ".[docs]"``, which ``make test``
installs) and are skipped with that reason without it; 3 always runs.
"""

from __future__ import annotations

import dataclasses
import html
import importlib.util
import inspect
import re
import sys

import pytest

from tests.conftest import REPO, child_env, run_process
from tests.test_readme import README, Snippet, run_snippet, snippets

DOCS = REPO / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_hooks" not in p.relative_to(DOCS).parts)
BUILD_TIMEOUT = 300  # seconds; about 8 s of CPU

_README_CODE = {s.code for s in snippets(README.read_text(encoding="utf-8"))}
DOC_SNIPPETS = [s for page in PAGES
                for s in snippets(page.read_text(encoding="utf-8"), section=None,
                                  source=page.relative_to(REPO).as_posix())
                if s.code not in _README_CODE]

_MISSING = [m for m in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
            if importlib.util.find_spec(m.split(".")[0]) is None
            or (m == "mkdocstrings_handlers.python" and importlib.util.find_spec(m) is None)]
needs_docs_extra = pytest.mark.skipif(
    bool(_MISSING), reason=f"the docs extra is not installed (no {', '.join(_MISSING)}): pip install -e '.[docs]'")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    elsewhere = tmp_path_factory.mktemp("cwd")
    r = run_process([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                     str(REPO / "mkdocs.yml"), "--site-dir", str(out)],
                    cwd=elsewhere, timeout=BUILD_TIMEOUT, env=child_env(extra={"NO_MKDOCS_2_WARNING": "1"}))
    return out, r


@needs_docs_extra
def test_the_site_builds_in_strict_mode(site):
    out, r = site
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stderr[-6000:]}"
    warnings = [line for line in r.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert not warnings, "\n".join(warnings)
    home = (out / "index.html").read_text(encoding="utf-8")
    for page in PAGES:  # in the nav mkdocs.yml gives, or under "More" (the hook adds it)
        uri = page.relative_to(DOCS).with_suffix("").as_posix()
        if uri != "index":
            assert f'href="{uri}/"' in home, f"the navigation has no link to docs/{uri}.md"
    assert 'href="reference/"' in home
    race = (out / "race" / "index.html").read_text(encoding="utf-8")
    assert 'src="../race-mnist1d.png"' in race and (out / "race-mnist1d.png").is_file()
    assert (out / "examples" / "ddp_hook.py").is_file()  # a repository file a page links to
    assert (out / "reports" / "tang2018" / "fig1.png").is_file()


def _plain(text: str, html_page: bool = False) -> str:
    """Words only: no punctuation, single spaces (and for a page, no tags)."""
    if html_page:
        text = html.unescape(re.sub(r"<[^>]+>", " ", text))
    return " ".join(re.sub(r"[^\w]+", " ", text).split())


@needs_docs_extra
def test_every_public_name_is_in_the_reference_with_its_docstring(site):
    out, r = site
    assert r.returncode == 0, r.stderr[-3000:]
    sys.path.insert(0, str(DOCS / "_hooks"))
    try:
        import griffe_rst
        import mkdocs_hooks
    finally:
        sys.path.remove(str(DOCS / "_hooks"))
    modules, homes = mkdocs_hooks.api_homes()
    assert {"gossip", "gossip.ddp", "gossip.compress", "gossip.comm", "gossip.algorithms", "topologies"} <= set(modules)
    checked, problems, pages = 0, [], {}
    for (mod_name, name), home in sorted(homes.items()):
        obj = getattr(modules[mod_name], name)
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        if home not in pages:
            pages[home] = (out / "reference" / home / "index.html").read_text(encoding="utf-8")
        page = pages[home]
        doc = obj.__doc__ if obj.__doc__ is None else inspect.cleandoc(obj.__doc__)
        if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and re.fullmatch(r"\w+\(.*\)", doc or "", re.S):
            doc = None  # the signature dataclasses write where the class has no docstring
        if not doc or not doc.strip():
            problems.append(f"{mod_name}.{name}: no docstring of its own")
        elif f'id="{home}.{name}"' not in page:
            problems.append(f"{mod_name}.{name}: no entry on reference/{home}/")
        else:
            first = _plain(griffe_rst.rst_to_markdown(doc.strip().split("\n\n")[0]))[:60]
            if first not in _plain(page, html_page=True):
                problems.append(f"{mod_name}.{name}: its docstring ({first!r}) is not on reference/{home}/")
        if mod_name != home and f'href="../{home}/#{home}.{name}"' not in (
                out / "reference" / mod_name / "index.html").read_text(encoding="utf-8"):
            problems.append(f"{mod_name}.{name}: reference/{mod_name}/ does not link to its entry on reference/{home}/")
        checked += 1
    assert not problems, "\n".join(problems)
    assert checked > 100


def test_the_readme_links_point_at_files_that_exist():
    """The README is not part of the site, so the strict build does not check its links."""
    text = README.read_text(encoding="utf-8")
    links = [m.group(1) for m in re.finditer(r"\]\(([^)\s]+)\)", text)]
    local = [link.split("#")[0] for link in links if not re.match(r"^[a-z]+:", link) and not link.startswith("#")]
    assert any(link.startswith("docs/") for link in local)
    missing = [link for link in local if link and not (REPO / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_docs_have_runnable_snippets():
    assert DOC_SNIPPETS, "no ```python block under docs/ runs: were they all marked 'not run'?"
    assert any(s.nproc for s in DOC_SNIPPETS), "no docs snippet runs under torchrun"


@pytest.mark.parametrize("snippet", DOC_SNIPPETS, ids=lambda s: f"{s.source}-line{s.line}")
def test_docs_snippet_runs(snippet: Snippet, tmp_path):
    run_snippet(snippet, tmp_path)


@needs_docs_extra
def test_docstring_rst_is_rendered_as_markdown():
    sys.path.insert(0, str(DOCS / "_hooks"))
    try:
        from griffe_rst import rst_to_markdown
    finally:
        sys.path.remove(str(DOCS / "_hooks"))
    text = "\n".join([
        "Uses :class:`FlatParams` and :meth:`~gossip.runtime.GossipOptimizer.step`:",
        "",
        ".. code-block:: python",
        "",
        "    opt.step()",
        "    if x:",
        "        y()",
        "",
        "An example::",
        "",
        "    a = 1",
        "",
        "Nothing indented follows this::",
    ])
    assert rst_to_markdown(text).splitlines() == [
        "Uses `FlatParams` and `step`:",
        "",
        "```python",
        "opt.step()",
        "if x:",
        "    y()",
        "```",
        "",
        "An example:",
        "",
        "```python",
        "a = 1",
        "```",
        "",
        "Nothing indented follows this::",
    ]
