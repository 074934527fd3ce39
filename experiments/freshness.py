"""Whether each results file still describes the code at HEAD, computed, never committed.

Three kinds of results file, three rules (docs/provenance.md):

- **training** (its provenance lists ``configs``, the training configurations it ran):
  *certified* at the commit that made it, or at the last commit where
  ``python -m experiments verify`` found every witness bit-identical
  (experiments/witness.py); still *certified* at HEAD when the code of none of its
  sources changed since (comments and docstrings aside); *unverified* when it did and
  no verify has run since (run it: minutes);
  *stale* when a witness differed (the record names the configuration and step).
- **timing** (no configs): certified while the code it ran is unchanged. What it ran
  is the repository modules its process imported (``imported``, recorded by
  experiments/_provenance.py) less the presentation modules (:data:`PRESENTATION`:
  they draw tables from a results file, after the figures are made), and its listed
  ``sources``: the code of the processes it launched (a benchmark's ranks import the
  library where its driver does not). Code is compared by its syntax tree less
  docstrings, so a comment or a docstring edit never stales a timing.
- a file awaiting its first run, or without provenance: *missing*.

A stale or unverified result made on the netns cluster or a GPU says so: the re-run
needs that machine, where a CPU result's does not. Freshness lives here, in
``python -m experiments stale`` and in the documentation site (computed at build
time), never in committed Markdown: a source change alone never turns a check red.
"""

from __future__ import annotations

import ast
import functools
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from experiments import _provenance as P

__all__ = ["Status", "status", "all_statuses", "needs", "code_changed", "timed_modules", "RESULTS_GLOBS",
           "PRESENTATION"]

REPO = P.REPO
RESULTS_GLOBS = ("experiments/results/*.json", "reports/*/results.json")
#: modules that only draw tables and pages from results files: a timing script imports
#: them to print its table once its figures are made, and nothing they hold is timed or
#: computes a figure the file keeps (experiments/tables.py imports nothing of the
#: project; experiments/render.py reads results files and writes Markdown). A change to
#: them shows in the rendered pages, which ``render --check`` holds to the files, not
#: in the figures: it does not stale a timing result. Any other module it imported
#: still counts, those render.py imports included (each is listed on its own).
PRESENTATION = ("experiments/tables.py", "experiments/render.py")


def timed_modules(imported: dict[str, str | None]) -> list[str]:
    """The modules of a timing result's ``imported`` record whose code certifies it:
    all of them less :data:`PRESENTATION`, in path order."""
    return sorted(p for p in imported if p not in PRESENTATION)


@dataclass
class Status:
    """One results file's freshness at HEAD."""

    results: str
    kind: str  # "training" | "timing"
    state: str  # "certified" | "unverified" | "stale" | "missing"
    since: str | None = None  # the commit it is certified from (made or verified)
    reasons: list[str] = field(default_factory=list)
    needs: str = "cpu"  # the machine a re-run needs: "cpu", "netns" (root, tc) or "gpu"
    command: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def line(self) -> str:
        where = f" at {self.since[:10]}" if self.since else ""
        why = f": {'; '.join(self.reasons)}" if self.reasons else ""
        need = f" (a re-run needs {_NEEDS[self.needs]})" if self.state == "stale" and self.needs != "cpu" else ""
        return f"{self.results}: {self.state}{where if self.state == 'certified' else ''}{why}{need}"


_NEEDS = {"cpu": "this machine", "netns": "the netns cluster (root, tc)", "gpu": "a GPU"}


