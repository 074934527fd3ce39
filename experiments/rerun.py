"""``make results`` (``python -m experiments results``): re-run what is not certified.

The plan: every results file that ``python -m experiments stale`` does not call
certified, after ``verify`` has had its say (an *unverified* training result is
verified first: a re-run is only for what a witness found changed). Its order:

1. results this machine can re-run (CPU), then the netns cluster's when run as root;
   GPU results are listed, never run here;
2. within those, a file before any file whose command reads it (``--results``,
   ``--netns-results``: the netns check reads the benchmark's file, the gap reads the
   netns check's);
3. the shortest first (the ``seconds`` their last run took), so a budget buys the most.

Each command is the one its provenance records, run from the repository root with
its scratch folders (``OUT/...``) under ``runs/``. After each run the file is
re-certified (its witnesses recorded) and the tables re-rendered. ``--budget
MINUTES`` stops starting new runs once that much time has passed; running it again
resumes with what is left (a finished file is certified, so it is not run again).
It prints what it ran, what is left, and the estimated time of the rest.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from experiments import _provenance as P
from experiments import freshness

__all__ = ["plan", "main", "list_all", "command_of", "wait_for_quiet", "QUIET_LOAD"]

REPO = P.REPO


def command_of(prov: dict) -> str:
    """The recorded command as this checkout runs it (in a shell): scratch folders under
    runs/, an environment folder recorded as ``PATH`` a fresh temporary one, an experiment
    started by its path (the old form) started as a module, by this interpreter."""
    from experiments import study

    cmd = study.as_study_command(P.as_module(str(prov.get("command") or "")))
    cmd = re.sub(r"(?<![\w/])OUT/", "runs/", cmd)
    # an absolute path in the recorder's environment is written PATH: a fresh, empty
    # folder here (a cache folder named PATH in the checkout would carry over between runs)
    cmd = re.sub(r"(?:(?<=^)|(?<=\s))([A-Z_][A-Z0-9_]*)=PATH(?=\s)", r'\1="$(mktemp -d)"', cmd)
    # the interpreter running this, not whichever python the shell finds first
    cmd = re.sub(r"(?:(?<=^)|(?<=\s))python3?(?=\s)", lambda m: shlex.quote(sys.executable), cmd, count=1)
    if cmd.startswith("sudo ") and os.geteuid() == 0:
        cmd = cmd[len("sudo "):]
    return cmd


def _reads(cmd: str) -> list[str]:
    """The results files a command reads (its --results/--netns-results inputs that
    are not what it writes)."""
    try:
        parts = shlex.split(cmd)
    except ValueError:
        return []
    return [parts[i + 1] for i, a in enumerate(parts[:-1]) if a in ("--results", "--netns-results")
            and parts[i + 1].endswith(".json")]


def plan() -> list[freshness.Status]:
    """The results to re-run, in order (see the module docstring)."""
    todo = [s for s in freshness.all_statuses() if s.state in ("stale", "unverified", "missing") and s.command]
    rank = {"cpu": 0, "netns": 1, "gpu": 2}
    secs = {}
    for s in todo:
        try:
            secs[s.results] = float(P.read(REPO / s.results)[1].get("seconds") or 0)
        except ValueError:
            secs[s.results] = 0.0
    todo.sort(key=lambda s: (rank.get(s.needs, 3), secs[s.results]))
    names = {s.results for s in todo}
    ordered: list[freshness.Status] = []
    placed: set[str] = set()

    def place(s: freshness.Status, seen: frozenset = frozenset()) -> None:
        if s.results in placed or s.results in seen:
            return
        for dep in _reads(command_of({"command": s.command})):
            if dep != s.results and dep in names:
                place(next(t for t in todo if t.results == dep), seen | {s.results})
        placed.add(s.results)
        ordered.append(s)

    for s in todo:
        place(s)
    return ordered


def _estimate(statuses: list[freshness.Status]) -> float:
    total = 0.0
    for s in statuses:
        try:
            total += float(P.read(REPO / s.results)[1].get("seconds") or 0)
        except ValueError:
            pass
    return total


#: a timing run starts once the 1-minute load average is below this (docs/provenance.md)
QUIET_LOAD = P.QUIET_LOAD
#: how long ``make results`` waits for it before each timing run, by default (minutes)
LOAD_WAIT_MIN = 10.0


def wait_for_quiet(limit_s: float, threshold: float = QUIET_LOAD, *, every_s: float = 15.0,
                   load: Callable[[], float] = lambda: os.getloadavg()[0],
                   sleep: Callable[[float], None] = time.sleep,
                   clock: Callable[[], float] = time.monotonic) -> tuple[bool, float]:
    """Wait until the 1-minute load average is below ``threshold``, at most ``limit_s``
    seconds; returns whether it is, and the last load read."""
    end = clock() + limit_s
    now = load()
    while now >= threshold and clock() < end:
        sleep(max(0.0, min(every_s, end - clock())))
        now = load()
    return now < threshold, now


def main(*, budget_min: float | None = None, dry_run: bool = False, load_wait_min: float = LOAD_WAIT_MIN) -> int:
    from experiments import certify

    unverified = [s.results for s in freshness.all_statuses() if s.state == "unverified" and s.kind == "training"]
    if unverified and not dry_run:
        print(f"results: verifying {len(unverified)} unverified training results first")
        certify.verify(unverified)
    todo = plan()
    if dry_run and unverified:  # verify decides which of them need a re-run: not planned here
        print(f"results: {len(unverified)} unverified training results would be verified first "
              f"(python -m experiments verify); those a witness finds changed are then re-run")
        todo = [s for s in todo if s.results not in unverified]
    root = os.geteuid() == 0
    runnable = [s for s in todo if s.needs == "cpu" or (s.needs == "netns" and root)]
    elsewhere = [s for s in todo if s not in runnable]
    est = _estimate(runnable)
    print(f"results: {len(runnable)} to re-run here (estimated {est / 60:.0f} min from their last runs)"
          + (f", {len(elsewhere)} need another machine" if elsewhere else ""))
    for s in elsewhere:
        need = "a GPU" if s.needs == "gpu" else "root for the netns cluster"
        print(f"  needs {need}: {s.results}: {command_of({'command': s.command})}")
    if dry_run:
        for s in runnable:
            print(f"  would run: {s.results}: {command_of({'command': s.command})}")
        return 0
    t0 = time.perf_counter()
    done: list[str] = []
    for i, s in enumerate(runnable):
        if budget_min is not None and time.perf_counter() - t0 > budget_min * 60:
            left = runnable[i:]
            print(f"results: budget of {budget_min:g} min spent; {len(left)} left (estimated "
                  f"{_estimate(left) / 60:.0f} min): {', '.join(x.results for x in left)}; run again to resume")
            break
        cmd = command_of({"command": s.command})
        if s.kind == "timing" and load_wait_min > 0:
            la = os.getloadavg()[0]
            if la >= QUIET_LOAD:
                print(f"results: {s.results} is a timing result: waiting up to {load_wait_min:g} min for the "
                      f"1-minute load ({la:.2f}) to fall below {QUIET_LOAD}", flush=True)
            quiet, la = wait_for_quiet(load_wait_min * 60)
            if not quiet:
                print(f"results: the 1-minute load is still {la:.2f} after {load_wait_min:g} min: running "
                      f"{s.results} anyway; its figures will be marked as taken under load (the load is "
                      "recorded in its provenance and shown under its table)", flush=True)
        print(f"results: [{i + 1}/{len(runnable)}] {s.results}: {cmd}", flush=True)
        rc = subprocess.run(cmd, shell=True, cwd=REPO).returncode
        if rc != 0:
            print(f"results: {s.results}: the command exited {rc}; the file is left as it was")
            continue
        done.append(s.results)
        if freshness.status(s.results, P.read(REPO / s.results)[1]).kind == "training":
            certify.verify([s.results])  # records its witnesses for this run
    from experiments import render

    render.main([])
    print(f"results: ran {len(done)}: {', '.join(done) or 'none'} in {(time.perf_counter() - t0) / 60:.1f} min")
    return 0


def list_all() -> int:
    """Every experiment script and benchmark spec, with the results files made by it."""
    from experiments import study

    specs = set(study.studies())
    made: dict[str, list[str]] = {}
    for p in freshness.result_paths():
        try:
            cmd = str(P.read(p)[1].get("command") or "")
        except ValueError:
            continue
        m = re.search(r"-m experiments(?:\.| run )(\w+)", P.as_module(cmd))
        for name in ({f"{m.group(1)}.py"} | ({f"{m.group(1)}.toml"} if m.group(1) in specs else set())) if m else set():
            made.setdefault(name, []).append(str(p.relative_to(REPO)))
        spec = re.search(r"--spec (experiments/[\w.-]+\.toml)", cmd)
        if spec:
            made.setdefault(Path(spec.group(1)).name, []).append(str(p.relative_to(REPO)))
    here = Path(__file__).resolve().parent
    for f in sorted([*here.glob("*.py"), *here.glob("*.toml"), *here.glob("studies/*.toml")]):
        if f.name.startswith("_") or f.name in ("__main__.py",):
            continue
        if f.suffix == ".py":  # the docstring's first paragraph (after a #! line too)
            import ast

            doc = (ast.get_docstring(ast.parse(f.read_text(encoding="utf-8"))) or "").split("\n\n")[0]
            doc = " ".join(doc.split()) or f.stem.replace("_", " ")
        else:  # a spec: the first sentence of its opening comment
            doc = study.describe(f)
        doc = doc if len(doc) <= 110 else doc[:107].rstrip() + "..."
        res = made.get(f.name, [])
        print(f"{f.relative_to(here)}: {doc}" + (f"\n    writes: {', '.join(sorted(set(res)))}" if res else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
