"""MkDocs hooks of the documentation site (``hooks:`` in mkdocs.yml).

Three things the plain configuration cannot do:

1. **The API reference is generated.** Every public module of ``gossip`` and
   ``topologies`` (no part of its dotted name starting with ``_``) gets a page
   ``reference/<module>.md`` rendered by mkdocstrings from its docstrings. Each name
   of a module's ``__all__`` is documented once, on the page of the public module that
   defines it (``obj.__module__``) or, when that module is private, on the page of the
   deepest public module that exports it; the other modules that export it list it
   with a link there. A new module or a new ``__all__`` entry appears with no edit
   here; a module kept at an old path to re-export the one it moved to (it sets
   ``__moved_to__``) has no page. The nav entry ``reference/index.md`` of mkdocs.yml becomes the whole
   "API reference" section.
2. **Pages nobody put in the nav still appear.** A Markdown page under docs/ that the
   nav of mkdocs.yml does not list is added under "More" (sorted by file name), so a
   new page is never built but unreachable; give it a place in the nav to move it.
3. **Links to repository files outside docs/ work on the site too.** Pages link to
   ``../examples/ddp_hook.py`` or ``../reports/tang2018/REPORT.md`` so that they work
   when read on a forge; the hook copies each such file (and, for a Markdown file, its
   folder's figures) into the site under the same path and rewrites the link. A
   link to a file that does not exist is left alone, and MkDocs' strict mode fails on it.
4. **Freshness is shown where it cannot go out of date.** Under every results table
   (its ``Rendered from`` line) and at the top of every benchmark report page, the
   site says whether the figures are certified at the commit it was built from,
   unverified or stale (experiments/freshness.py), computed at build time: the
   committed Markdown never carries it, so a source change never makes it wrong.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("gossip", "topologies")
REFERENCE = "reference/index.md"
MORE = "More"
_OUTSIDE = re.compile(r"\]\((\.\./[^)#\s]+)(#[^)\s]*)?\)")
_FIGURES = {".png", ".svg", ".jpg", ".jpeg", ".gif"}
#: a module kept at an old path to re-export the one it moved to (``__moved_to__ = "..."``)
_MOVED = re.compile(r"^__moved_to__ = ", re.M)

log = logging.getLogger("mkdocs.hooks.gossip")


def public_modules() -> list[str]:
    """Dotted names of the public modules, packages before their submodules."""
    names = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if parts[-1] == "__main__" or any(p.startswith("_") for p in parts):
                continue
            if _MOVED.search(path.read_text(encoding="utf-8")):  # a deprecated path: documented where it moved
                continue
            names.append(".".join(parts))
    return sorted(set(names), key=lambda n: n.split("."))


def _exported(module: Any) -> list[str]:
    return [n for n in getattr(module, "__all__", ()) if not n.startswith("_")]


def api_homes() -> tuple[dict[str, Any], dict[tuple[str, str], str]]:
    """The imported public modules and, for each ``(module, name)`` of an ``__all__``,
    the module whose page documents that name."""
    if str(REPO) not in sys.path[:1]:
        sys.path.insert(0, str(REPO))  # this checkout's code, not another installed copy
    modules = {name: importlib.import_module(name) for name in public_modules()}
    exporters: dict[int, list[str]] = {}
    for mod_name, module in modules.items():
        for name in _exported(module):
            exporters.setdefault(id(getattr(module, name)), []).append(mod_name)
    homes: dict[tuple[str, str], str] = {}
    for mod_name, module in modules.items():
        for name in _exported(module):
            obj = getattr(module, name)
            candidates = [m for m in exporters[id(obj)] if name in _exported(modules[m])
                          and getattr(modules[m], name) is obj]
            defined = getattr(obj, "__module__", None) if (inspect.isclass(obj) or inspect.isroutine(obj)) else None
            if defined in candidates:
                home = defined
            else:  # defined in a private module, or a constant: the deepest exporter
                home = sorted(candidates, key=lambda m: (-m.count("."), m))[0]
            homes[(mod_name, name)] = home
    return modules, homes


def reference_pages() -> dict[str, tuple[str, str]]:
    """``{src_uri: (nav title, Markdown)}`` of the API reference."""
    modules, homes = api_homes()
    pages: dict[str, tuple[str, str]] = {}
    rows = []
    for mod_name, module in modules.items():
        own = [n for n in _exported(module) if homes[(mod_name, n)] == mod_name]
        elsewhere = [n for n in _exported(module) if homes[(mod_name, n)] != mod_name]
        members = "\n".join(f"        - {n}" for n in own) if own else None
        text = [f"::: {mod_name}", "    options:"]
        text += ["      members:", members] if members else ["      members: false"]
        if elsewhere:
            text += ["", f"**Also exported by `{mod_name}`**, documented where they are defined:", "",
                     "| name | documented in |", "|---|---|"]
            for n in elsewhere:
                home = homes[(mod_name, n)]
                text.append(f"| [`{n}`][{home}.{n}] | [`{home}`][{home}] |")
        summary = (inspect.getdoc(module) or "").strip().splitlines()
        rows.append(f"| [`{mod_name}`][{mod_name}] | {summary[0] if summary else ''} |")
        pages[f"reference/{mod_name}.md"] = (mod_name, "\n".join(text) + "\n")
    index = ["# API reference", "",
             "Generated from the docstrings of every public module of `gossip` and `topologies`. "
             "Each page documents the names of its module's `__all__`; a name exported by "
             "several modules is documented once, where it is defined, and linked from the others.",
             "", "| module | |", "|---|---|", *rows]
    pages[REFERENCE] = ("Overview", "\n".join(index) + "\n")
    return pages


def _reference_nav(pages: dict[str, tuple[str, str]]) -> list[Any]:
    """Nested by package: a package's section holds its own page, then its submodules."""
    nav: list[Any] = [{"Overview": REFERENCE}]
    sections: dict[str, list[Any]] = {}
    for uri, (mod_name, _) in pages.items():
        if uri == REFERENCE:
            continue
        parent = mod_name.rsplit(".", 1)[0] if "." in mod_name else None
        is_package = (REPO / mod_name.replace(".", "/") / "__init__.py").exists()
        entry = {mod_name: uri}
        if is_package:
            sections[mod_name] = [entry]
            (sections[parent] if parent in sections else nav).append({mod_name: sections[mod_name]})
        else:
            (sections[parent] if parent in sections else nav).append(entry)
    return nav