def needs(prov: dict[str, Any]) -> str:
    """The machine a re-run of this record's command needs."""
    cmd = P.as_module(str(prov.get("command") or ""))
    if (prov.get("machine") or {}).get("gpu") or "--device cuda" in cmd or "gpu_check" in cmd or "sim_gpu" in cmd:
        return "gpu"
    if cmd.startswith("sudo ") or "--mode netns" in cmd or any(
            s in cmd for s in ("benchmark_netns", "sweep_network", "crossover_check", "sgp_overlap", "experiments.churn",
                               "netns_gap", "streaming_overlap", "bench_ddp_overlap", "diloco_eager_netns", "adpsgd_netns", "groups_netns")):
        return "netns"
    return "cpu"


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _code_key(text: str) -> str | None:
    """The syntax tree of Python source less its comments and docstrings (None: not
    Python): two texts with the same key run the same code."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


@functools.lru_cache(maxsize=None)
def _code_of(blob: str) -> str | None:
    """:func:`_code_key` of a git blob."""
    text = _git("cat-file", "-p", blob)
    return None if text is None else _code_key(text)


@functools.lru_cache(maxsize=None)
def _tree_files(rev_or_tree: str) -> dict[str, str]:
    """path -> blob id of every file under a tree id (or ``rev:path``)."""
    out = _git("ls-tree", "-r", rev_or_tree) or ""
    files = {}
    for line in out.splitlines():
        meta, _, path = line.partition("\t")
        parts = meta.split()
        if len(parts) == 3 and parts[1] == "blob":
            files[path] = parts[2]
    return files


def code_changed(path: str, old: str | None, new: str | None) -> list[str]:
    """The files under ``path`` whose code differs between the git objects ``old`` and
    ``new`` (a blob or a tree), comments and docstrings aside; [] when none does."""
    if old == new:
        return []
    if old is None or new is None:
        return [path]
    kind = (_git("cat-file", "-t", new) or "").strip()
    if kind == "tree":
        a, b = _tree_files(old), _tree_files(new)
        return [f"{path}/{f}" for f in sorted(set(a) | set(b))
                if a.get(f) != b.get(f) and not _same_code(a.get(f), b.get(f), f)]
    return [] if _same_code(old, new, path) else [path]


def _same_code(old: str | None, new: str | None, name: str) -> bool:
    if old is None or new is None:
        return False
    if not name.endswith(".py"):
        return False
    a, b = _code_of(old), _code_of(new)
    return a is not None and a == b


def _ids_at(rev: str, paths: list[str]) -> dict[str, str | None]:
    return P.source_ids(paths, rev)


def status(rel: str, prov: dict[str, Any], head: dict[str, str | None] | None = None) -> Status:
    """The freshness of the results file ``rel`` (repository path) with record ``prov``."""
    configs = prov.get("configs")
    kind = "training" if configs else "timing"
    st = Status(rel, kind, "certified", needs=needs(prov), command=prov.get("command"))
    sources = list(prov.get("sources") or [])
    if kind == "training":
        failed = prov.get("witness_failed")
        if failed:
            st.state = "stale"
            st.since = failed.get("commit")
            st.reasons = [f"at commit {str(failed.get('commit'))[:10]} the witness of "
                          f"`{' '.join(failed.get('config') or [])}` differs: {failed.get('where')}"]
            return st
        verified = prov.get("verified") or {}
        since = verified.get("commit") or prov.get("commit")
        st.since = since
        if not since or not sources:
            st.state, st.reasons = "unverified", ["it records no commit or sources"]
            return st
        ids = prov.get("source_ids") if since == prov.get("commit") else _ids_at(since, sources)
        now = head if head is not None else P.source_ids(sources)
        changed = [f for s in sources if (ids or {}).get(s) != now.get(s)
                   for f in code_changed(s, (ids or {}).get(s), now.get(s))]
        if prov.get("dirty_sources") and since == prov.get("commit"):
            st.state = "unverified"
            st.reasons = [f"made with uncommitted changes to {', '.join(prov['dirty_sources'])}"]
        elif changed:
            st.state = "unverified"
            st.reasons = [f"changed since {since[:10]}: {', '.join(changed[:6])}"
                          + (f" and {len(changed) - 6} more" if len(changed) > 6 else "")
                          + "; run `python -m experiments verify`"]
        return st
    # timing: the code it ran, unchanged? What its own process imported, and the sources
    # it lists: the code of the processes it launched (ranks, workers), which the
    # launcher's own imports do not show
    st.since = prov.get("commit")
    imported = prov.get("imported") or {}
    listed = prov.get("source_ids") or {}
    paths = sorted(set(timed_modules(imported)) | set(sources))
    if not paths:
        st.state, st.reasons = "missing", ["it records no state of the code it ran"]
        return st
    ids = {**{s: listed.get(s) for s in sources}, **imported}
    now = P.source_ids(paths)
    changed: list[str] = []
    for p in paths:
        if ids.get(p) != now.get(p):
            changed += [f for f in code_changed(p, ids.get(p), now.get(p)) if f not in changed]
    if prov.get("dirty_sources"):
        st.state = "stale"
        st.reasons = [f"made with uncommitted changes to {', '.join(prov['dirty_sources'])}"]
    if changed:
        st.state = "stale"
        st.reasons.append(f"code it ran changed: {', '.join(changed[:6])}"
                          + (f" and {len(changed) - 6} more" if len(changed) > 6 else ""))
    return st


def result_paths() -> list[Path]:
    return sorted({p for g in RESULTS_GLOBS for p in REPO.glob(g)})


def rel(path: Path) -> str:
    """A results file's name as the repository knows it (its own path elsewhere)."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def all_statuses() -> list[Status]:
    """Every results file's status, in path order."""
    out = []
    for p in result_paths():
        name = rel(p)
        try:
            _, prov = P.read(p)
        except ValueError as e:
            out.append(Status(name, "timing", "missing", reasons=[str(e).split(": ", 1)[-1]]))
            continue
        out.append(status(name, prov))
    return out
