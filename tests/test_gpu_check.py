"""experiments/gpu_check.py: the plan validates anywhere; sections are budgeted and recorded."""

from __future__ import annotations

import json
import sys

import pytest

from experiments import gpu_check
from tests.conftest import REPO, run_process


def test_dry_run_lists_and_validates_every_section(capsys):
    assert gpu_check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for name in ("env", "cuda_tests", "compress_speed", "bytes_cpu_vs_cuda", "simulate_cuda", "nccl"):
        assert name in out
    assert "plan valid" in out and "total budget 450 s" in out
    assert sum(share for _, share in gpu_check.SECTIONS.values()) <= 1.0
    assert sum(s for _, s in gpu_check.plan(gpu_check.BUDGET_S)) <= 8 * 60


def test_an_unknown_section_is_one_line_and_exit_2(capsys):
    assert gpu_check.main(["--dry-run", "--only", "env,warp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("gpu_check: error: unknown section warp; sections: env, cuda_tests, compress_speed, "
                   "bytes_cpu_vs_cuda, simulate_cuda, simulate_paths, nccl")


def test_sections_run_apart_and_an_exhausted_budget_is_recorded(tmp_path):
    r = run_process([sys.executable, "-m", "experiments.gpu_check", "--only", "env", "--budget", "40",
                     "--out", str(tmp_path / "a")], cwd=REPO, timeout=150)
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "a" / "gpu_check.json").read_text())
    assert doc["provenance"]["command"].endswith("--only env --budget 40 --out OUT/a")
    env = doc["results"]["sections"]["env"]
    assert env["status"] == "ran" and env["result"]["torch"] and "cuda_available" in env["result"]
    assert "- **env**: ran in" in (tmp_path / "a" / "gpu_check.md").read_text()
    r = run_process([sys.executable, "-m", "experiments.gpu_check", "--only", "env", "--budget", "1",
                     "--out", str(tmp_path / "b")], cwd=REPO, timeout=60)
    assert r.returncode == 1
    sec = json.loads((tmp_path / "b" / "gpu_check.json").read_text())["results"]["sections"]["env"]
    assert sec == {"status": "not run", "seconds": 0, "error": "the time budget was spent"}


def test_a_section_records_each_compressor_error_instead_of_stopping():
    """Without CUDA every compressor's row holds its error; with it, the comparison."""
    import argparse

    res = gpu_check.s_bytes_cpu_vs_cuda(argparse.Namespace())
    assert res["rows"] and all(("error" in x) != ("bytes_identical" in x) for x in res["rows"])


@pytest.mark.parametrize("bad", [["--budget", "0"], ["--reps", "0"]])
def test_bad_numbers_are_refused(bad, capsys):
    assert gpu_check.main([*bad, "--dry-run"]) == 2
    assert "gpu_check: error: --budget must be > 0, --numel and --reps >= 1" in capsys.readouterr().err


def test_gpu_check_results_name_no_path_of_the_machine():
    import tempfile

    from experiments import gpu_check

    line = f"{gpu_check.REPO}/experiments/gpu_check.py --out {tempfile.gettempdir()}/tmpx_1y/tr"
    assert gpu_check._portable(line) == "experiments/gpu_check.py --out TMP/tr"
