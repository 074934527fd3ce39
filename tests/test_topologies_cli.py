"""Tests of ``python -m topologies``.

Real subprocesses check what only a process shows (exit status, stderr, no
traceback) for every kind of failure: argparse types and choices, unknown flags,
missing arguments, builder refusals. Each run pays for importing scipy (about a
second on a busy machine), so they are started together, a few at a time, by one
module fixture. Every case, those included, also runs in-process through ``main``.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

import topologies
from topologies.__main__ import main

from tests.conftest import REPO


REPORTS = {
    "ring": ["ring", "8"],
    "torus": ["torus", "16"],
    "expander": ["expander", "64", "--degree", "4", "--seed", "0"],
    "star": ["star", "10"],
    "complete": ["complete", "6"],
    "swap-free": ["ring", "8", "--lazy", "--weights", "metropolis"],
    "json-ring": ["ring", "8", "--json"],
    "json-star": ["star", "10", "--json"],
    "json-complete": ["complete", "5", "--json"],
    "json-torus": ["torus", "12", "--rows", "3", "--json"],
    "list": ["--list"],
    "seed-on-ring": ["ring", "8", "--seed", "3"],
}

ERRORS = {
    "unknown name": (["rng", "8"], r"unknown topology 'rng'; known topologies: complete, expander, exponential, hypercube, matching, onepeer-exp, ring, star, torus"),
    "ring too small": (["ring", "2"], r"ring: n must be >= 3, got n=2"),
    "torus too small": (["torus", "7"], r"torus: n must be >= 9, got n=7"),
    "torus no shape": (["torus", "14"], r"torus: n=14 has no factorisation rows x cols with both sides >= 3; use an n such as 9, 12, 15, 16, or give rows and cols"),
    "torus side < 3": (["torus", "16", "--rows", "2", "--cols", "8"], r"torus: rows and cols must both be >= 3 .*got rows=2, cols=8"),
    "torus shape != n": (["torus", "16", "--rows", "4", "--cols", "5"], r"torus: rows \* cols must equal n, got rows=4, cols=5"),
    "expander odd": (["expander", "5", "--degree", "3"], r"expander: n \* degree must be even \(each edge has two ends\), got n=5, degree=3"),
    "expander d >= n": (["expander", "4", "--degree", "4"], r"expander: degree must be < n .*got n=4, degree=4"),
    "expander d < 3": (["expander", "10", "--degree", "2"], r"expander: degree must be >= 3, got degree=2"),
    "hypercube": (["hypercube", "12"], r"hypercube: n must be a power of 2 .*got n=12; the nearest are 8 and 16"),
    "negative n": (["ring", "-5"], r"argument N: must be a non-negative integer, got '-5'"),
    "fractional n": (["ring", "3.5"], r"argument N: must be a non-negative integer, got '3\.5'"),
    "word n": (["ring", "eight"], r"argument N: must be a non-negative integer, got 'eight'"),
    "fractional degree": (["expander", "10", "--degree", "2.5"], r"argument --degree: must be a non-negative integer, got '2\.5'"),
    "negative seed": (["expander", "10", "--seed", "-1"], r"argument --seed: must be a non-negative integer, got '-1'"),
    "uniform on star": (["star", "10", "--weights", "uniform"], r"star: weights='uniform' needs a regular graph .*use weights='metropolis'"),
    "bad weights": (["ring", "8", "--weights", "max"], r"argument --weights: invalid choice: 'max' \(choose from 'uniform', 'metropolis'\)"),
    "flag for another topology": (["ring", "8", "--degree", "3"], r"ring: unknown parameter 'degree'; ring accepts weights, lazy"),
    "missing n": (["ring"], r"give a topology NAME and a node count N \(e\.g\. 'topologies ring 8'\), or --list"),
    "nothing": ([], r"give a topology NAME and a node count N"),
    "unknown flag": (["ring", "8", "--bogus"], r"unrecognized arguments: --bogus"),
    "list with a name": (["--list", "ring"], r"--list takes no NAME or N"),
}


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "topologies", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )


#: the cases that also run as subprocesses: the outputs, a warning, and one case per
#: way of failing (registry, builder, argparse type, argparse choice, unknown flag,
#: missing argument)
IN_SUBPROCESS = [
    "ring", "list", "seed-on-ring",
    "unknown name", "expander odd", "fractional n", "bad weights", "unknown flag", "missing n",
]


@pytest.fixture(scope="module")
def runs() -> dict[str, subprocess.CompletedProcess]:
    every = {**REPORTS, **{k: v[0] for k, v in ERRORS.items()}}
    jobs = {key: every[key] for key in IN_SUBPROCESS}
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {key: pool.submit(_run, args) for key, args in jobs.items()}
        return {key: f.result() for key, f in futures.items()}


class _Result:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture(scope="module")
def calls() -> dict[str, _Result]:
    """Every case through ``main`` in this process, captured like a subprocess."""
    import contextlib
    import io

    every = {**REPORTS, **{k: v[0] for k, v in ERRORS.items()}}
    results = {}
    for key, args in every.items():
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(args)
            except SystemExit as e:
                code = e.code
        results[key] = _Result(code, out.getvalue(), err.getvalue())
    return results


def _fields(stdout: str) -> dict[str, str]:
    return {line[:14].strip(): line[15:] for line in stdout.splitlines()}


def test_text_report_of_a_ring(runs):
    r = runs["ring"]
    assert r.returncode == 0 and r.stderr == ""
    f = _fields(r.stdout)
    assert f["topology"] == "ring (weights=uniform, lazy=False)"
    assert f["n"] == "8" and f["degree"] == "2"
    lambda2 = (1 + 2 * math.cos(2 * math.pi / 8)) / 3
    assert float(f["lambda_2"]) == pytest.approx(lambda2, abs=1e-11)
    assert float(f["lambda_n"]) == pytest.approx(-1 / 3, abs=1e-11)
    assert float(f["rho"]) == pytest.approx(lambda2, abs=1e-11)
    assert float(f["spectral gap"]) == pytest.approx(1 - lambda2, abs=1e-11)
    assert f["steps to 1e-3"] == "32  (ceil(log(1e-3) / log(rho)))"
    assert f["spectrum"] == "dense (scipy.linalg.eigvalsh)"


def test_text_reports_of_torus_expander_star(calls):
    runs = calls
    torus = _fields(runs["torus"].stdout)
    assert torus["topology"] == "torus (rows=4, cols=4, weights=uniform, lazy=False)"
    assert float(torus["lambda_2"]) == pytest.approx(0.6, abs=1e-11)
    expander = _fields(runs["expander"].stdout)
    assert expander["topology"] == "expander (degree=4, seed=0, weights=uniform, lazy=False)"
    topo = topologies.build("expander", 64, degree=4, seed=0)
    assert float(expander["lambda_2"]) == pytest.approx(topo.lambda2, abs=1e-11)
    star = _fields(runs["star"].stdout)
    assert star["degree"] == "min 1, max 9"
    assert star["topology"] == "star (weights=metropolis, lazy=False)"
    lazy = _fields(runs["swap-free"].stdout)
    assert lazy["topology"] == "ring (weights=metropolis, lazy=True)"
    assert float(lazy["lambda_n"]) >= 0


def test_rho_zero_takes_one_step(calls):
    f = _fields(calls["complete"].stdout)
    assert f["rho"] == "0"
    assert f["steps to 1e-3"] == "1  (rho = 0: one step reaches the exact average)"


def test_json_has_exactly_the_documented_keys(calls):
    runs = calls
    keys = ["name", "n", "min_degree", "max_degree", "lambda2", "lambdan", "rho", "spectral_gap", "steps_to_1e-3"]
    for case, name in [("json-ring", "ring"), ("json-star", "star"), ("json-complete", "complete"), ("json-torus", "torus")]:
        r = runs[case]
        assert r.returncode == 0 and r.stderr == ""
        assert len(r.stdout.strip().splitlines()) == 1
        obj = json.loads(r.stdout)
        assert list(obj) == keys and obj["name"] == name
    ring = json.loads(runs["json-ring"].stdout)
    assert ring == topologies.ring(8).summary()
    assert ring["steps_to_1e-3"] == 32
    star = json.loads(runs["json-star"].stdout)
    assert (star["min_degree"], star["max_degree"]) == (1, 9)
    complete = json.loads(runs["json-complete"].stdout)
    assert complete["rho"] == 0 and complete["steps_to_1e-3"] == 1
    assert json.loads(runs["json-torus"].stdout)["n"] == 12


def test_list_names_every_topology_with_a_description(runs):
    r = runs["list"]
    assert r.returncode == 0 and r.stderr == ""
    lines = r.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == list(topologies.available())
    for line in lines:
        name, description = line.split(maxsplit=1)
        assert description == topologies.describe(name)


def test_seed_on_a_deterministic_topology_warns_on_one_line(runs):
    r = runs["seed-on-ring"]
    assert r.returncode == 0
    assert r.stderr == "topologies: warning: --seed has no effect on ring, which is not random\n"
    assert r.stdout == runs["ring"].stdout


def _assert_one_line_error(r, case: str) -> None:
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("topologies: error: ")
    assert "Traceback" not in r.stderr
    assert re.search(ERRORS[case][1], lines[0]), lines[0]


@pytest.mark.parametrize("case", [c for c in IN_SUBPROCESS if c in ERRORS])
def test_bad_input_exits_2_with_one_line_in_a_real_process(runs, case):
    _assert_one_line_error(runs[case], case)


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_exits_2_with_one_line(calls, case):
    _assert_one_line_error(calls[case], case)


def test_every_subprocess_case_matches_its_in_process_run(runs, calls):
    for case in IN_SUBPROCESS:
        assert (runs[case].returncode, runs[case].stdout, runs[case].stderr) == (
            calls[case].returncode, calls[case].stdout, calls[case].stderr
        ), case


def test_main_can_be_called_in_process(capsys):
    assert main(["hypercube", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["lambda2"] == pytest.approx(0.5)
    with pytest.raises(SystemExit) as e:
        main(["hypercube", "9"])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("topologies: error: hypercube: n must be a power of 2")
