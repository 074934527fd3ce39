"""tests/_dist.run_world: results by rank, failures with tracebacks, hard timeout."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests._dist import WorldError, WorldTimeoutError, run_world

pytestmark = pytest.mark.multiprocess


def _rank_info(offset: int, *, scale: int = 1) -> dict:
    x = torch.tensor([dist.get_rank() + offset])
    dist.all_reduce(x)
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "sum": int(x) * scale,
        "env": (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ.get("EXTRA")),
        "threads": torch.get_num_threads(),
        "tensor": torch.arange(3) * dist.get_rank(),
    }


def test_results_come_back_by_rank() -> None:
    res = run_world(3, _rank_info, 1, scale=2, env={"EXTRA": "x"})
    assert [r["rank"] for r in res] == [0, 1, 2]
    assert all(r["world"] == 3 and r["sum"] == 12 and r["threads"] == 1 for r in res)
    assert res[2]["env"] == ("2", "3", "x")
    assert torch.equal(res[2]["tensor"], torch.tensor([0, 2, 4]))


def _fail_on_odd() -> int:
    if dist.get_rank() % 2:
        raise KeyError(f"rank {dist.get_rank()} is odd")
    return dist.get_rank()


def test_a_failing_rank_raises_world_error_with_its_traceback() -> None:
    with pytest.raises(WorldError, match=r"failed on ranks \[1, 3\]") as ei:
        run_world(4, _fail_on_odd)
    f = ei.value.failures[3]
    assert isinstance(f.exception, KeyError) and "_fail_on_odd" in f.traceback
    assert ei.value.results[2] == 2
    res = run_world(4, _fail_on_odd, return_exceptions=True)
    assert res[0] == 0 and isinstance(res[1], KeyError)


def _hang_on_rank_1() -> int:
    if dist.get_rank() == 1:
        time.sleep(60)
    return 0


def _die_on_rank_0() -> int:
    if dist.get_rank() == 0:
        os._exit(3)
    return 1


def test_a_hung_world_is_killed_within_the_timeout() -> None:
    t0 = time.monotonic()
    with pytest.raises(WorldTimeoutError, match=r"ranks \[1\] never reported") as ei:
        run_world(2, _hang_on_rank_1, timeout=3)
    assert ei.value.missing == [1] and ei.value.results[0] == 0
    assert time.monotonic() - t0 < 12


def test_a_rank_that_dies_is_reported() -> None:
    with pytest.raises(WorldError, match=r"rank 0 died without reporting \(exit code 3\)"):
        run_world(2, _die_on_rank_0, timeout=20)
