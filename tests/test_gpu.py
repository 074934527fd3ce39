"""What only a GPU can check, as tests (``pytest -m gpu`` on a machine with CUDA).

The same code as the GPU check that writes experiments/results/gpu_check.json and
sim_gpu_paths.json with their provenance (``python -m experiments run gpu_check``,
``python -m experiments run sim_gpu_check``): here each part asserts what it found.
Without a CUDA device every test is skipped, saying so.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from experiments import gpu_check, sim_gpu_check

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def _nccl() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_nccl_available()


def test_every_compressor_sends_the_same_bytes_from_cpu_and_cuda():
    res = gpu_check.s_bytes_cpu_vs_cuda(argparse.Namespace())
    assert [r for r in res["rows"] if "error" in r] == []
    assert [r["compressor"] for r in res["rows"] if not r["bytes_identical"]] == []


def test_a_simulated_run_trains_on_cuda():
    res = gpu_check.s_simulate_cuda(argparse.Namespace(section_timeout=300.0))
    assert res["exit"] == 0, res["stderr_tail"]


def test_the_loop_and_vectorized_paths_agree_on_cuda(tmp_path, capsys):
    rows = sim_gpu_check.check_paths(tmp_path)
    assert {r["algo"] for r in rows} == {"dpsgd", "dcd", "muloco"}
    assert [r for r in rows if not r["ok"]] == []


@pytest.mark.skipif(not _nccl(), reason="NCCL is not available")
def test_nccl_collectives_the_cli_and_the_ddp_hook_under_torchrun():
    res = gpu_check.s_nccl(argparse.Namespace(section_timeout=400.0))
    coll = res["communicator_collectives"]
    assert coll["exit"] == 0, coll["stderr_tail"]
    assert all(v["ok"] for v in coll["result"].values() if isinstance(v, dict)), coll["result"]
    assert coll["result"]["backend"] == "nccl"
    for name in ("train_allreduce", "ddp_hook_efsgd", "ddp_hook_powersgd"):
        assert res[name]["exit"] == 0, f"{name}: {res[name]['stderr_tail']}"
