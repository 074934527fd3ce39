"""pandas is an optional extra (``gossip[analysis]``): the library and the training CLI
never need it, and gossip.tools.analysis says in one line how to get it (at its old
path, gossip.analysis, too)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

_BLOCK = "import sys; sys.modules['pandas'] = None; "  # as if pandas were not installed


def _py(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCK + code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_the_library_and_the_cli_import_without_pandas():
    out = _py("import gossip, gossip.runtime, gossip.train, gossip.train.loop, gossip.ddp, gossip.data, gossip.tools, "
              "gossip.tools.crossover, gossip.tools.leaderboard; print('ok')")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_analysis_without_pandas_says_how_to_install_it():
    for module in ("gossip.tools.analysis", "gossip.analysis"):
        out = _py(f"import {module}")
        assert out.returncode == 1
        assert "ImportError: gossip.tools.analysis needs pandas: pip install 'gossip[analysis]'" in out.stderr
