"""The pre-commit hook (.githooks/pre-commit) renders what is being committed (the index),
never the working tree: an unstaged edit never lands through it, and a page whose
render changes while it has unstaged edits of its own stops the commit.

Each test builds a tiny git repository whose renderer is a few lines of stdlib Python
(the hook's logic is what is tested here; the real render is tests/test_render.py's)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_RENDER = '''
import json, pathlib, re
root = pathlib.Path(__file__).resolve().parents[1]
v = json.loads((root / "experiments/results/x.json").read_text())["v"]
page = root / "docs/page.md"
text = page.read_text()
new = re.sub(r"(<!-- results:x -->\\n).*?(<!-- /results:x -->)", rf"\\g<1>value {v}\\n\\2", text, flags=re.S)
if new != text:
    page.write_text(new)
    print("docs/page.md: tables re-rendered")
'''

_PAGE = "# page\n\nintro\n\n<!-- results:x -->\nvalue 1\n<!-- /results:x -->\n"

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_CONFIG_NOSYSTEM="1", HOME=str(repo.parent), PATH=os.environ.get("PATH", ""))
    # the hook runs the renderer with this interpreter's directory first on PATH (python3)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.org",
                           "-c", "core.hooksPath=.githooks", "-c", "commit.gpgsign=false", *args],
                          cwd=repo, capture_output=True, text=True, env=env, timeout=120, check=check)


def _write(repo: Path, rel: str, text: str) -> None:
    (repo / rel).parent.mkdir(parents=True, exist_ok=True)
    (repo / rel).write_text(text)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    r = tmp_path / "r"
    r.mkdir()
    _git(r, "init", "-q", "-b", "main")
    _write(r, ".githooks/pre-commit", (REPO / ".githooks/pre-commit").read_text())
    (r / ".githooks/pre-commit").chmod(0o755)
    _write(r, "experiments/__init__.py", "")
    _write(r, "experiments/render.py", _RENDER)
    _write(r, "experiments/results/x.json", json.dumps({"v": 1}))
    _write(r, "docs/page.md", _PAGE)
    _write(r, "docs/other.md", "other\n")
    _write(r, ".gitignore", "__pycache__/\n")
    _git(r, "add", "-A")
    _git(r, "commit", "-q", "-m", "start")
    return r


def _committed(repo: Path, rel: str) -> str:
    return _git(repo, "show", f"HEAD:{rel}").stdout


def test_the_hook_renders_the_staged_results_and_leaves_unstaged_edits_out(repo: Path) -> None:
    _write(repo, "experiments/results/x.json", json.dumps({"v": 2}))
    _git(repo, "add", "experiments/results/x.json")
    # after staging: the results file changes again, and another page is edited; neither staged
    _write(repo, "experiments/results/x.json", json.dumps({"v": 3}))
    _write(repo, "docs/other.md", "other, edited\n")
    out = _git(repo, "commit", "-q", "-m", "results v2")
    assert "re-rendered and added: docs/page.md" in out.stdout + out.stderr
    assert "value 2\n" in _committed(repo, "docs/page.md")  # the staged figure, not the working tree's
    assert _committed(repo, "docs/other.md") == "other\n"
    assert json.loads(_committed(repo, "experiments/results/x.json")) == {"v": 2}
    # the working tree keeps its unstaged edits, and has the committed render
    assert json.loads((repo / "experiments/results/x.json").read_text()) == {"v": 3}
    assert (repo / "docs/other.md").read_text() == "other, edited\n"
    assert (repo / "docs/page.md").read_text() == _committed(repo, "docs/page.md")
    status = _git(repo, "status", "--porcelain").stdout.splitlines()
    assert sorted(status) == [" M docs/other.md", " M experiments/results/x.json"]


def test_a_page_with_unstaged_edits_whose_render_changes_stops_the_commit(repo: Path) -> None:
    _write(repo, "experiments/results/x.json", json.dumps({"v": 2}))
    _git(repo, "add", "experiments/results/x.json")
    _write(repo, "docs/page.md", _PAGE.replace("intro", "intro, being edited"))
    head = _git(repo, "rev-parse", "HEAD").stdout
    out = _git(repo, "commit", "-q", "-m", "results v2", check=False)
    assert out.returncode != 0
    assert "docs/page.md" in out.stderr and "unstaged" in out.stderr
    assert _git(repo, "rev-parse", "HEAD").stdout == head
    assert "being edited" in (repo / "docs/page.md").read_text()  # the edit is untouched
    assert "value 1\n" in (repo / "docs/page.md").read_text()


def test_a_commit_whose_render_is_current_adds_nothing(repo: Path) -> None:
    _write(repo, "docs/other.md", "other, edited\n")
    _write(repo, "experiments/results/x.json", json.dumps({"v": 5}))  # unstaged
    _git(repo, "add", "docs/other.md")
    out = _git(repo, "commit", "-q", "-m", "edit other")
    assert "re-rendered" not in out.stdout + out.stderr
    assert _git(repo, "show", "--name-only", "--format=", "HEAD").stdout.split() == ["docs/other.md"]
    assert "value 1\n" in _committed(repo, "docs/page.md")
