"""The shape of the code: short functions, and a training run that reads in one screen.

Counted with ``ast`` (``end_lineno - lineno + 1`` of every ``def``, nested ones and
methods included), so a docstring or a comment counts like code: a function that
needs more than 60 lines does more than one thing."""

from __future__ import annotations

import ast

from tests.conftest import REPO

LONGEST = 60
#: functions known to be longer, each with the reason it is still allowed
KNOWN: set[str] = set()


def long_functions(root) -> dict[str, int]:
    """``{"path::name": lines}`` of every function under ``root`` over :data:`LONGEST` lines."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST:
                    found[f"{path.relative_to(REPO).as_posix()}::{node.name}"] = lines
    return found


def test_no_function_in_gossip_is_longer_than_60_lines():
    too_long = {k: v for k, v in long_functions(REPO / "gossip").items() if k not in KNOWN}
    assert too_long == {}, f"functions over {LONGEST} lines: {too_long}"


def test_the_counter_finds_a_long_function(tmp_path, monkeypatch):
    body = "\n".join(f"        x{i} = {i}" for i in range(LONGEST))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\nclass C:\n    def long(self):\n{body}\n")
    monkeypatch.setattr("tests.test_structure.REPO", tmp_path)
    assert long_functions(tmp_path) == {"m.py::long": LONGEST + 1}


def test_the_run_reads_in_one_screen():
    """gossip/train/loop.py orchestrates; the components (assembly, agreement,
    communicators, hooks, checkpoint, metrics, evaluation, timing) do the jobs."""
    path = REPO / "gossip" / "train" / "loop.py"
    assert "class Run" in path.read_text(encoding="utf-8")  # the run itself, not a forwarding module
    assert len(path.read_text(encoding="utf-8").splitlines()) < 400
