"""Every script in examples/ runs as a newcomer would run it, at a tiny size.

Each example is started as its own process from an empty temporary directory: once
with all nodes simulated in one process (where it can: a DDP script needs torchrun),
once under ``torchrun`` with 2 processes over gloo (4 for the example in groups). The test reads what the example prints;
a torchrun case's twin (the same nodes, simulated) runs inside the test's own process
and must print the same numbers. :data:`CASES` must name every file in examples/: a new
example without a case fails here.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import runpy
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from tests.conftest import REPO, run_process, torchrun, why

EXAMPLES = REPO / "examples"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py"))
TIMEOUT = 180  # seconds per process; a few steps take a few seconds even on a busy machine


@dataclass(frozen=True)
class Case:
    """How one example runs at a tiny size, and what its output must show."""

    simulate: list[str] | None
    """Flags for one process hosting every node; None for a script that only runs
    under torchrun (DDP)."""
    torchrun: list[str]
    """Flags for each of the 2 processes torchrun starts."""
    check: Callable[[str, list[str]], dict]
    """``check(stdout, flags)``: asserts on the output, returns what it read."""
    twin: list[str] | None = None
    """Flags that run the torchrun case with every node in one process; its output must
    be the same (run in the test's own process: the example already ran as a process of
    its own, simulated)."""
    nproc: int = 2
    """How many processes torchrun starts."""


# --------------------------------------------------------------------------- own_training_loop.py
_OWN_LOOP_LINE = re.compile(
    r"^(?P<algo>\S+) on (?P<topology>\S+) of (?P<n>\d+) nodes, (?P<steps>\d+) steps: "
    r"test accuracy (?P<acc>\S+), last training loss (?P<loss>\S+), "
    r"consensus distance (?P<distance>\S+), bytes sent per node (?P<bytes>[\d,]+)$",
    re.MULTILINE,
)


def _flag(flags: list[str], name: str, default: str) -> str:
    return flags[flags.index(name) + 1] if name in flags else default


def _check_own_training_loop(out: str, flags: list[str]) -> dict:
    found = _OWN_LOOP_LINE.findall(out)
    assert len(found) == 1, f"expected the summary line once (rank 0 only), got:\n{out}"
    m = _OWN_LOOP_LINE.search(out)
    assert m["algo"] == _flag(flags, "--algo", "ecd")
    assert m["topology"] == _flag(flags, "--topology", "ring")
    assert int(m["steps"]) == int(_flag(flags, "--steps", "200"))
    assert int(m["n"]) == int(_flag(flags, "--simulate", "2"))  # torchrun starts 2 here
    acc, loss, distance = float(m["acc"]), float(m["loss"]), float(m["distance"])
    sent = int(m["bytes"].replace(",", ""))
    # two balanced classes: chance is 0.5; a few steps of SGD already pass 0.9
    assert 0.75 < acc <= 1.0, out
    assert math.isfinite(loss) and 0 < loss < math.log(2), out
    assert math.isfinite(distance) and distance >= 0, out
    assert sent > 0, out
    return {"n": int(m["n"]), "acc": acc, "loss": loss, "distance": distance, "bytes": sent}


# --------------------------------------------------------------------------- ddp_hook.py
_DDP_LINE = re.compile(
    r"^(?P<algo>\S+) under DDP on (?P<n>\d+) processes, (?P<steps>\d+) steps: "
    r"test accuracy (?P<acc>\S+), last training loss (?P<loss>\S+), "
    r"bytes sent per process (?P<bytes>[\d,]+) \(full-precision all-reduce (?P<full>[\d,]+)\)$",
    re.MULTILINE,
)


def _check_ddp_hook(out: str, flags: list[str]) -> dict:
    found = _DDP_LINE.findall(out)
    assert len(found) == 1, f"expected the summary line once (rank 0 only), got:\n{out}"
    m = _DDP_LINE.search(out)
    assert m["algo"] == _flag(flags, "--algo", "efsgd")
    assert int(m["n"]) == 2 and int(m["steps"]) == int(_flag(flags, "--steps", "200"))
    acc, loss = float(m["acc"]), float(m["loss"])
    sent, full = int(m["bytes"].replace(",", "")), int(m["full"].replace(",", ""))
    assert 0.75 < acc <= 1.0, out
    assert math.isfinite(loss) and 0 < loss < math.log(2), out
    # 8-bit codes after one full-precision warm-up step: well under a third of fp32
    assert 0 < sent < full / 3, out
    return {"acc": acc, "loss": loss, "bytes": sent}


# --------------------------------------------------------------------------- ddp_gpt_powersgd.py
_GPT_LINE = re.compile(
    r"^gpt \((?P<params>[\d,]+) params\) with powersgd rank (?P<rank>\d+) under DDP on (?P<n>\d+) processes, "
    r"(?P<steps>\d+) steps: held-out bits per byte (?P<before>\S+) -> (?P<after>\S+), last training loss "
    r"(?P<loss>\S+) bits per byte, bytes sent per process (?P<bytes>[\d,]+) \(full-precision all-reduce "
    r"(?P<full>[\d,]+)\)$",
    re.MULTILINE,
)


def _check_ddp_gpt_powersgd(out: str, flags: list[str]) -> dict:
    found = _GPT_LINE.findall(out)
    assert len(found) == 1, f"expected the summary line once (rank 0 only), got:\n{out}"
    m = _GPT_LINE.search(out)
    assert int(m["n"]) == 2 and int(m["steps"]) == int(_flag(flags, "--steps", "200"))
    assert int(m["rank"]) == int(_flag(flags, "--rank", "2"))
    before, after, loss = float(m["before"]), float(m["after"]), float(m["loss"])
    # an untrained GPT is near uniform over 256 bytes (8 bits); a few steps learn the
    # byte frequencies of source code
    assert 7.0 < before < 9.0 and after < before - 1.0, out
    assert math.isfinite(loss) and 0 < loss < 8.0, out
    sent, full = int(m["bytes"].replace(",", "")), int(m["full"].replace(",", ""))
    # rank-2 factors after one full-precision warm-up step: a small fraction of fp32
    assert 0 < sent < full / 3, out
    return {"before": before, "after": after, "bytes": sent}


# --------------------------------------------------------------------------- groups_ddp.py
_GROUPS_LINE = re.compile(
    r"^(?P<algo>\S+) between (?P<groups>\d+) groups of (?P<size>\d+) \((?P<form>sliced|unsliced)\), (?P<steps>\d+) "
    r"steps: test accuracy (?P<acc>\S+), last training loss (?P<loss>\S+), bytes sent per rank between groups "
    r"(?P<inter>[\d,]+), inside its group (?P<intra>[\d,]+) \(and DDP's all-reduce\), members agree: (?P<same>\S+)$",
    re.MULTILINE,
)


def _check_groups_ddp(out: str, flags: list[str]) -> dict:
    found = _GROUPS_LINE.findall(out)
    assert len(found) == 1, f"expected the summary line once (rank 0 only), got:\n{out}"
    m = _GROUPS_LINE.search(out)
    assert (m["algo"], m["groups"], m["size"], m["form"]) == ("diloco", "2", "2", "sliced")
    steps = int(_flag(flags, "--steps", "200"))
    assert int(m["steps"]) == steps and m["same"] == "True", out
    acc, loss = float(m["acc"]), float(m["loss"])
    assert 0.75 < acc <= 1.0, out
    assert math.isfinite(loss) and 0 < loss < math.log(2), out
    # 20 -> 64 -> 2: 1,474 parameters, a slice of 737 per member; every 5th step the
    # member all-reduces its slice with the other group's (2 nodes: 4 x 737 bytes), and
    # all-gathers the slices inside its group (1 slice: 4 x 737 bytes)
    rounds = steps // 5
    assert int(m["inter"].replace(",", "")) == rounds * 4 * 737, out
    assert int(m["intra"].replace(",", "")) == rounds * 4 * 737, out
    return {"acc": acc, "loss": loss}


CASES: dict[str, Case] = {
    "ddp_hook.py": Case(
        simulate=None,
        torchrun=["--algo", "efsgd", "--opt", "compressor=quant:bits=8", "--steps", "20"],
        check=_check_ddp_hook,
    ),
    "ddp_gpt_powersgd.py": Case(
        simulate=None,
        torchrun=["--steps", "20", "--context", "32", "--layers", "1", "--width", "32", "--batch-size", "8"],
        check=_check_ddp_gpt_powersgd,
    ),
    "groups_ddp.py": Case(
        simulate=None,
        torchrun=["--group-size", "2", "--algo", "diloco", "--opt", "local_steps=5", "--steps", "20"],
        check=_check_groups_ddp,
        nproc=4,
    ),
    "own_training_loop.py": Case(
        simulate=["--simulate", "4", "--algo", "ecd", "--bits", "8", "--steps", "20"],
        torchrun=["--topology", "complete", "--steps", "20"],  # a ring needs 3 nodes
        check=_check_own_training_loop,
        twin=["--topology", "complete", "--steps", "20", "--simulate", "2"],
    ),
}


# --------------------------------------------------------------------------- tests
def test_every_example_has_a_case():
    assert SCRIPTS, f"no examples found in {EXAMPLES}"
    missing, stale = sorted(set(SCRIPTS) - set(CASES)), sorted(set(CASES) - set(SCRIPTS))
    assert not missing, f"examples without a case in tests/test_examples.py CASES: {missing}"
    assert not stale, f"CASES names examples that no longer exist: {stale}"


def _case(name: str) -> Case:
    if name not in CASES:
        pytest.fail(f"examples/{name} has no case in tests/test_examples.py CASES: add how it runs "
                    "at a tiny size and what its output must show")
    return CASES[name]


def _run(cmd: list[str], cwd) -> str:
    r = run_process(cmd, cwd=cwd, timeout=TIMEOUT)
    assert r.returncode == 0, (
        f"{' '.join(cmd[1:])} exited with {r.returncode}\n--- stdout\n{r.stdout[-3000:]}\n"
        f"--- stderr\n{r.stderr[-5000:]}"
    )
    return r.stdout


def _run_here(path, flags: list[str], cwd, monkeypatch) -> str:
    """``python path *flags`` as ``__main__`` in this process (runpy), with the ranks'
    thread count (one): what it prints."""
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [str(path), *flags])
    out = io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out), torch.random.fork_rng(devices=[]):
            runpy.run_path(str(path), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    return out.getvalue()


@pytest.mark.parametrize("name", [s for s in SCRIPTS if s not in CASES or CASES[s].simulate is not None])
def test_example_runs_simulated(name, tmp_path):
    case = _case(name)
    out = _run([sys.executable, str(EXAMPLES / name), *case.simulate], tmp_path)
    case.check(out, case.simulate)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", SCRIPTS)
def test_example_runs_under_torchrun(name, tmp_path, monkeypatch):
    case = _case(name)
    r = torchrun(case.nproc, str(EXAMPLES / name), *case.torchrun, timeout=TIMEOUT, cwd=tmp_path)
    assert r.returncode == 0, why(r)
    out = r.stdout
    got = case.check(out, case.torchrun)
    if case.twin is not None:
        # the simulation is the same computation: the same numbers, to the printed digits
        twin = _run_here(EXAMPLES / name, case.twin, tmp_path, monkeypatch)
        assert case.check(twin, case.twin) == got, f"torchrun:\n{out}\nsimulated:\n{twin}"