def _nav_uris(nav: Any) -> set[str]:
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, list):
        return set().union(*(_nav_uris(x) for x in nav)) if nav else set()
    if isinstance(nav, dict):
        return set().union(*(_nav_uris(v) for v in nav.values())) if nav else set()
    return set()


def _replace_reference(nav: list[Any], section: list[Any]) -> bool:
    for k, item in enumerate(nav):
        if isinstance(item, dict):
            (title, value), = item.items()
            if value == REFERENCE:
                nav[k] = {title: section}
                return True
            if isinstance(value, list) and _replace_reference(value, section):
                return True
    return False


_FENCE = re.compile(r"^\s*(```+|~~~+)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")


def _outside_code(markdown: str, edit):
    """``markdown`` with ``edit`` applied to the text outside fenced blocks and code spans
    (a link written as an example in code stays as it is)."""
    out, fence = [], None
    for line in markdown.split("\n"):
        mark = _FENCE.match(line)
        if fence is not None:
            if mark and line.strip() == fence:
                fence = None
            out.append(line)
        elif mark:
            fence = mark.group(1)
            out.append(line)
        else:
            pieces, last = [], 0
            for span in _CODE_SPAN.finditer(line):
                pieces += [edit(line[last:span.start()]), span.group(0)]
                last = span.end()
            out.append("".join(pieces) + edit(line[last:]))
    return "\n".join(out)


def _outside_links(text: str) -> set[str]:
    found: set[str] = set()
    _outside_code(text, lambda s: found.update(m.group(1) for m in _OUTSIDE.finditer(s)) or s)
    return found


def on_config(config: Any, **kwargs: Any) -> Any:
    # mkdocstrings resolves a griffe extension's file path against the current
    # directory: make the configured ones absolute, so any directory can build
    handlers = config["plugins"]["mkdocstrings"].config["handlers"]
    options = handlers.get("python", {}).get("options", {})
    here = Path(config["config_file_path"]).parent
    options["extensions"] = [str(here / e) if isinstance(e, str) and (here / e).is_file() else e
                             for e in options.get("extensions", [])]
    return config


