"""Stress tests: the same job many times, counting the runs that abort
(``pytest -m stress``; not in the default suite, they take minutes).

- gossip.train under torchrun, the test suite's own commands, none of whose workers may
  abort ("terminate called without an active exception") or fail;
- AD-PSGD under torchrun, 12 runs of 4 ranks with one slow: every one exits 0, its
  passive ranks' serving threads joined, no abort at exit;
- a gloo collective still finishing on the worker thread while rank 0's interpreter
  exits: with ``gossip.comm.shutdown`` no run aborts.

The code is that of ``python -m experiments run stress_torchrun`` and ``python -m
experiments run teardown_race``, which run the same for longer, with their options
(an empty compile cache, busy processes beside the runs, core dumps, another checkout).
tests/test_teardown.py keeps the short teardown checks in the default suite.
"""

from __future__ import annotations

import os
import shutil

import pytest

from experiments import stress_torchrun, teardown_race
from tests.conftest import child_env

pytestmark = pytest.mark.stress

RUNS = int(os.environ.get("GOSSIP_STRESS_RUNS", "4"))


def test_the_suites_torchrun_commands_never_abort(tmp_path):
    env = {**child_env(), "PYTHONFAULTHANDLER": "1"}
    results = []
    for k in range(RUNS):
        work = tmp_path / f"job{k}"
        work.mkdir()
        for name, nproc, args in stress_torchrun.suite_commands(work):
            kind, rc, where = stress_torchrun.one_run(name, nproc, args, tmp_path, env, cores=False, timeout=300)
            results.append((name, kind, rc, where))
    assert [r for r in results if r[1] != "ok"] == []


def test_adpsgd_under_torchrun_exits_cleanly_12_of_12(tmp_path):
    env = {**child_env(), "PYTHONFAULTHANDLER": "1"}
    results = []
    for k in range(12):
        name, nproc, args = stress_torchrun.adpsgd_command(k, tmp_path)
        kind, rc, where = stress_torchrun.one_run(name, nproc, args, tmp_path, env, cores=False, timeout=300)
        results.append((k, kind, rc, where))
    assert [r for r in results if r[1] != "ok"] == []


def test_shutdown_joins_the_gloo_worker_before_the_interpreter_exits(tmp_path):
    env = {**child_env(), "PYTHONFAULTHANDLER": "1"}
    stall = shutil.which("gdb") is not None
    results = [teardown_race.one_run(k, "shutdown", stall, tmp_path, env) for k in range(RUNS)]
    assert [r for r in results if r[0] or r[1] != 0] == []
