"""Under torchrun, ranks agree on their data: the cross-rank check before the first
exchange compares a digest of every rank's data set, and a rank holding other data
(a ``--data-dir`` with other images of the same size) stops every rank with one line
naming it and what differs, instead of training silently."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.conftest import child_env, torchrun, why


def rank_blobs(seed: int):
    """The user's data: rank 1's training inputs differ (other files, same size)."""
    g = torch.Generator().manual_seed(seed)
    centres = 3 * torch.randn(3, 6, generator=g)

    def draw(n):
        y = torch.randint(0, 3, (n,), generator=g)
        return centres[y] + torch.randn(n, 6, generator=g), y

    (xtr, ytr), test = draw(256), draw(64)
    if os.environ.get("RANK") == "1":
        xtr = xtr.flip(0)  # the same values, in another order: only the digest can tell
    return (xtr, ytr), test


def test_ranks_on_other_data_stop_with_one_line_each(tmp_path):
    out = tmp_path / "run"
    r = torchrun(2, "-m", "gossip.train", "--algo", "allreduce", "--data", "tests.test_nothing_lost_dist:rank_blobs",
                 "--model", "logreg", "--max-steps", "2", "--no-progress", "--timeout", "60", "--out", str(out),
                 timeout=180, cwd=tmp_path, env=child_env())
    assert r.returncode != 0, why(r)
    lines = [ln for ln in r.stderr.splitlines() if "gossip.train: error:" in ln]
    assert len(lines) == 2, why(r)
    for k in (0, 1):
        line = next(ln for ln in lines if ln.startswith(f"[rank {k}]"))
        assert "rank(s) [1] hold other data than rank 0" in line and "training inputs" in line, line
        assert "training labels" not in line  # only what differs
    for log in Path(r.logs).rglob("stderr.log"):  # each rank's own stream (torchrun adds its own traceback)
        assert "Traceback" not in log.read_text(), log.read_text()
    assert not (out / "config.json").exists()  # nothing written