def on_files(files: Files, config: Any, **kwargs: Any) -> Files:
    # 1. the API reference
    pages = reference_pages()
    for uri, (_, text) in pages.items():
        if files.get_file_from_path(uri) is None:
            files.append(File.generated(config, uri, content=text))
    # 3. repository files the pages link to, and their figures
    docs_dir = Path(config["docs_dir"])
    wanted: set[Path] = set()
    for f in list(files):
        if f.is_documentation_page() and f.abs_src_path:
            for link in _outside_links(Path(f.abs_src_path).read_text(encoding="utf-8")):
                target = (Path(f.abs_src_path).parent / link).resolve()
                if target.is_file() and REPO in target.parents and docs_dir not in target.parents:
                    wanted.add(target)
                    if target.suffix == ".md":
                        wanted.update(p for p in target.parent.iterdir() if p.suffix in _FIGURES)
    for target in sorted(wanted):
        uri = target.relative_to(REPO).as_posix()
        if files.get_file_from_path(uri) is None:
            files.append(File(uri, src_dir=str(REPO), dest_dir=config["site_dir"],
                              use_directory_urls=config["use_directory_urls"]))
    # 1. and 2. the nav
    nav = config["nav"]
    if nav is not None:
        if not _replace_reference(nav, _reference_nav(pages)):
            log.warning(f"mkdocs.yml's nav has no entry '{REFERENCE}': the API reference is not in the nav")
        listed = _nav_uris(nav)
        stray = sorted(f.src_uri for f in files if f.is_documentation_page() and f.src_uri not in listed
                       and not f.src_uri.startswith("reference/"))
        if stray:
            nav.append({MORE: stray})
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files, **kwargs: Any) -> str:
    # 3. ../path links that point at a file copied into the site: the same path there
    src = page.file.abs_src_path
    if not src or Path(config["docs_dir"]) not in Path(src).parents:
        return markdown
    depth = len(Path(page.file.src_uri).parts) - 1

    def rewrite(match: re.Match) -> str:
        target = (Path(src).parent / match.group(1)).resolve()
        if REPO not in target.parents:
            return match.group(0)
        uri = target.relative_to(REPO).as_posix()
        if files.get_file_from_path(uri) is None:
            return match.group(0)
        return f"]({'../' * depth}{uri}{match.group(2) or ''})"

    markdown = _outside_code(markdown, lambda text: _OUTSIDE.sub(rewrite, text))
    # 4. freshness at this build, under each table and atop each report page
    return with_freshness(markdown, Path(src).relative_to(REPO).as_posix())


_RENDERED = re.compile(r"^<sub>Rendered from `([^`]+)`:.*</sub>$", re.M)


@functools.lru_cache(maxsize=1)
def _statuses() -> tuple[dict[str, Any], str]:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from experiments import _provenance, freshness

    commit = (_provenance.git_commit()[0] or "unknown")[:10]
    return {s.results: s for s in freshness.all_statuses()}, commit


def freshness_note(results: str) -> str:
    """One line on the freshness of ``results`` at the commit the site is built from."""
    statuses, commit = _statuses()
    st = statuses.get(results)
    if st is None:
        return ""
    if st.state == "certified":
        how = "verified by its witnesses" if st.kind == "training" else "the code it ran is unchanged"
        return f"<sub>Certified at this build (commit {commit}): {how} since {str(st.since)[:10]}.</sub>"
    why = "; ".join(st.reasons)
    return (f"<sub>**{st.state.capitalize()}** at this build (commit {commit}): {why}. "
            "`python -m experiments stale` lists it, `make results` re-runs it.</sub>")


def with_freshness(markdown: str, rel: str) -> str:
    """``markdown`` of the page ``rel`` with the freshness notes of its results."""
    try:
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        from experiments.render import PAGES
    except ImportError as e:  # the site still builds; it says why freshness is missing
        log.warning("freshness not shown: %s", e)
        return markdown
    page = PAGES.get(rel)
    if getattr(page, "results", None):  # a report page (the overview has no results file of its own)
        note = freshness_note(page.results)
        lines = markdown.split("\n")
        at = next((i for i, ln in enumerate(lines) if ln.startswith("Made by ")), 1)
        lines.insert(at + 1, "\n" + note if note else "")
        markdown = "\n".join(lines)
    return _RENDERED.sub(lambda m: m.group(0) + ("\n" + freshness_note(m.group(1)) if freshness_note(m.group(1)) else ""),
                         markdown)
