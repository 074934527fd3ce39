"""experiments/bench_data.py: the benchmark's data sets, built once and cached."""

from __future__ import annotations

from pathlib import Path

import torch


def test_two_builders_of_the_same_set_at_once_both_finish_with_the_same_data(tmp_path, monkeypatch):
    """Two builders of one MNIST-1D size racing to its cache file (verify's witness
    workers do): each writes a temporary file of its own and either rename wins. The
    race is made certain here: the second build runs, start to end, between the first's
    write and its rename."""
    from experiments import bench_data

    monkeypatch.setenv("GOSSIP_CACHE", str(tmp_path))
    real_replace, inner = Path.replace, []

    def replace_after_a_rival(self, target):
        if not inner:  # between this builder's write and its rename, the rival does both
            inner.append(None)
            inner[0] = bench_data._mnist1d(1000)
        return real_replace(self, target)

    monkeypatch.setattr(Path, "replace", replace_after_a_rival)
    first = bench_data._mnist1d(1000)
    assert torch.equal(first.x_train, inner[0].x_train) and torch.equal(first.y_test, inner[0].y_test)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench-mnist1d-n1000.npz"]  # no temporary left
    again = bench_data._mnist1d(1000)  # from the cache
    assert torch.equal(again.x_train, first.x_train)
